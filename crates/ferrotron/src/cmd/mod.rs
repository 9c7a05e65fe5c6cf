pub mod backend;
pub mod bench;
mod bench_async;
mod bench_checkpoint;
mod bench_context;
mod bench_lora;
mod bench_predict;
mod bench_qlora;
mod bench_train;
mod bench_zero3;
pub mod calibrate;
pub mod checkpoint;
pub mod grads;
pub mod launch;
pub mod plan;
pub mod profile;
pub mod report;
pub mod schedule;
pub mod train;
pub mod verify;

/// A `--layout` with every key given: `auto` needs the planner, which `train` and `plan` consult.
pub fn concrete_layout(spec: &str) -> anyhow::Result<ferrotron_core::layout::Layout> {
    let parsed = ferrotron_core::layout::LayoutSpec::parse(spec)?;
    if !parsed.auto_keys.is_empty() {
        anyhow::bail!(
            "--layout `{spec}`: `auto` ({}) is chosen by the planner in `ferrotron train` and \
             `ferrotron plan`; here give values (an omitted key takes its default)",
            parsed.auto_keys.join(", ")
        );
    }
    Ok(parsed.layout)
}

/// Counts that must be at least 1: a clear error from the argument parser rather than a panic later.
pub(crate) fn positive() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// A device count the threads backend runs: 1 to [`ferrotron_engine::comm::ThreadWorld::MAX_DEVICES`].
pub(crate) fn device_count() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new()
        .range(1..=ferrotron_engine::comm::ThreadWorld::MAX_DEVICES as u64)
}

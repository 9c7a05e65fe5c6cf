//! Profiling a layout: a few steps run on the threads backend and every measured figure put beside
//! the planner's prediction for the same layout (`times.rs`, `tables.rs`), with a verdict where
//! they disagree (`verdicts.rs`), and a Perfetto trace. `ferrotron profile` prints and writes it.

mod tables;
mod times;
mod verdicts;

use anyhow::{bail, Result};
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{simulated_timeline, Plan, PlanInput};
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::comm::{Comm, ThreadWorld};
use ferrotron_engine::memory;
use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
use ferrotron_engine::parallel::{MeshStep, StepReport, Training};
use ferrotron_engine::runtime::{plan_input, resolve_layout, resolve_model, TrainConfig};
use ferrotron_engine::transformer::{ParamStore, TokenBatch};
use std::time::Duration;
pub(crate) use tables::Tables;
pub(crate) use times::StepTimes;

/// What to profile.
pub(crate) struct ProfileSettings {
    pub model: String,
    pub layout: LayoutSpec,
    pub batch: usize,
    pub seq: usize,
    pub steps: usize,
    pub cluster: String,
    pub device_memory: Option<String>,
    /// A figure further than this from its prediction gets a verdict.
    pub threshold: f64,
    /// A device computing this fraction above its stage's median is a straggler.
    pub straggler_threshold: f64,
    /// A device made slow on purpose, and by how many milliseconds per action.
    pub slow_device: Option<usize>,
    pub slow_device_ms: f64,
}

/// What one device measured in the reported step.
pub(crate) struct Measured {
    pub report: StepReport,
}

/// A profiled layout: what was measured, what was predicted, and the verdicts.
pub(crate) struct Profile {
    pub layout: Layout,
    pub input: PlanInput,
    pub plan: Plan,
    pub devices: Vec<Measured>,
    /// (tp rank, dp rank, stage) of every device.
    pub coords: Vec<ferrotron_core::rank::Coords>,
    pub tables: Tables,
    pub times: StepTimes,
    pub verdicts: Vec<String>,
}

/// Runs `s.steps` steps of the layout and judges the median one against the plan.
pub(crate) fn profile(s: &ProfileSettings) -> Result<Profile> {
    if s.steps == 0 || s.batch == 0 || s.seq < 2 {
        bail!("--steps and --batch must be positive and --seq at least 2");
    }
    if !(s.slow_device_ms.is_finite() && s.slow_device_ms >= 0.0 && s.threshold >= 0.0) {
        bail!("--slow-device-ms and --threshold must be non-negative numbers");
    }
    let cfg = {
        let mut c = TrainConfig::default();
        c.input.model = s.model.clone();
        c.optimizer.batch_size = s.batch;
        c.input.seq_len = s.seq;
        c.optimizer.steps = s.steps;
        c.parallelism.cluster = s.cluster.clone();
        c.parallelism.device_memory = s.device_memory.clone();
        c.parallelism.layout = s.layout.clone();
        c
    };
    let (model, params, _) = resolve_model(&s.model, 0)?;
    if s.seq > model.max_sequence_length() {
        bail!(
            "--seq {} exceeds the model's max_position_embeddings {}",
            s.seq,
            model.max_position_embeddings
        );
    }
    let input = plan_input(&cfg, &model, None)?;
    let plan = resolve_layout(&s.layout, &input)?.swap_remove(0);
    let layout = plan.layout;
    if let Some(d) = s.slow_device.filter(|&d| d >= layout.world_size()) {
        bail!(
            "--slow-device {d}: layout `{layout}` has {} devices",
            layout.world_size()
        );
    }
    let capacity = cfg
        .parallelism
        .device_memory
        .as_deref()
        .map(ferrotron_engine::runtime::parse_bytes)
        .transpose()?;
    let per_device = measure(s, &model, &params, &layout, capacity)?;
    let reported = median_step(&per_device);
    let devices: Vec<Measured> = per_device
        .into_iter()
        .map(|mut steps| Measured {
            report: steps.swap_remove(reported),
        })
        .collect();
    judge(s, layout, input, plan, devices)
}

/// Puts the measured step beside the plan: tables, step times and verdicts.
fn judge(
    s: &ProfileSettings,
    layout: Layout,
    input: PlanInput,
    plan: Plan,
    devices: Vec<Measured>,
) -> Result<Profile> {
    let world = layout.world_size();
    let predicted_timeline = simulated_timeline(&input, &layout)?;
    // The planner's idle fraction of each stage: its simulated schedule's gaps.
    let predicted_idle: Vec<f64> = (0..layout.pp)
        .map(|st| {
            predicted_timeline
                .as_ref()
                .map_or(plan.bubble_fraction, |tl| {
                    1.0 - tl.busy[st] / tl.makespan.max(1e-12)
                })
        })
        .collect();
    let grid = layout.rank_grid(world);
    let coords: Vec<ferrotron_core::rank::Coords> = (0..world).map(|r| grid.coords(r)).collect();
    let tables = Tables::of(&input, &layout, &plan, &devices, &coords, &predicted_idle);
    let times = StepTimes::of(&devices, &plan, predicted_timeline.as_ref(), layout.pp);
    let mut verdicts = times.verdicts(s.threshold);
    verdicts.extend(verdicts::verdicts(&verdicts::Evidence {
        devices: &devices,
        coords: &coords,
        plan: &plan,
        predicted_idle: &predicted_idle,
        threshold: s.threshold,
        straggler_threshold: s.straggler_threshold,
    }));
    Ok(Profile {
        layout,
        input,
        plan,
        devices,
        coords,
        tables,
        times,
        verdicts,
    })
}

/// Every device's report of every step, run on threads with deterministic token batches.
fn measure(
    s: &ProfileSettings,
    model: &ModelConfig,
    params: &ParamStore,
    layout: &Layout,
    capacity: Option<u64>,
) -> Result<Vec<Vec<StepReport>>> {
    let partition = StagePartition::for_layout(model, layout)?;
    let batches = token_batches(model.vocab_size, s.steps, s.batch, s.seq);
    let world = layout.world_size();
    let accounts = memory::Accounts::claim(world);
    let lr = LrSchedule {
        peak_lr: 1e-4,
        min_lr: 1e-4,
        warmup_steps: 0,
        total_steps: s.steps,
    };
    let slow = s.slow_device.map(|d| (d, s.slow_device_ms / 1e3));
    let results = ThreadWorld::new(world)
        .timeout(Duration::from_secs(600))
        .run(|c| -> ferrotron_engine::Result<Vec<StepReport>> {
            memory::set_capacity(accounts.base + c.rank(), capacity);
            let mut step = MeshStep::new(model, params, &batches[0], layout, &partition)?
                .with_account_base(accounts.base)
                .with_slow_device(slow);
            let mut reports = Vec::new();
            step.train_device(
                c,
                &Training {
                    steps: s.steps,
                    batch_of: &|k| batches[k].clone(),
                    adam: AdamWConfig::default(),
                    lr: &lr,
                    clip: 1.0,
                    stop: &|| false,
                },
                &mut |_, _, _, r| {
                    reports.push(r.clone());
                    Ok(())
                },
            )?;
            memory::set_capacity(accounts.base + c.rank(), None);
            Ok(reports)
        });
    let mut per_device = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        per_device.push(
            res.map_err(|e| anyhow::anyhow!("device {r}: {e}"))?
                .map_err(|e| anyhow::anyhow!("device {r}: {e}"))?,
        );
    }
    Ok(per_device)
}

/// Deterministic token batches over a vocabulary (xorshift).
fn token_batches(vocab: usize, steps: usize, batch: usize, seq: usize) -> Vec<TokenBatch> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..steps)
        .map(|_| TokenBatch {
            ids: (0..batch * seq)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % vocab as u64) as u32
                })
                .collect(),
            batch,
            seq,
        })
        .collect()
}

/// The step to report: of the steps after the first (which pays for first touches of memory), the
/// one whose step time (the slowest device's) is the median. One step's device time moves by tens
/// of percent on a shared machine; the median of several does not.
fn median_step(per_device: &[Vec<StepReport>]) -> usize {
    let steps = per_device.iter().map(Vec::len).min().unwrap_or(0);
    let span = |k: usize| per_device.iter().map(|d| d[k].span_s).fold(0.0, f64::max);
    let mut candidates: Vec<usize> = (steps.min(1)..steps).collect();
    candidates.sort_by(|&a, &b| span(a).total_cmp(&span(b)));
    candidates.get(candidates.len() / 2).copied().unwrap_or(0)
}
/// Chrome trace-event JSON: one track per device, one event per action (device time, µs), and the
/// step's remainder after the last action (optimizer step and reductions) as one event.
pub(crate) fn trace(devices: &[Measured], names: &[String]) -> serde_json::Value {
    let mut events = Vec::new();
    for (d, m) in devices.iter().enumerate() {
        events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": names[d]}}));
        for &(a, t0, t1) in &m.report.timeline {
            events.push(ferrotron_engine::parallel::action_event(&a, d, t0, t1));
        }
        let r = &m.report;
        let mut extra: Vec<(&str, &str, f64, f64)> = r
            .transfers
            .iter()
            .map(|(what, t0, t1)| (what.as_str(), "pipeline transfer", *t0, *t1))
            .collect();
        extra.push((
            "gradient reductions + global norm",
            "collective",
            r.reduce_s.0,
            r.reduce_s.1,
        ));
        extra.push(("optimizer step", "optimizer", r.update_s.0, r.update_s.1));
        for (name, cat, t0, t1) in extra {
            events.push(serde_json::json!({
                "name": name, "cat": cat, "ph": "X", "pid": 0, "tid": d,
                "ts": t0 * 1e6, "dur": ((t1 - t0) * 1e6).max(0.0),
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

use anyhow::Result;
use clap::Args;
use ferrotron_core::layout::Schedule;
use ferrotron_core::schedule::{build, simulate, ActionCosts};

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, zbh1
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Micro-batches.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// Chunks per stage (interleaved).
    #[arg(long, default_value_t = 1)]
    vpp: usize,
}

/// Prints a schedule's per-stage action lists, its simulated timeline as stages × time slots with unit
/// costs (a forward 1 slot, a backward 2, each zero-bubble half 1), and its bubble.
pub fn run(a: ScheduleArgs) -> Result<()> {
    let kind = Schedule::parse(&a.schedule).ok_or_else(|| {
        anyhow::anyhow!(
            "--schedule: `{}` is not one of {}",
            a.schedule,
            Schedule::NAMES.join(", ")
        )
    })?;
    let s = build(kind, a.pp, a.micro_batches, a.vpp)?;
    println!("action lists (in order):");
    print!("{}", s.chart());
    // Unit costs per chunk action keep every event on whole slots; the bubble fraction does not
    // depend on the scale.
    let t = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)])?;
    println!("\ntime slots (F = 1, B = 2, I = W = 1; `.` idle):");
    print!("{}", t.slot_chart(a.pp, 1.0));
    println!(
        "bubble (idle / step, worst stage) {:.3}; peak stashed activations per stage {:?}",
        t.bubble_fraction(),
        t.peak_in_flight
    );
    Ok(())
}

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

const MAX_DRAWN_STAGES: usize = 64;
const MAX_DRAWN_SLOTS: usize = 400;

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
    // Unit costs per chunk action keep every event on whole slots; the bubble fraction does not
    // depend on the scale.
    let t = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)])?;
    let slots = t.makespan.round() as usize;
    if a.pp <= MAX_DRAWN_STAGES && slots <= MAX_DRAWN_SLOTS {
        println!("action lists (in order):");
        print!("{}", s.chart());
        println!("\ntime slots (F = 1, B = 2, I = W = 1; `.` idle):");
        print!("{}", t.slot_chart(a.pp, 1.0));
    } else {
        println!(
            "{} stages × {slots} time slots: too large to draw (at most {MAX_DRAWN_STAGES} stages and {MAX_DRAWN_SLOTS} slots are drawn)",
            a.pp
        );
    }
    let stashes = if a.pp <= MAX_DRAWN_STAGES {
        format!("per stage {:?}", t.peak_in_flight)
    } else {
        let most = t.peak_in_flight.iter().max().copied().unwrap_or(0);
        format!("at most {most} (stage 0's; {} stages)", a.pp)
    };
    println!(
        "bubble (idle / step, worst stage) {:.3}; peak stashed activations {stashes}",
        t.bubble_fraction()
    );
    Ok(())
}

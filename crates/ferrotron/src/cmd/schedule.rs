use anyhow::Result;
use clap::Args;
use ferrotron_core::layout::Schedule;
use ferrotron_core::schedule::{build, build_async, simulate, ActionCosts};

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, zbh1, or the asynchronous pipedream, 2bw
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Micro-batches (per optimizer step).
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// Chunks per stage (interleaved).
    #[arg(long, default_value_t = 1)]
    vpp: usize,
    /// Asynchronous schedules: the optimizer steps the lists span (no flush between them).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Asynchronous schedules: each update waits for every stage's gradients of its micro-batches,
    /// as global-norm clipping (or a tied embedding) needs; otherwise only for its own stage's.
    #[arg(long)]
    global_norm: bool,
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
    let s = if kind.is_async() {
        build_async(kind, a.pp, a.micro_batches, a.steps, a.global_norm)?
    } else {
        build(kind, a.pp, a.micro_batches, a.vpp)?
    };
    // Unit costs per chunk action keep every event on whole slots; the bubble fraction does not
    // depend on the scale.
    let t = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)])?;
    let slots = t.makespan.round() as usize;
    if a.pp <= MAX_DRAWN_STAGES && slots <= MAX_DRAWN_SLOTS {
        if s.is_async() {
            println!(
                "action lists (in order; `F9@1`: forward of micro-batch 9 on weight version 1, its \
                 backward on the same; `U1→2`: update 1 makes version 2), {} steps of {} \
                 micro-batches without a flush:",
                a.steps, a.micro_batches
            );
        } else {
            println!("action lists (in order):");
        }
        print!("{}", s.chart());
        println!("\ntime slots (F = 1, B = 2, I = W = 1, U = 0; `.` idle):");
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
    if s.is_async() {
        let v = s.peak_stashed_versions();
        let shown = if a.pp <= MAX_DRAWN_STAGES {
            format!("{v:?}")
        } else {
            format!("at most {}", v.iter().max().copied().unwrap_or(0))
        };
        println!(
            "weight versions stashed besides the current one, per stage: {shown}; the bubble is \
             the one warm-up and drain of all {} steps",
            a.steps
        );
    }
    Ok(())
}

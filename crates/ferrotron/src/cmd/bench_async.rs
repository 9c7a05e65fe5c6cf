//! `bench pipeline`'s asynchronous part: PipeDream and PipeDream-2BW against 1F1B at the same stages
//! and micro-batches, trained for several steps on the threads backend: each stage's steady-state
//! idle fraction in device time (the difference between a longer and a shorter run, so that the one
//! warm-up and drain of an asynchronous run drops out), and its memory per term measured beside the
//! planner's prediction.

use anyhow::Result;
use ferrotron_core::layout::{Layout, Schedule};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{evaluate, PlanInput, PlanModel, StateDtypes};
use ferrotron_core::schedule::StagePartition;
use ferrotron_core::topology::Cluster;
use ferrotron_engine::comm::ThreadWorld;
use ferrotron_engine::memory::{format_bytes, MemoryTerms};
use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
use ferrotron_engine::parallel::{MeshStep, Training};
use ferrotron_engine::transformer::{ParamStore, TokenBatch};
use std::time::Duration;

/// Per device over a run: computing and span in device time, and the memory peak by term.
struct Run {
    busy: Vec<f64>,
    span: Vec<f64>,
    memory: Vec<MemoryTerms>,
}

fn train(
    cfg: &ModelConfig,
    params: &ParamStore,
    layout: &Layout,
    batch: &TokenBatch,
    steps: usize,
    clip: f64,
) -> Result<Run> {
    let part = StagePartition::for_layout(cfg, layout)?;
    let lr = LrSchedule {
        peak_lr: 1e-3,
        min_lr: 1e-3,
        warmup_steps: 0,
        total_steps: steps,
    };
    let results = ThreadWorld::new(layout.world_size())
        .timeout(Duration::from_secs(600))
        .run(|c| {
            let mut step = MeshStep::new(cfg, params, batch, layout, &part)?;
            let (mut busy, mut span, mut memory) = (0.0, 0.0, MemoryTerms::default());
            step.train_device(
                c,
                &Training {
                    steps,
                    batch_of: &|_| batch.clone(),
                    adam: AdamWConfig::default(),
                    lr: &lr,
                    clip,
                    stop: &|| false,
                },
                &mut |_, _, _, r| {
                    busy += r.busy_s;
                    span += r.span_s;
                    memory = r.memory.peak_terms();
                    Ok(())
                },
            )?;
            Ok::<_, ferrotron_engine::EngineError>((busy, span, memory))
        });
    let mut out = Run {
        busy: Vec::new(),
        span: Vec::new(),
        memory: Vec::new(),
    };
    for r in results {
        let (b, s, m) = r??;
        out.busy.push(b);
        out.span.push(s);
        out.memory.push(m);
    }
    Ok(out)
}

pub fn run(cfg: &ModelConfig, params: &ParamStore, p: usize, seq: usize) -> Result<()> {
    let m = 8;
    let (long, short) = (6, 3);
    let batch = TokenBatch {
        ids: (0..m * seq).map(|i| (i * 7 % 64) as u32).collect(),
        batch: m,
        seq,
    };
    println!(
        "\nasynchronous schedules against 1F1B, {p} stages, {m} micro-batches per step, trained \
         {long} and {short} steps: per stage, the steady-state idle (1 − Δcomputing / Δspan \
         between the two runs, device time) and memory measured / predicted (f32, stage 0 and the \
         last)"
    );
    println!(
        "| schedule | clipping | idle per stage (steady state) | weights stage 0 | gradients stage \
         0 | activations stage 0 | weights stage {last} | step (device s) |\n|---|---|---|---|---|---|---|---|",
        last = p - 1
    );
    let input = PlanInput {
        precision: StateDtypes::parse("weights=fp32,grads=fp32,master=fp32,optimizer=fp32")?,
        memory_reserve: 0.0,
        ..PlanInput::new(
            PlanModel::Shape(cfg.clone()),
            Cluster::parse("this-machine")?,
            seq,
            m,
        )
    };
    for (schedule, clip) in [
        (Schedule::OneFOneB, 1.0),
        (Schedule::TwoBw, 1.0),
        (Schedule::PipeDream, 1.0),
        (Schedule::PipeDream, 0.0),
    ] {
        let layout = Layout {
            pp: p,
            micro_batch_size: 1,
            schedule,
            ..Layout::default()
        };
        let (a, b) = (
            train(cfg, params, &layout, &batch, long, clip)?,
            train(cfg, params, &layout, &batch, short, clip)?,
        );
        let idle: Vec<String> = (0..p)
            .map(|s| {
                let busy = a.busy[s] - b.busy[s];
                let span = (a.span[s] - b.span[s]).max(f64::MIN_POSITIVE);
                format!("{:.1}%", 100.0 * (1.0 - busy / span).max(0.0))
            })
            .collect();
        let plan = evaluate(&input, &layout)?;
        let (m0, w0) = (&a.memory[0], &plan.memory_bytes_per_stage[0]);
        let (ml, wl) = (&a.memory[p - 1], &plan.memory_bytes_per_stage[p - 1]);
        let pair = |x: u64, y: u64| format!("{} / {}", format_bytes(x), format_bytes(y));
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} |",
            schedule.name(),
            if clip > 0.0 { "global norm" } else { "off" },
            idle.join(" · "),
            pair(m0.weights, w0.weights),
            pair(m0.gradients, w0.gradients),
            pair(m0.activations, w0.activations),
            pair(ml.weights, wl.weights),
            (a.span[0] - b.span[0]) / (long - short) as f64,
        );
    }
    println!(
        "(1F1B flushes every step, so its steady state is its bubble; PipeDream with global-norm \
         clipping waits at every update for the first stage's gradients of that micro-batch)"
    );
    Ok(())
}

//! `bench lora`: LoRA against full fine-tuning of the same model on the same batches, side by side
//! in one run, through the training loop (the 1×1×1 mesh, as `ferrotron train` runs one device):
//! tokens/s, the forward and backward split, and memory per term measured by the tracking
//! allocator beside the planner's prediction.

use anyhow::Result;
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig};
use ferrotron_core::plan::{evaluate, PlanInput, PlanModel};
use ferrotron_core::precision::{BaseQuantization, MixedPrecision};
use ferrotron_core::schedule::StagePartition;
use ferrotron_core::topology::Cluster;
use ferrotron_engine::comm::{ClockSource, ThreadWorld};
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::memory::{format_bytes, MemoryTerms};
use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
use ferrotron_engine::parallel::{MeshStep, Training};
use ferrotron_engine::transformer::{TokenBatch, Trained};
use rand::{Rng, SeedableRng};

/// What one way of training measured.
pub(super) struct Measured {
    /// Median wall seconds per step, and the median forward and backward actions' seconds.
    pub step_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub memory: MemoryTerms,
    pub predicted: MemoryTerms,
    pub trained_params: usize,
}

/// How a measured run stores and computes: its precision policy and (QLoRA) its base's quantization.
#[derive(Clone, Copy, Default)]
pub(super) struct Numerics {
    pub precision: MixedPrecision,
    pub quantized: Option<BaseQuantization>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Trains `trained` (with LoRA, the adapters of `lora`) through the loop on `s`'s batches, stored
/// and computed as `numerics` says, and measures it.
fn measure(
    s: &Setup,
    trained: Trained,
    lora: Option<&LoraConfig>,
    numerics: Numerics,
) -> Result<Measured> {
    let Setup {
        cfg,
        batches,
        warmup,
        threads,
        mbs,
        ..
    } = s;
    let (cfg, warmup, threads, mbs) = (cfg, *warmup, *threads, *mbs);
    let b = &batches[0];
    let layout = Layout {
        micro_batch_size: mbs,
        ..Layout::default()
    };
    let partition = StagePartition::for_model(cfg, 1)?;
    let lr = LrSchedule {
        peak_lr: 3e-4,
        min_lr: 3e-4,
        warmup_steps: 0,
        total_steps: batches.len(),
    };
    let mut results = ThreadWorld::new(1).clock(ClockSource::Wall).run(|c| {
        let step = MeshStep::new(cfg, trained.params, b, &layout, &partition)?
            .with_kernel_threads(threads)
            .with_precision(numerics.precision);
        let mut step = match trained.lora {
            Some((base, l)) => step.with_lora(base, l),
            None => step,
        };
        let (mut steps, mut fwd, mut bwd, mut memory) = (vec![], vec![], vec![], None);
        step.train_device(
            c,
            &Training {
                steps: batches.len(),
                batch_of: &|k| batches[k].clone(),
                adam: AdamWConfig::default(),
                lr: &lr,
                clip: 1.0,
                stop: &|| false,
            },
            &mut |_, _, _, r| {
                if r.step >= warmup {
                    steps.push(r.wall_s);
                    fwd.push(action_seconds(&r.timeline, true));
                    bwd.push(action_seconds(&r.timeline, false));
                    memory = Some(r.memory.peak_terms());
                }
                Ok(())
            },
        )?;
        Ok::<_, ferrotron_engine::EngineError>((steps, fwd, bwd, memory))
    });
    let (steps, fwd, bwd, memory) = results.remove(0)??;
    let predicted = predicted_memory(cfg, b, &layout, lora, numerics)?;
    Ok(Measured {
        step_s: median(steps),
        forward_s: median(fwd),
        backward_s: median(bwd),
        memory: memory.expect("measured steps"),
        predicted,
        trained_params: trained.params.numel(),
    })
}

/// Seconds a step's timeline spent in forward actions (`forward`), or in the others.
fn action_seconds(timeline: &[(ferrotron_core::schedule::Action, f64, f64)], forward: bool) -> f64 {
    timeline
        .iter()
        .filter(|a| (a.0.kind() == "forward") == forward)
        .map(|a| a.2 - a.1)
        .sum()
}

/// The planner's memory per term for this one-device run.
fn predicted_memory(
    cfg: &ModelConfig,
    b: &TokenBatch,
    layout: &Layout,
    lora: Option<&LoraConfig>,
    numerics: Numerics,
) -> Result<MemoryTerms> {
    let input = PlanInput {
        precision: numerics.precision.state_dtypes(),
        lora: lora.cloned(),
        quantize_base: numerics.quantized,
        memory_reserve: 0.0,
        ..PlanInput::new(
            PlanModel::Shape(cfg.clone()),
            Cluster::parse("this-machine")?,
            b.seq,
            b.batch,
        )
    };
    Ok(evaluate(&input, layout)?.memory_bytes)
}

/// What `bench lora` compares: the model, the adapters' rank, the batch and its micro-batches.
pub struct LoraBenchArgs<'a> {
    pub model: &'a str,
    pub rank: usize,
    pub batch: usize,
    pub mbs: usize,
    pub seq: usize,
    pub steps: usize,
    pub threads: usize,
}

/// What both LoRA benchmarks run on: the model, its base, fresh adapters and the batches (two
/// untimed steps first).
pub(super) struct Setup {
    pub cfg: ModelConfig,
    pub base: ferrotron_engine::transformer::ParamStore,
    pub lora: LoraConfig,
    pub adapters: Adapters,
    pub batches: Vec<TokenBatch>,
    pub warmup: usize,
    pub threads: usize,
    /// Sequences per micro-batch.
    pub mbs: usize,
}

impl Setup {
    /// [`measure`] on these batches.
    pub fn measure(
        &self,
        trained: Trained,
        lora: Option<&LoraConfig>,
        numerics: Numerics,
    ) -> Result<Measured> {
        measure(self, trained, lora, numerics)
    }
}

pub(super) fn setup(a: &LoraBenchArgs) -> Result<Setup> {
    if !a.batch.is_multiple_of(a.mbs) {
        anyhow::bail!("--batch {} is not a multiple of --mbs {}", a.batch, a.mbs);
    }
    let (cfg, base, _) = ferrotron_engine::runtime::resolve_model(a.model, 0)?;
    let lora = LoraConfig::new(&cfg, a.rank, 2.0 * a.rank as f64, &[])?;
    let adapters = Adapters::init(&cfg, lora.clone(), 1);
    let threads = if a.threads == 0 {
        ferrotron_engine::kernels::CpuBackend::default().threads
    } else {
        a.threads
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let warmup = 2;
    let batches: Vec<TokenBatch> = (0..warmup + a.steps)
        .map(|_| TokenBatch {
            ids: (0..a.batch * a.seq)
                .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
                .collect(),
            batch: a.batch,
            seq: a.seq,
        })
        .collect();
    Ok(Setup {
        cfg,
        base,
        lora,
        adapters,
        batches,
        warmup,
        threads,
        mbs: a.mbs,
    })
}

pub fn run(a: LoraBenchArgs) -> Result<()> {
    let s = setup(&a)?;
    let full = s.measure(Trained::full(&s.base), None, Numerics::default())?;
    let trained = Trained::lora(&s.base, &s.lora, &s.adapters.params);
    let adapted = s.measure(trained, Some(&s.lora), Numerics::default())?;
    let LoraBenchArgs {
        model,
        rank,
        batch,
        mbs,
        seq,
        ..
    } = a;
    let (cfg, lora, threads) = (&s.cfg, &s.lora, s.threads);
    let tokens = (batch * seq) as f64;
    println!(
        "ferrotron bench lora: {model} ({:.2}M parameters), batch {batch} x seq {seq} in \
         micro-batches of {mbs}, f32, AdamW, \
         {threads} threads, one device through the training loop; LoRA rank {rank}, alpha {} on {}",
        cfg.num_params() as f64 / 1e6,
        lora.alpha,
        lora.targets.join(", ")
    );
    print_comparison(&full, &adapted, tokens);
    print_memory(&full, &adapted, rank);
    Ok(())
}

/// Full fine-tuning beside LoRA: parameters trained, speed and time per pass.
fn print_comparison(full: &Measured, adapted: &Measured, tokens: f64) {
    println!("\n| | full fine-tuning | LoRA | LoRA / full |\n|---|---|---|---|");
    let row = |what: &str, a: f64, b: f64, unit: &dyn Fn(f64) -> String| {
        println!("| {what} | {} | {} | {:.3} |", unit(a), unit(b), b / a);
    };
    let secs = |x: f64| format!("{x:.4}");
    let count = |x: f64| format!("{:.0}", x);
    row(
        "trained parameters",
        full.trained_params as f64,
        adapted.trained_params as f64,
        &count,
    );
    row(
        "tokens/s",
        tokens / full.step_s,
        tokens / adapted.step_s,
        &|x| format!("{x:.1}"),
    );
    row("step (s, median)", full.step_s, adapted.step_s, &secs);
    row("forward (s)", full.forward_s, adapted.forward_s, &secs);
    row("backward (s)", full.backward_s, adapted.backward_s, &secs);
}

/// Memory per term, measured beside the planner's, for both.
fn print_memory(full: &Measured, adapted: &Measured, rank: usize) {
    println!(
        "\nmemory per term, measured / predicted by the planner (`plan --lora-rank {rank}`):\n"
    );
    println!("| term | full fine-tuning | LoRA |\n|---|---|---|");
    let terms = |m: &MemoryTerms| {
        [
            m.weights,
            m.gradients,
            m.master_weights,
            m.optimizer_states,
            m.activations,
            m.comm_buffers,
            m.total,
        ]
    };
    let names = [
        "weights",
        "gradients",
        "master_weights",
        "optimizer_states",
        "activations",
        "comm_buffers",
        "total",
    ];
    let (fm, fp, lm, lp) = (
        terms(&full.memory),
        terms(&full.predicted),
        terms(&adapted.memory),
        terms(&adapted.predicted),
    );
    for (i, name) in names.iter().enumerate() {
        println!(
            "| {name} | {} / {} | {} / {} |",
            format_bytes(fm[i]),
            format_bytes(fp[i]),
            format_bytes(lm[i]),
            format_bytes(lp[i])
        );
    }
}

//! `ferrotron bench train`: one device's training step, timed side by side with the bare kernels it
//! is made of, beside the FLOP rate it implies and the peak measured on this machine.

use super::positive;
use anyhow::Result;
use clap::Args;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_engine::comm::ThreadWorld;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::optim::{AdamW, AdamWConfig};
use ferrotron_engine::runtime::engine_preset;
use ferrotron_engine::transformer::{ParamStore, TokenBatch, Transformer};
use rand::{Rng, SeedableRng};
use std::time::Instant;

#[derive(Args)]
pub struct TrainBench {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-bench")]
    model: String,
    /// Sequences per step.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 256)]
    seq: usize,
    /// Steps run first and not timed.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Steps timed.
    #[arg(long, value_parser = positive(), default_value_t = 10)]
    steps: usize,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// `f32`, or mixed precision `bf16` (the linear layers' products in bf16 on the CPU's bf16
    /// dot-product instructions; 16-bit weights, gradients and activations) or `fp16` (16-bit
    /// storage with loss scaling, f32 products).
    #[arg(long, default_value_t = MixedPrecision::F32)]
    precision: MixedPrecision,
}

pub fn run(b: TrainBench) -> Result<()> {
    let cfg = engine_preset(&b.model)?;
    let be = if b.threads == 0 {
        CpuBackend::default()
    } else {
        CpuBackend::with_threads(b.threads)
    }
    .computing(b.precision.products());
    let flop = cfg.train_flops(b.batch, b.seq);
    let tokens = b.batch * b.seq;
    let BareSteps {
        forward: fwd,
        backward: bwd,
        adamw: opt_t,
        losses,
    } = bare_steps(&cfg, &b, &be);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let step: Vec<f64> = (0..fwd.len()).map(|i| fwd[i] + bwd[i] + opt_t[i]).collect();
    let mut sorted = step.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let total: f64 = step.iter().sum();
    println!(
        "ferrotron bench train: {} ({:.2}M params, matmul N={:.2}M), batch {} x seq {}, {}, AdamW, threads {}",
        b.model,
        cfg.num_params() as f64 / 1e6,
        cfg.matmul_params() as f64 / 1e6,
        b.batch,
        b.seq,
        b.precision,
        be.threads
    );
    if b.precision != MixedPrecision::F32 {
        println!(
            "(the bare kernels below run the products in {}, on f32 weights; the training loop stores weights, gradients and activations in 16 bits)",
            b.precision.products().name()
        );
    }
    println!(
        "FLOP/step = 6·N·tokens + 12·layers·hidden·seq·tokens = {:.1} G",
        flop / 1e9
    );
    println!("| metric | value |\n|---|---|");
    println!(
        "| step time mean / median (s) | {:.3} / {:.3} |",
        total / step.len() as f64,
        median
    );
    println!(
        "| forward / backward / AdamW (s) | {:.3} / {:.3} / {:.3} |",
        mean(&fwd),
        mean(&bwd),
        mean(&opt_t)
    );
    println!(
        "| tokens/s | {:.1} |",
        tokens as f64 * step.len() as f64 / total
    );
    println!(
        "| GFLOP/s | {:.1} |",
        flop * step.len() as f64 / total / 1e9
    );
    // The peak `plan` and `train` take MFU against: `this-machine`'s device is one core (its
    // measured peak once calibrated); these kernels run on `threads` of them.
    let core = ferrotron_core::topology::Cluster::parse("this-machine")?.peak_flops;
    println!(
        "| MFU (of {} threads × this-machine's {:.1} GFLOP/s a core) | {:.1}% |",
        be.threads,
        core / 1e9,
        100.0 * flop * step.len() as f64 / total / (core * be.threads as f64)
    );
    let engine = engine_step_times(&cfg, &b, be.threads)?;
    let engine_total: f64 = engine.iter().sum();
    let engine_tps = tokens as f64 * engine.len() as f64 / engine_total;
    println!("| tokens/s through the training loop (1×1×1 mesh) | {engine_tps:.1} |");
    println!(
        "| training loop / bare kernels | {:.3} |",
        engine_tps / (tokens as f64 * step.len() as f64 / total)
    );
    println!(
        "| loss first -> last | {:.3} -> {:.3} |",
        losses[0],
        losses[losses.len() - 1]
    );
    Ok(())
}

/// Wall seconds of each measured step of the same model and batches through the engine's training
/// loop: the 1×1×1 mesh (`MeshStep::train_device`), as `ferrotron train` runs one device.
/// Each measured step of the bare kernels (forward, backward, AdamW; warm-up steps left out) and
/// every step's loss.
struct BareSteps {
    forward: Vec<f64>,
    backward: Vec<f64>,
    adamw: Vec<f64>,
    losses: Vec<f64>,
}

fn bare_steps(
    cfg: &ferrotron_core::model::ModelConfig,
    b: &TrainBench,
    be: &CpuBackend,
) -> BareSteps {
    let mut params = ParamStore::init_random(cfg, 0);
    let tf = Transformer::new(cfg, &params);
    let mut grads = params.zeros_like();
    // Same optimizer settings as the PyTorch peer script: AdamW(lr=3e-4, wd=0.1), betas (0.9, 0.999).
    let mut opt = AdamW::new(
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        &params,
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut out = BareSteps {
        forward: Vec::new(),
        backward: Vec::new(),
        adamw: Vec::new(),
        losses: Vec::new(),
    };
    for i in 0..b.warmup + b.steps {
        let ids = (0..b.batch * b.seq)
            .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
            .collect();
        let batch = TokenBatch {
            ids,
            batch: b.batch,
            seq: b.seq,
        };
        let t0 = Instant::now();
        let state = tf.forward(be, &params, &batch);
        let t1 = Instant::now();
        grads.zero_();
        let n = batch.predicted_tokens();
        let loss = tf.backward(
            be,
            &params,
            &mut grads,
            state,
            &batch.targets(),
            1.0 / n as f32,
        ) / n as f64;
        let t2 = Instant::now();
        opt.step(&mut params, &grads, 3e-4);
        let t3 = Instant::now();
        out.losses.push(loss);
        if i >= b.warmup {
            out.forward.push((t1 - t0).as_secs_f64());
            out.backward.push((t2 - t1).as_secs_f64());
            out.adamw.push((t3 - t2).as_secs_f64());
        }
    }
    out
}

fn engine_step_times(
    cfg: &ferrotron_core::model::ModelConfig,
    b: &TrainBench,
    threads: usize,
) -> Result<Vec<f64>> {
    use ferrotron_core::layout::Layout;
    use ferrotron_core::schedule::StagePartition;
    use ferrotron_engine::comm::ClockSource;
    use ferrotron_engine::optim::LrSchedule;
    use ferrotron_engine::parallel::{MeshStep, Training};
    let params = ParamStore::init_random(cfg, 0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let batches: Vec<TokenBatch> = (0..b.warmup + b.steps)
        .map(|_| TokenBatch {
            ids: (0..b.batch * b.seq)
                .map(|_| rng.gen_range(0..cfg.vocab_size as u32))
                .collect(),
            batch: b.batch,
            seq: b.seq,
        })
        .collect();
    let layout = Layout {
        micro_batch_size: b.batch,
        ..Layout::default()
    };
    let partition = StagePartition::for_model(cfg, 1)?;
    let lr = LrSchedule {
        peak_lr: 3e-4,
        min_lr: 3e-4,
        warmup_steps: 0,
        total_steps: batches.len(),
    };
    let adam = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut results = ThreadWorld::new(1).clock(ClockSource::Wall).run(|c| {
        let mut step = MeshStep::new(cfg, &params, &batches[0], &layout, &partition)?
            .with_kernel_threads(threads)
            .with_precision(b.precision);
        let mut times = Vec::new();
        step.train_device(
            c,
            &Training {
                steps: batches.len(),
                batch_of: &|k| batches[k].clone(),
                adam,
                lr: &lr,
                clip: 0.0,
                stop: &|| false,
            },
            &mut |_, _, _, r| {
                if r.step >= b.warmup {
                    times.push(r.wall_s);
                }
                Ok(())
            },
        )?;
        Ok::<_, ferrotron_engine::error::EngineError>(times)
    });
    Ok(results.remove(0)??)
}

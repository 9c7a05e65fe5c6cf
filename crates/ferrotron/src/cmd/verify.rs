use anyhow::{bail, Result};
use clap::Args;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::comm::CommBackend;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::parallel::TpShard;
use ferrotron_engine::runtime::{layout_step_of, run_step};
use ferrotron_engine::transformer::TokenBatch;
use std::path::PathBuf;

#[derive(Args)]
pub struct VerifyArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// The layout to check against the unsplit model.
    #[arg(long)]
    layout: String,
    /// safetensors with int64 `input_ids` [batch, seq]; default: a seeded random batch.
    #[arg(long)]
    tokens: Option<PathBuf>,
    /// Sequences of the random batch (without --tokens).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence of the random batch.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// With a pipeline layout: write the split run's timeline as Chrome trace-event JSON (Perfetto).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Largest accepted relative error, for the loss and for every gradient tensor (f32: 1e-5).
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f64,
    /// Where the split model's devices run: `threads` (one process) or `mpi` (one rank per device,
    /// under mpirun; needs a build with `--features mpi`). Rank 0 runs the unsplit model and reports.
    #[arg(long, default_value_t = CommBackend::Threads)]
    backend: CommBackend,
    /// A PEFT LoRA adapter directory on the model: the base is frozen and the adapters' loss and
    /// gradients are compared.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// With --adapter: QLoRA, the base's projections quantized to `nf4` (as bitsandbytes' NF4
    /// with double quantization) and dequantized a panel at a time into the GEMM's operand.
    #[arg(long)]
    quantize_base: Option<ferrotron_core::precision::BaseQuantization>,
    /// Asynchronous schedules (`schedule=2bw|pipedream`): train this many optimizer steps (AdamW,
    /// eps 1e-6, lr 1e-3, global-norm clipping at `--clip`) through the pipeline and through the
    /// single-device trainer that applies the same delays, and compare every parameter.
    #[arg(long)]
    steps: Option<usize>,
    /// With `--steps`: clip each update's gradients to this global norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
}

/// Runs the unsplit model and the split one on the same batch and compares loss and every gradient.
pub fn run(a: VerifyArgs) -> Result<()> {
    if !(a.tolerance.is_finite() && a.tolerance > 0.0) {
        bail!(
            "--tolerance {}: must be a positive relative error (f32: 1e-5)",
            a.tolerance
        );
    }
    let layout = super::concrete_layout(&a.layout)?;
    let model = super::backend::StepModel::load(&a.model, a.adapter.as_deref(), a.quantize_base)?;
    let (cfg, trained) = (&model.cfg, model.trained());
    let batch = verify_batch(&a, cfg)?;
    if layout.schedule.is_async() || a.steps.is_some() {
        return verify_async(&a, &model, &layout, &batch);
    }
    let be = CpuBackend::default();
    let backend = a.backend;
    let (loss, grads, run) = match backend {
        CommBackend::Threads => layout_step_of(cfg, trained, &batch, &layout, &be)?,
        CommBackend::Mpi => {
            match super::backend::mpi_layout_step(cfg, trained, &batch, &layout)? {
                Some((loss, grads, run)) => (loss, grads, Some(run)),
                None => return Ok(()), // rank 0 reports
            }
        }
    };
    describe_split(&layout, &model, backend)?;
    let mut reference = trained.params.zeros_like();
    let want = run_step(
        &trained.unsplit(cfg),
        &be,
        trained.params,
        &mut reference,
        &batch,
        batch.batch,
    )?;
    if let (Some(path), Some(run)) = (&a.trace, &run) {
        std::fs::write(path, serde_json::to_string(&run.chrome_trace())?)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        println!("trace written to {} (open in Perfetto)", path.display());
    }
    let loss_err = (loss - want.loss).abs() / want.loss.abs().max(1e-30);
    let (worst_name, worst) = worst_relative_error(&grads, &reference);
    println!(
        "layout {layout} on {} sequences of {} tokens",
        batch.batch, batch.seq
    );
    println!(
        "loss: unsplit {:.8}, split {loss:.8}, relative difference {loss_err:.2e}",
        want.loss
    );
    println!(
        "worst gradient: {worst_name} relative error {worst:.2e} (tolerance {:.0e})",
        a.tolerance
    );
    if loss_err > a.tolerance || worst > a.tolerance {
        // A mixture of experts' load-balancing loss is per micro-batch step; the unsplit model
        // takes it over the whole batch: only one micro-batch per replica compares like with like.
        let per_replica = batch.batch / (layout.dp.max(1) * layout.micro_batch_size.max(1));
        let hint = match (&cfg.moe, per_replica > 1) {
            (Some(_), true) => format!(
                " — a mixture of experts takes its load-balancing loss per micro-batch step, and \
                 this layout runs {per_replica} of them where the unsplit model runs the whole \
                 batch at once: give mbs={} (one micro-batch per replica) to compare the same function",
                batch.batch / layout.dp.max(1)
            ),
            _ => String::new(),
        };
        bail!(
            "the layout does not compute the unsplit model's function within {:.0e}{hint}",
            a.tolerance
        );
    }
    println!("OK: the split computes the same loss and gradients");
    Ok(())
}

/// The batch to verify on: the token file's, or seeded random tokens of the model's vocabulary.
fn verify_batch(a: &VerifyArgs, cfg: &ferrotron_core::model::ModelConfig) -> Result<TokenBatch> {
    let batch = match &a.tokens {
        Some(path) => ferrotron_engine::data::read_token_file(path)?,
        None => {
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let ids = (0..a.batch * a.seq)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % cfg.vocab_size as u64) as u32
                })
                .collect();
            TokenBatch {
                ids,
                batch: a.batch,
                seq: a.seq,
            }
        }
    };
    batch.check(cfg).map_err(|e| match &a.tokens {
        Some(path) => anyhow::anyhow!("{}: {e}", path.display()),
        None => anyhow::anyhow!("--batch {} --seq {}: {e}", a.batch, a.seq),
    })?;
    Ok(batch)
}

/// The largest relative error (L2 over a tensor) of any tensor of `got` against `want`, and its
/// name.
fn worst_relative_error(
    got: &ferrotron_engine::transformer::ParamStore,
    want: &ferrotron_engine::transformer::ParamStore,
) -> (String, f64) {
    let (mut worst_name, mut worst) = (String::new(), 0f64);
    for (spec, g) in got.specs.iter().zip(&got.tensors) {
        let w = want.get(&spec.name).expect("the same parameters");
        let num: f64 = g
            .iter()
            .zip(w)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum();
        let den: f64 = w.iter().map(|&y| (y as f64).powi(2)).sum();
        let e = (num / den.max(1e-300)).sqrt();
        if e > worst {
            (worst, worst_name) = (e, spec.name.clone());
        }
    }
    (worst_name, worst)
}

/// How the layout splits the model, in words: the pipeline's chunks, the tensor-parallel split,
/// the MPI ranks, the adapters.
fn describe_split(
    layout: &ferrotron_core::layout::Layout,
    model: &super::backend::StepModel,
    backend: CommBackend,
) -> Result<()> {
    let cfg = &model.cfg;
    if layout.pp > 1 {
        let partition = StagePartition::for_model(cfg, layout.pp * layout.vpp)?;
        let stages: Vec<String> = partition
            .layers
            .iter()
            .zip(&partition.costs)
            .map(|(r, c)| format!("layers {r:?} ({:.2} MFLOP/token)", c / 1e6))
            .collect();
        println!("pipeline chunks, split by compute: {}", stages.join(", "));
    }
    if layout.tp > 1 {
        println!("tensor parallel: {}", describe_tp_split(cfg, layout)?);
    }
    if backend == CommBackend::Mpi {
        println!(
            "split run: one MPI rank per device ({} ranks)",
            layout.world_size()
        );
    }
    if let Some(ad) = &model.adapters {
        println!(
            "LoRA adapters: rank {}, alpha {} on {} ({} tensors, the base frozen{})",
            ad.config.rank,
            ad.config.alpha,
            ad.config.targets.join(", "),
            ad.params.specs.len(),
            if model.params.is_quantized() {
                ", its projections in NF4"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// An asynchronous schedule over `--steps` steps against its delayed-update reference: the worst
/// relative error of any parameter tensor, non-zero exit above the tolerance.
fn verify_async(
    a: &VerifyArgs,
    model: &super::backend::StepModel,
    layout: &ferrotron_core::layout::Layout,
    batch: &TokenBatch,
) -> Result<()> {
    use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
    use ferrotron_engine::runtime::{train_steps, DelayedReference};
    let steps = async_steps(a, layout, model)?;
    let (cfg, params) = (&model.cfg, &model.params);
    // Each step its own batch: the seeded batch shifted by the step (or the given one each time).
    let batches: Vec<TokenBatch> = (0..steps)
        .map(|k| TokenBatch {
            ids: batch
                .ids
                .iter()
                .map(|&i| ((i as usize + 7 * k) % cfg.vocab_size) as u32)
                .collect(),
            ..batch.clone()
        })
        .collect();
    let adam = AdamWConfig {
        eps: 1e-6,
        ..AdamWConfig::default()
    };
    let lr = LrSchedule {
        peak_lr: 1e-3,
        min_lr: 1e-3,
        warmup_steps: 0,
        total_steps: steps,
    };
    let never = |_: usize| false;
    let got = train_steps(
        cfg,
        params,
        layout,
        &batches,
        adam,
        &lr,
        a.clip,
        &never,
        MixedPrecision::F32,
    )?;
    let reference = DelayedReference {
        cfg,
        layout,
        adam,
        lr: &lr,
        clip: a.clip,
        precision: MixedPrecision::F32,
    };
    let want = reference.train(params, steps, &|k| batches[k].clone(), &never)?;
    let (worst_name, worst) = worst_relative_error(&got, &want);
    println!(
        "layout {layout}: {steps} steps of {} sequences of {} tokens (AdamW, lr 1e-3, clip {}), \
         against the single-device trainer that applies the schedule's delays",
        batch.batch, batch.seq, a.clip
    );
    println!(
        "worst parameter: {worst_name} relative error {worst:.2e} (tolerance {:.0e})",
        a.tolerance
    );
    if worst > a.tolerance {
        bail!(
            "the pipeline does not train as the delayed-update reference within {:.0e}",
            a.tolerance
        );
    }
    println!("OK: the asynchronous pipeline trains as its delayed-update reference");
    Ok(())
}

/// What each device of a tensor-parallel group holds, in words.
fn describe_tp_split(
    cfg: &ferrotron_core::model::ModelConfig,
    layout: &ferrotron_core::layout::Layout,
) -> Result<String> {
    let tp = layout.tp;
    let first = TpShard::of_layout(cfg, layout, 0)?.local_config(cfg);
    let kv = if cfg.num_kv_heads < tp {
        format!(
            "1 KV head (each replicated on {} devices)",
            tp / cfg.num_kv_heads
        )
    } else {
        format!("{} KV heads", first.num_kv_heads)
    };
    let padded = first.vocab_size * tp;
    let vocab = if padded == cfg.vocab_size {
        format!("{} vocabulary rows", first.vocab_size)
    } else {
        format!(
            "{} vocabulary rows (vocabulary padded {} -> {padded})",
            first.vocab_size, cfg.vocab_size
        )
    };
    // A mixture of experts: each expert's columns split, or under etp=1 the experts divided.
    let mlp = match &first.moe {
        Some(m) if layout.expert_blocks() > 1 => format!(
            "{} of every block's {} experts whole (etp=1; ep divides them further)",
            m.num_experts / tp,
            m.num_experts
        ),
        Some(m) => format!("{} columns of each expert", m.expert_size),
        None => format!("{} MLP columns", first.intermediate_size),
    };
    let dense_blocks = first
        .moe
        .as_ref()
        .is_some_and(|m| m.expert_layers(cfg.num_layers) < cfg.num_layers);
    let mlp = if dense_blocks {
        format!(
            "{mlp}, {} MLP columns of each dense block",
            first.intermediate_size
        )
    } else {
        mlp
    };
    Ok(format!(
        "each of {tp} devices holds {} heads, {kv}, {mlp}, {vocab}",
        first.num_heads
    ))
}

/// The steps `--steps` asks an asynchronous schedule to be verified over, after refusing what that
/// verification does not run.
fn async_steps(
    a: &VerifyArgs,
    layout: &ferrotron_core::layout::Layout,
    model: &super::backend::StepModel,
) -> Result<usize> {
    let name = layout.schedule.name();
    let Some(steps) = a.steps else {
        bail!(
            "schedule={name} is asynchronous: it changes the optimizer's semantics over steps, so \
             it is verified by training: give --steps K (compared with the single-device trainer \
             that applies the same delays)"
        );
    };
    if !layout.schedule.is_async() {
        bail!(
            "--steps compares an asynchronous schedule (schedule=2bw or pipedream) with its \
             delayed-update reference; `{name}` is verified on one step without it"
        );
    }
    if steps == 0 {
        bail!("--steps 0: give at least one step");
    }
    if !(a.clip.is_finite() && a.clip >= 0.0) {
        bail!("--clip {}: must be a non-negative norm (0: off)", a.clip);
    }
    if a.backend != CommBackend::Threads {
        bail!("--steps runs the pipeline on threads (--backend threads)");
    }
    if model.adapters.is_some() {
        bail!("--steps with --adapter: LoRA under an asynchronous schedule is not implemented");
    }
    Ok(steps)
}

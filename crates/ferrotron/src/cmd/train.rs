use anyhow::{Context, Result};
use clap::Args;
use ferrotron_engine::runtime::{train, TrainConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Every key of `run.toml` as a flag; a flag overrides the file, the file overrides the defaults.
#[derive(Args, serde::Serialize)]
pub struct TrainArgs {
    /// A TOML file with any of the keys below (flags win over it).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Preset (llama-small, llama-tiny, gpt2-tiny, llama-bench) or a Hugging Face model directory.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    /// `builtin:gnu-manuals`, or comma-separated text files or directories.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<String>,
    /// A tokenizer.json (default: the model directory's, or one trained on the data and cached).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    tokenizer: Option<PathBuf>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<usize>,
    /// Sequences per optimizer step.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_size: Option<usize>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    lr: Option<f64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    min_lr: Option<f64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    warmup_steps: Option<usize>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    weight_decay: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    beta1: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    beta2: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    adam_eps: Option<f32>,
    /// Clip the global gradient norm (0: off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    grad_clip: Option<f64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    eval_every: Option<usize>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    eval_batches: Option<usize>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    val_fraction: Option<f64>,
    /// Run directory: metrics.jsonl, train_config.json, model/.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    out_dir: Option<PathBuf>,
    /// Kernel threads (0: all cores).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// Layout spec, e.g. `dp=1,tp=1,pp=1,mbs=4`.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    layout: Option<String>,
    /// Precision of the saved model: f32, bf16, f16.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    save_dtype: Option<String>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_dir: Option<PathBuf>,
    /// The cluster the devices stand for (a `plan --cluster` spec; default this-machine).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<String>,
    /// Memory of each device, e.g. 64MiB (default: the cluster's); more is an out-of-memory error.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    device_memory: Option<String>,
    /// Allow a tensor-parallel group to span nodes.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    force_cross_node_tp: Option<bool>,
    /// threads (default) or mpi (one rank per device under mpirun; a build with --features mpi).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<String>,
    /// Warn of a straggler when a device computes this fraction above the median (default 0.2) ...
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    straggler_threshold: Option<f64>,
    /// ... for this many steps in a row (default 3).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    straggler_steps: Option<usize>,
    /// Drills: make this device compute --slow-device-ms longer per action.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    slow_device: Option<usize>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    slow_device_ms: Option<f64>,
    /// f32 (default), or mixed precision bf16 / fp16 (16-bit weights, gradients, activations).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    precision: Option<String>,
    /// fp16: initial loss scale (65536) and clean steps to double it (1000).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    loss_scale: Option<f64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    loss_scale_window: Option<usize>,
    /// Testing: an inf in the gradients at this step (fp16 skips it).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    inject_nonfinite_step: Option<usize>,
    /// Save a sharded checkpoint every this many steps (0: only after the last step).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_every: Option<usize>,
    /// Where checkpoints go (default: <out-dir>/checkpoints).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest this many checkpoints (0: all).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    keep_checkpoints: Option<usize>,
    /// Continue from a checkpoint (a step-NNNNNN directory, or a checkpoint directory with
    /// `latest`), resharded to this run's layout.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    resume: Option<PathBuf>,
}

/// Defaults, then the TOML file, then the flags.
fn resolve(args: &TrainArgs) -> Result<TrainConfig> {
    let mut merged = serde_json::Map::new();
    if let Some(path) = &args.config {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("{}: not valid TOML", path.display()))?;
        let value = serde_json::to_value(table)?;
        merged.extend(value.as_object().cloned().unwrap_or_default());
    }
    if let serde_json::Value::Object(flags) = serde_json::to_value(args)? {
        merged.extend(flags);
    }
    let source = args
        .config
        .as_ref()
        .map_or("flags".to_string(), |p| p.display().to_string());
    serde_json::from_value(serde_json::Value::Object(merged))
        .with_context(|| format!("{source}: bad train config"))
}

pub fn run(args: TrainArgs) -> Result<()> {
    let cfg = resolve(&args)?;
    eprintln!(
        "ferrotron train: model {}, data {}, {} steps x {} sequences x {} tokens -> {}",
        cfg.model,
        cfg.data,
        cfg.steps,
        cfg.batch_size,
        cfg.seq_len,
        cfg.out_dir.display()
    );
    if let Some(from) = &cfg.resume {
        let dir = ferrotron_engine::checkpoint::Checkpoint::resolve(from)?;
        eprintln!(
            "resuming from {} on layout `{}`",
            dir.display(),
            if cfg.layout.is_empty() {
                "dp=1,tp=1,pp=1"
            } else {
                &cfg.layout
            }
        );
    }
    let pb = ProgressBar::new(cfg.steps as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut last_val = None;
    let summary = train(&cfg, &mut |r| {
        for w in &r.warnings {
            // Printed whether or not the bar is shown (a hidden bar drops its log lines).
            pb.suspend(|| eprintln!("warning at step {}: {w}", r.step));
        }
        if let Some(v) = r.val_loss {
            last_val = Some(v);
            pb.suspend(|| {
                eprintln!(
                    "step {:>5}  train loss {:.4}  val loss {:.4}  lr {:.2e}  {:.0} tok/s",
                    r.step, r.loss, v, r.lr, r.tokens_per_s
                )
            });
        }
        let val = last_val.map_or(String::new(), |v| format!(" val {v:.3}"));
        pb.set_message(format!(
            "loss {:.3}{val} | {:.0} tok/s",
            r.loss, r.tokens_per_s
        ));
        pb.set_position(r.step as u64);
    })?;
    pb.finish_and_clear();
    if !summary.reporter {
        return Ok(()); // an MPI rank other than 0: rank 0 reports
    }
    println!(
        "done: {:.2}M parameters, {} train / {} validation tokens, {:.0} tokens/s",
        summary.num_params as f64 / 1e6,
        summary.train_tokens,
        summary.val_tokens,
        summary.tokens_per_s
    );
    println!(
        "validation loss {:.4} -> {:.4} (train loss {:.4}); model saved to {} (tokenizer {})",
        summary.initial_val_loss,
        summary.final_val_loss,
        summary.final_train_loss,
        summary.model_dir.display(),
        summary.tokenizer.display()
    );
    if !summary.devices.is_empty() {
        println!(
            "layout {}: per device, measured peak memory / the planner's prediction (MB)",
            summary.layout
        );
        println!("| device | stage | dp | tp | weights | gradients | master | optimizer | activations | comm | total | idle | sent/step | step (device s) | step (wall s) |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        let mb = |a: u64, b: u64| format!("{:.2} / {:.2}", a as f64 / 1e6, b as f64 / 1e6);
        for d in &summary.devices {
            let (m, p) = (&d.peak_memory_bytes, &d.predicted_memory_bytes);
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% | {} | {:.4} | {:.4} |",
                d.device,
                d.stage,
                d.dp_rank,
                d.tp_rank,
                mb(m.weights, p.weights),
                mb(m.gradients, p.gradients),
                mb(m.master_weights, p.master_weights),
                mb(m.optimizer_states, p.optimizer_states),
                mb(m.activations, p.activations),
                mb(m.comm_buffers, p.comm_buffers),
                mb(m.total, p.total),
                100.0 * d.idle_fraction,
                ferrotron_engine::memory::format_bytes(d.bytes_sent_per_step),
                d.step_time_s,
                d.wall_step_time_s,
            );
        }
    }
    println!("metrics: {}", cfg.out_dir.join("metrics.jsonl").display());
    println!(
        "checkpoints: {} (`ferrotron checkpoint inspect` it; `--resume` it on any layout)",
        cfg.checkpoint_dir
            .clone()
            .unwrap_or_else(|| cfg.out_dir.join("checkpoints"))
            .display()
    );
    Ok(())
}

use super::source::{resolve_model, ModelSource};
use super::step::{check_layout_runnable, run_step};
use crate::data::{self, SequenceSampler, TokenSplit};
use crate::error::{EngineError, Result};
use crate::hf::{self, StorageDtype};
use crate::kernels::CpuBackend;
use crate::memory::MemoryTerms;
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::parallel::{pipeline_step, TpShard};
use crate::transformer::{ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::schedule::StagePartition;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use std::time::Instant;

/// Every setting of a training run. Each is a key of `run.toml` and a `ferrotron train` flag.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// A preset name (trained from scratch) or a Hugging Face model directory (fine-tuned).
    pub model: String,
    /// `builtin:gnu-manuals`, or comma-separated text files / directories of text files.
    pub data: String,
    /// A `tokenizer.json`; default: the model directory's, or one trained on the data and cached.
    pub tokenizer: Option<PathBuf>,
    pub steps: usize,
    /// Sequences per optimizer step (the effective batch).
    pub batch_size: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub adam_eps: f32,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f64,
    pub seed: u64,
    /// Evaluate the validation loss every this many steps (and before the first and after the last).
    pub eval_every: usize,
    pub eval_batches: usize,
    /// Fraction of the token stream held out for validation.
    pub val_fraction: f64,
    pub out_dir: PathBuf,
    /// CPU threads for the kernels (0: all cores).
    pub threads: usize,
    /// The `--layout` spec.
    pub layout: String,
    /// Precision of the saved model: f32, bf16 or f16.
    pub save_dtype: String,
    /// Where trained tokenizers are cached (default: `$XDG_CACHE_HOME/ferrotron` or `~/.cache/ferrotron`).
    pub cache_dir: Option<PathBuf>,
}

impl Default for TrainConfig {
    /// The embedded default run: a ~4M-parameter Llama trained from scratch on the bundled manuals.
    fn default() -> Self {
        Self {
            model: "llama-small".into(),
            data: data::BUILTIN_NAME.into(),
            tokenizer: None,
            steps: 240,
            batch_size: 16,
            seq_len: 128,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 20,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            seed: 0,
            eval_every: 40,
            eval_batches: 8,
            val_fraction: 0.05,
            out_dir: "runs/default".into(),
            threads: 0,
            layout: String::new(),
            save_dtype: "f32".into(),
            cache_dir: None,
        }
    }
}

/// One device's figures for a step: memory by term, idle fraction, bytes sent, device-time step.
type DeviceReport = (MemoryTerms, f64, u64, f64);

/// What one optimizer step did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepReport {
    pub step: usize,
    pub total_steps: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub step_time_s: f64,
    pub val_loss: Option<f64>,
    pub memory: MemoryTerms,
}

#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub initial_val_loss: f64,
    pub final_val_loss: f64,
    pub final_train_loss: f64,
    pub tokens_per_s: f64,
    pub num_params: usize,
    pub model_dir: PathBuf,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub tokenizer: PathBuf,
}

fn default_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ferrotron")
}

impl TrainConfig {
    fn check(&self) -> Result<()> {
        let bad = |field: &str, msg: &str| {
            Err(EngineError::Invalid(format!(
                "train config `{field}`: {msg}"
            )))
        };
        if self.steps == 0 {
            return bad("steps", "must be positive");
        }
        if self.batch_size == 0 {
            return bad("batch_size", "must be positive");
        }
        if self.seq_len < 2 {
            return bad(
                "seq_len",
                "must be at least 2 (one token predicts the next)",
            );
        }
        if self.lr.is_nan() || self.lr <= 0.0 || self.min_lr < 0.0 {
            return bad("lr", "lr must be positive and min_lr non-negative");
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return bad("val_fraction", "must be in [0, 1)");
        }
        Ok(())
    }
}

fn mean_loss(
    tf: &Transformer,
    be: &CpuBackend,
    params: &ParamStore,
    batches: &[TokenBatch],
) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for b in batches {
        sum += tf.loss(be, params, b) * b.predicted_tokens() as f64;
        n += b.predicted_tokens();
    }
    sum / n.max(1) as f64
}

/// Trains as `cfg` says, calling `on_step` after every optimizer step. Appends one JSON object per
/// step to `<out_dir>/metrics.jsonl` and saves the final model as a Hugging Face directory.
pub fn train(cfg: &TrainConfig, on_step: &mut dyn FnMut(&StepReport)) -> Result<TrainSummary> {
    cfg.check()?;
    let layout = LayoutSpec::parse(&cfg.layout)?;
    check_layout_runnable(&layout.layout, true)?;
    let save_dtype = StorageDtype::parse(&cfg.save_dtype)?;
    let be = CpuBackend {
        threads: if cfg.threads == 0 {
            CpuBackend::default().threads
        } else {
            cfg.threads
        },
    };

    let (model_cfg, mut params, source) = resolve_model(&cfg.model, cfg.seed)?;
    if cfg.seq_len > model_cfg.max_position_embeddings {
        return Err(EngineError::Invalid(format!(
            "seq_len {} exceeds the model's max_position_embeddings {} ({})",
            cfg.seq_len,
            model_cfg.max_position_embeddings,
            match &source {
                ModelSource::HfDir(d) => d.join("config.json").display().to_string(),
                ModelSource::Preset(p) => format!("preset {p}"),
            }
        )));
    }

    let docs = data::read_corpus(&cfg.data)?;
    let (tokenizer, tokenizer_path) = match (&cfg.tokenizer, &source) {
        (Some(path), _) => (data::load_tokenizer(path)?, path.clone()),
        (None, ModelSource::HfDir(dir)) if dir.join("tokenizer.json").exists() => {
            let p = dir.join("tokenizer.json");
            (data::load_tokenizer(&p)?, p)
        }
        _ => {
            let cache = cfg.cache_dir.clone().unwrap_or_else(default_cache_dir);
            data::train_or_load_tokenizer(&docs, model_cfg.vocab_size, &cache)?
        }
    };
    data::check_tokenizer_fits(&tokenizer, &tokenizer_path, model_cfg.vocab_size)?;
    let split = TokenSplit::new(
        data::encode_documents(&tokenizer, &docs)?,
        cfg.val_fraction,
        cfg.seq_len,
    )?;
    let val_batches =
        data::validation_batches(&split.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches);
    let mut sampler = SequenceSampler::new(split.train.len(), cfg.seq_len, cfg.seed);

    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| EngineError::io(&cfg.out_dir, e))?;
    let config_path = cfg.out_dir.join("train_config.json");
    hf::write_atomic(
        &config_path,
        serde_json::to_string_pretty(cfg)
            .expect("serialisable")
            .as_bytes(),
    )?;
    let metrics_path = cfg.out_dir.join("metrics.jsonl");
    let mut metrics =
        std::fs::File::create(&metrics_path).map_err(|e| EngineError::io(&metrics_path, e))?;

    let tf = Transformer::new(&model_cfg, &params).with_recompute(layout.layout.recompute);
    // Pipeline and tensor-parallel layouts: the stages' layer ranges, and how many parameters each
    // device (rank order: tp fastest, then stage) holds.
    let (pp, tp, vpp) = (layout.layout.pp, layout.layout.tp, layout.layout.vpp);
    let partition = (pp > 1 || tp > 1)
        .then(|| StagePartition::for_model(&model_cfg, pp * vpp))
        .transpose()?;
    let device_params: Vec<usize> = match &partition {
        Some(part) => (0..pp * tp)
            .map(|d| -> Result<usize> {
                let (s, t) = (d / tp, d % tp);
                let local = TpShard::new(&model_cfg, tp, t, false)?.local_config(&model_cfg);
                let ranges: Vec<_> = (0..vpp).map(|k| part.layers[k * pp + s].clone()).collect();
                Ok(local
                    .param_specs()
                    .iter()
                    .filter(|p| ranges.iter().any(|r| model_cfg.stage_owns(&p.name, r)))
                    .map(|p| p.numel())
                    .sum())
            })
            .collect::<Result<_>>()?,
        None => vec![params.numel()],
    };
    let mut grads = params.zeros_like();
    let mut opt = AdamW::new(
        AdamWConfig {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.adam_eps,
            weight_decay: cfg.weight_decay,
        },
        &params,
    );
    let schedule = LrSchedule {
        peak_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
    };
    let n_params = params.numel() as u64;
    let initial_val_loss = mean_loss(&tf, &be, &params, &val_batches);
    let (mut last_loss, mut last_val, mut total_tokens, mut total_time) =
        (f64::NAN, initial_val_loss, 0usize, 0.0);

    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let batch = sampler.next_batch(&split.train, cfg.batch_size);
        grads.zero_();
        // Per device: (memory, idle fraction, bytes sent, device-time step).
        let (loss, devices) = match &partition {
            Some(part) => {
                let mut run = pipeline_step(
                    &model_cfg,
                    &params,
                    &batch,
                    &layout.layout,
                    part,
                    Duration::from_secs(600),
                )?;
                grads = std::mem::replace(&mut run.grads, ParamStore::zeros(Vec::new()));
                let devices: Vec<DeviceReport> = (0..pp * tp)
                    .map(|s| {
                        let held = device_params[s] as u64;
                        let memory = MemoryTerms {
                            weights: 4 * held,
                            gradients: 4 * held,
                            master_weights: 0,
                            optimizer_states: 8 * held,
                            activations: run.peak_stash_bytes[s] as u64,
                            comm_buffers: 0,
                            total: 0,
                        }
                        .with_total();
                        (
                            memory,
                            run.idle_fraction(s),
                            run.stats[s].total().bytes_sent,
                            run.step_time_s(),
                        )
                    })
                    .collect();
                (run.loss, devices)
            }
            None => {
                let out = run_step(
                    &tf,
                    &be,
                    &params,
                    &mut grads,
                    &batch,
                    layout.layout.micro_batch_size.min(cfg.batch_size),
                )?;
                // Single device: every term is exactly what this process holds. f32 training keeps
                // no separate master copy: the f32 weights are the master weights.
                let memory = MemoryTerms {
                    weights: 4 * n_params,
                    gradients: 4 * n_params,
                    master_weights: 0,
                    optimizer_states: 8 * n_params,
                    activations: out.peak_activation_bytes as u64,
                    comm_buffers: 0,
                    total: 0,
                }
                .with_total();
                (out.loss, vec![(memory, 0.0, 0, 0.0)])
            }
        };
        let grad_norm = clip_grad_norm(&mut grads, cfg.grad_clip);
        let lr = schedule.lr(step);
        opt.step(&mut params, &grads, lr as f32);
        let dt = t0.elapsed().as_secs_f64();
        let tokens = batch.batch * batch.seq;
        total_tokens += tokens;
        total_time += dt;
        last_loss = loss;
        let is_eval =
            cfg.eval_every > 0 && ((step + 1) % cfg.eval_every == 0) || step + 1 == cfg.steps;
        let val_loss = is_eval.then(|| mean_loss(&tf, &be, &params, &val_batches));
        if let Some(v) = val_loss {
            last_val = v;
        }
        let memory = devices
            .iter()
            .map(|d| d.0)
            .max_by_key(|m| m.total)
            .expect("a device");
        let report = StepReport {
            step: step + 1,
            total_steps: cfg.steps,
            loss,
            lr,
            grad_norm,
            tokens_per_s: tokens as f64 / dt,
            step_time_s: dt,
            val_loss,
            memory,
        };
        let line = serde_json::json!({
            "step": report.step,
            "loss": report.loss,
            "lr": report.lr,
            "grad_norm": report.grad_norm,
            "tokens_per_s": report.tokens_per_s,
            "step_time_s": report.step_time_s,
            "val_loss": report.val_loss,
            "devices": devices
                .iter()
                .enumerate()
                .map(|(i, (m, idle, sent, device_step))| serde_json::json!({
                    "device": i,
                    "peak_memory_bytes": m,
                    "idle_fraction": idle,
                    "bytes_sent": sent,
                    "step_time_s": if *device_step > 0.0 { *device_step } else { dt },
                    "wall_step_time_s": dt,
                }))
                .collect::<Vec<_>>(),
        });
        writeln!(metrics, "{line}").map_err(|e| EngineError::io(&metrics_path, e))?;
        on_step(&report);
    }

    let model_dir = cfg.out_dir.join("model");
    hf::save_model(&model_dir, &model_cfg, &params, save_dtype)?;
    copy_file(&tokenizer_path, &model_dir.join("tokenizer.json"))?;
    Ok(TrainSummary {
        initial_val_loss,
        final_val_loss: last_val,
        final_train_loss: last_loss,
        tokens_per_s: total_tokens as f64 / total_time.max(1e-9),
        num_params: n_params as usize,
        model_dir,
        train_tokens: split.train.len(),
        val_tokens: split.val.len(),
        tokenizer: tokenizer_path,
    })
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let bytes = std::fs::read(from).map_err(|e| EngineError::io(from, e))?;
    hf::write_atomic(to, &bytes)
}

use super::checkpointing::{restore_single, save_single, single_device_arrays, CheckpointPlan};
use super::mesh_train::{train_mesh, MeshTraining};
use super::source::{resolve_model, ModelSource};
use super::step::run_step;
use crate::checkpoint::Checkpoint;
use crate::data::{self, SequenceSampler, TokenSplit};
use crate::error::{EngineError, Result};
use crate::hf::{self, StorageDtype};
use crate::kernels::CpuBackend;
use crate::memory::MemoryTerms;
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::transformer::{ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{
    check_layout, search, ActivationModel, OptimizerKind, PlanInput, PlanModel, Precision,
};
use ferrotron_core::topology::Cluster;
use std::io::Write;
use std::path::{Path, PathBuf};
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
    /// The cluster the devices stand for (a `ferrotron plan --cluster` spec): node placement, the
    /// planner's predictions, and the device count and memory `layout = "auto"` plans for.
    pub cluster: String,
    /// Memory of each device, e.g. `64MiB`, `1.5GB` (default: the cluster's). Going over it is an
    /// out-of-memory error with the per-term breakdown.
    pub device_memory: Option<String>,
    /// Allow a tensor-parallel group to span nodes.
    pub force_cross_node_tp: bool,
    /// Where the devices run: `threads` (one process) or `mpi` (one rank per device under mpirun;
    /// needs a build with the `mpi` feature).
    pub backend: String,
    /// Warn of a straggler when a device computes this fraction above the devices' median ...
    pub straggler_threshold: f64,
    /// ... for this many steps in a row.
    pub straggler_steps: usize,
    /// Testing and drills: make this device compute `slow_device_ms` longer per action.
    pub slow_device: Option<usize>,
    pub slow_device_ms: f64,
    /// `f32`, or mixed precision `bf16` / `fp16`: weights, gradients and activations stored (and
    /// moved) in 16 bits, master weights and Adam moments in f32.
    pub precision: String,
    /// fp16: the initial loss scale, and how many clean steps double it (an inf/NaN halves it and
    /// skips the step).
    pub loss_scale: f64,
    pub loss_scale_window: usize,
    /// Testing: put an inf into the gradients at this step (fp16 must skip it).
    pub inject_nonfinite_step: Option<usize>,
    /// Save a sharded checkpoint every this many steps (0: only after the last step, which always
    /// saves one).
    pub checkpoint_every: usize,
    /// Where checkpoints go (default: `<out_dir>/checkpoints`).
    pub checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest this many checkpoints (0: keep all).
    pub keep_checkpoints: usize,
    /// Continue from this checkpoint (a `step-NNNNNN` directory, or a checkpoint directory whose
    /// `latest` names one), on this run's layout: the parameters and Adam moments are resharded
    /// to it, the data loader, LR schedule and loss scaler continue where they were.
    pub resume: Option<PathBuf>,
}

impl TrainConfig {
    /// The 16-bit format of a mixed-precision run.
    pub fn storage(&self) -> Result<Option<crate::transformer::Half>> {
        match self.precision.as_str() {
            "f32" | "fp32" => Ok(None),
            "bf16" => Ok(Some(crate::transformer::Half::Bf16)),
            "fp16" | "f16" => Ok(Some(crate::transformer::Half::F16)),
            other => Err(EngineError::Invalid(format!(
                "train config `precision`: `{other}` (expected f32, bf16 or fp16)"
            ))),
        }
    }
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
            cluster: "this-machine".into(),
            device_memory: None,
            force_cross_node_tp: false,
            backend: "threads".into(),
            straggler_threshold: 0.2,
            straggler_steps: 3,
            slow_device: None,
            slow_device_ms: 10.0,
            precision: "f32".into(),
            loss_scale: 65536.0,
            loss_scale_window: 1000,
            inject_nonfinite_step: None,
            checkpoint_every: 0,
            checkpoint_dir: None,
            keep_checkpoints: 0,
            resume: None,
        }
    }
}

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
    /// Warnings raised at this step (a straggler forming).
    pub warnings: Vec<String>,
}

impl StepReport {
    /// The step's line in `metrics.jsonl`: its figures, then `extra` (the layout, warnings) and the
    /// per-device objects.
    pub fn metrics_line(
        &self,
        extra: serde_json::Map<String, serde_json::Value>,
        devices: Vec<serde_json::Value>,
    ) -> String {
        let mut line = serde_json::json!({
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "val_loss": self.val_loss,
            "warnings": self.warnings,
        });
        let obj = line.as_object_mut().expect("an object");
        obj.extend(extra);
        obj.insert("devices".into(), serde_json::Value::Array(devices));
        line.to_string()
    }
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
    /// The layout that ran (the planner's choice under `layout = "auto"`).
    pub layout: Layout,
    /// Per device (more than one): measured peaks beside the planner's prediction, idle fraction,
    /// bytes sent and step times.
    pub devices: Vec<DeviceSummary>,
    /// Whether this process reports the run (false on MPI ranks other than 0, which hold no
    /// summary figures).
    pub reporter: bool,
}

/// One device over the whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceSummary {
    pub device: usize,
    pub stage: usize,
    pub dp_rank: usize,
    pub tp_rank: usize,
    /// The highest peak of each term over all steps, measured by the tracking allocator.
    pub peak_memory_bytes: MemoryTerms,
    pub predicted_memory_bytes: MemoryTerms,
    pub idle_fraction: f64,
    pub bytes_sent_per_step: u64,
    /// Mean step time in device time and in wall time.
    pub step_time_s: f64,
    pub wall_step_time_s: f64,
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
        if !(self.loss_scale.is_finite() && self.loss_scale >= 1.0) {
            return bad("loss_scale", "must be a finite number of at least 1");
        }
        if !(self.straggler_threshold.is_finite() && self.straggler_threshold >= 0.0) {
            return bad("straggler_threshold", "must be a non-negative fraction");
        }
        if !(self.slow_device_ms.is_finite() && self.slow_device_ms >= 0.0) {
            return bad(
                "slow_device_ms",
                "must be a non-negative number of milliseconds",
            );
        }
        self.storage()?;
        if !matches!(self.backend.as_str(), "threads" | "mpi") {
            return bad("backend", "expected `threads` or `mpi`");
        }
        if self.backend == "mpi" && !cfg!(feature = "mpi") {
            return bad(
                "backend",
                "this build has no MPI; build with `--features mpi` (needs OpenMPI) and run under mpirun",
            );
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return bad("val_fraction", "must be in [0, 1)");
        }
        Ok(())
    }
}

/// `64MiB`, `1.5GB`, `200000000` → bytes.
pub fn parse_bytes(spec: &str) -> Result<u64> {
    let t = spec.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.trim().parse().map_err(|_| {
        EngineError::Invalid(format!(
            "device_memory `{spec}`: expected a size such as 64MiB or 2GB"
        ))
    })?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(EngineError::Invalid(format!(
                "device_memory `{spec}`: unknown unit `{other}` (B, kB, MB, GB, KiB, MiB, GiB)"
            )))
        }
    };
    if !(x.is_finite() && x > 0.0) {
        return Err(EngineError::Invalid(format!(
            "device_memory `{spec}` must be positive"
        )));
    }
    Ok((x * scale) as u64)
}

/// The planner's view of this run: the model's shape, the cluster (with the configured device
/// memory), the batch, and the engine's precision (everything f32) and activation model.
pub fn plan_input(cfg: &TrainConfig, model: &ModelConfig) -> Result<PlanInput> {
    let mut cluster = Cluster::parse(&cfg.cluster)?;
    if let Some(m) = &cfg.device_memory {
        cluster.device_memory_bytes = parse_bytes(m)?;
    }
    Ok(PlanInput {
        model: PlanModel::Shape(model.clone()),
        cluster,
        seq: cfg.seq_len,
        global_batch: cfg.batch_size,
        precision: Precision::parse(if cfg.storage()?.is_some() {
            "weights=bf16,grads=bf16,master=fp32,optimizer=fp32"
        } else {
            "weights=fp32,grads=fp32,master=fp32,optimizer=fp32"
        })?,
        optimizer: OptimizerKind::Adam,
        activation_model: ActivationModel::Ferrotron,
        lora_rank: None,
        // `layout = "auto"` keeps a tenth of each device free: the activation model and the
        // communication buffers are estimates (within ~10% of what the tracking allocator measures).
        memory_reserve: 0.1,
        force_cross_node_tp: cfg.force_cross_node_tp,
    })
}

/// The layouts to try, in order: the given one (checked against the model, batch and cluster), or
/// under `auto` the planner's layouts that fit, fastest first.
pub fn resolve_layout(spec: &LayoutSpec, input: &PlanInput) -> Result<Vec<Layout>> {
    if spec.auto_keys.is_empty() {
        if !(spec.layout.is_single_device() && spec.layout.zero == 0) {
            // The model's own divisibility first (heads, KV heads), then the cluster's rules.
            if let PlanModel::Shape(model) = &input.model {
                crate::parallel::TpShard::check(model, spec.layout.tp)?;
            }
            check_layout(input, &spec.layout)?;
        }
        return Ok(vec![spec.layout]);
    }
    let candidates: Vec<Layout> = search(input)?.into_iter().map(|p| p.layout).collect();
    if candidates.is_empty() {
        return Err(EngineError::Invalid(format!(
            "layout auto: no layout of the cluster's {} devices fits {} per device",
            input.cluster.world_size(),
            crate::memory::format_bytes(input.cluster.device_memory_bytes)
        )));
    }
    Ok(candidates)
}

/// How many of the planner's layouts `auto` tries when one turns out, measured, not to fit.
const AUTO_ATTEMPTS: usize = 4;

pub(super) fn mean_loss(
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
    let layout_spec = LayoutSpec::parse(&cfg.layout)?;
    let save_dtype = StorageDtype::parse(&cfg.save_dtype)?;
    let be = CpuBackend {
        threads: if cfg.threads == 0 {
            CpuBackend::default().threads
        } else {
            cfg.threads
        },
    };

    let (model_cfg, mut params, source) = resolve_model(&cfg.model, cfg.seed)?;
    let resume = cfg.resume.as_deref().map(Checkpoint::open).transpose()?;
    let start = match &resume {
        Some(ck) => {
            ck.check_model(&model_cfg)?;
            if ck.manifest.step >= cfg.steps {
                return Err(EngineError::Invalid(format!(
                    "resume: {} is at step {}, and this run has `steps` = {}: nothing is left to \
                     train (raise `steps`)",
                    ck.dir.display(),
                    ck.manifest.step,
                    cfg.steps
                )));
            }
            params = ck.params()?;
            ck.manifest.step
        }
        None => 0,
    };
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
    let input = plan_input(cfg, &model_cfg)?;
    let candidates = resolve_layout(&layout_spec, &input)?;
    let layout = candidates[0];
    if let Some(d) = cfg.slow_device {
        let world = candidates.iter().map(Layout::world_size).min().unwrap_or(1);
        if d >= world {
            return Err(EngineError::Invalid(format!(
                "train config `slow_device`: device {d}, but layout `{layout}` has {world} devices"
            )));
        }
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
    let mut sampler = match resume
        .as_ref()
        .and_then(|ck| ck.manifest.data_loader.as_ref())
    {
        Some(position) => SequenceSampler::resumed(position, split.train.len(), cfg.seq_len)?,
        None => SequenceSampler::new(split.train.len(), cfg.seq_len, cfg.seed),
    };

    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| EngineError::io(&cfg.out_dir, e))?;
    let config_path = cfg.out_dir.join("train_config.json");
    hf::write_atomic(
        &config_path,
        serde_json::to_string_pretty(cfg)
            .expect("serialisable")
            .as_bytes(),
    )?;
    let metrics_path = cfg.out_dir.join("metrics.jsonl");

    let tf = Transformer::new(&model_cfg, &params).with_recompute(layout.recompute);
    let adam = AdamWConfig {
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.adam_eps,
        weight_decay: cfg.weight_decay,
    };
    let schedule = LrSchedule {
        peak_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
    };
    let n_params = params.numel() as u64;
    let open_metrics = || -> Result<std::fs::File> {
        // A resumed run continues the metrics of the run it resumes.
        std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resume.is_some())
            .truncate(resume.is_none())
            .open(&metrics_path)
            .map_err(|e| EngineError::io(&metrics_path, e))
    };
    let plan_for = |layout: &Layout| CheckpointPlan::new(cfg, &model_cfg, layout, adam, schedule);
    let initial_val_loss = mean_loss(&tf, &be, &params, &val_batches);
    let summary_of =
        |last_loss: f64, last_val: f64, tokens_per_s: f64, layout, devices| TrainSummary {
            initial_val_loss,
            final_val_loss: last_val,
            final_train_loss: last_loss,
            tokens_per_s,
            num_params: n_params as usize,
            model_dir: cfg.out_dir.join("model"),
            train_tokens: split.train.len(),
            val_tokens: split.val.len(),
            tokenizer: tokenizer_path.clone(),
            layout,
            devices,
            reporter: true,
        };

    if !layout.is_single_device() || layout.zero > 0 || cfg.storage()?.is_some() {
        let mut loader_after = Vec::new();
        let batches: Vec<TokenBatch> = (start..cfg.steps)
            .map(|_| {
                let b = sampler.next_batch(&split.train, cfg.batch_size);
                loader_after.push(serde_json::to_value(&sampler).expect("serialisable"));
                b
            })
            .collect();
        let auto = !layout_spec.auto_keys.is_empty();
        let mut tried = Vec::new();
        for &layout in candidates.iter().take(if auto { AUTO_ATTEMPTS } else { 1 }) {
            let checkpoints = plan_for(&layout);
            let run = MeshTraining {
                cfg,
                model_cfg: &model_cfg,
                params: &params,
                layout,
                input: &input,
                batches: &batches,
                val_batches: &val_batches,
                adam,
                schedule,
                initial_val_loss,
                start,
                loader_after: &loader_after,
                checkpoints: &checkpoints,
                resume: resume.as_ref(),
            };
            #[cfg(feature = "mpi")]
            if cfg.backend == "mpi" {
                let out = train_on_mpi(
                    &run,
                    &metrics_path,
                    &open_metrics,
                    on_step,
                    save_dtype,
                    &tokenizer_path,
                )?;
                return Ok(match out {
                    Some(out) => summary_of(
                        out.last_loss,
                        out.last_val,
                        out.tokens_per_s,
                        layout,
                        out.devices,
                    ),
                    None => TrainSummary {
                        reporter: false,
                        ..summary_of(f64::NAN, f64::NAN, 0.0, layout, Vec::new())
                    },
                });
            }
            let mut metrics = open_metrics()?;
            let out = match train_mesh(&run, &mut metrics, &metrics_path, on_step) {
                // The planner's estimate was short for this layout: measured, it does not fit.
                Err(EngineError::RunOutOfMemory(why)) if auto => {
                    tried.push(format!("{layout}: {why}"));
                    continue;
                }
                other => other?,
            };
            hf::save_model(
                &cfg.out_dir.join("model"),
                &model_cfg,
                &out.params,
                save_dtype,
            )?;
            copy_file(
                &tokenizer_path,
                &cfg.out_dir.join("model").join("tokenizer.json"),
            )?;
            return Ok(summary_of(
                out.last_loss,
                out.last_val,
                out.tokens_per_s,
                layout,
                out.devices,
            ));
        }
        return Err(EngineError::RunOutOfMemory(format!(
            "layout auto: the planner's {} best layouts went out of memory when run:\n{}",
            tried.len(),
            tried.join("\n")
        )));
    }

    let mut metrics = open_metrics()?;
    let mut grads = params.zeros_like();
    let mut opt = AdamW::new(adam, &params);
    if let Some(ck) = &resume {
        restore_single(ck, &params, &mut opt)?;
    }
    let checkpoints = plan_for(&layout);
    let (mut last_loss, mut last_val, mut total_tokens, mut total_time) =
        (f64::NAN, initial_val_loss, 0usize, 0.0);
    for step in start..cfg.steps {
        let t0 = Instant::now();
        let batch = sampler.next_batch(&split.train, cfg.batch_size);
        grads.zero_();
        let out = run_step(
            &tf,
            &be,
            &params,
            &mut grads,
            &batch,
            layout.micro_batch_size.min(cfg.batch_size),
        )?;
        // Single device: every term is exactly what this process holds. f32 training keeps no
        // separate master copy: the f32 weights are the master weights.
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
        let loss = out.loss;
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
            warnings: Vec::new(),
        };
        let line = report.metrics_line(
            serde_json::Map::new(),
            vec![serde_json::json!({
                "device": 0,
                "peak_memory_bytes": memory,
                "idle_fraction": 0.0,
                "bytes_sent": 0,
                "step_time_s": dt,
                "wall_step_time_s": dt,
            })],
        );
        writeln!(metrics, "{line}").map_err(|e| EngineError::io(&metrics_path, e))?;
        on_step(&report);
        if checkpoints.due(step + 1) {
            let position = serde_json::to_value(&sampler).expect("serialisable");
            let manifest = checkpoints.manifest(step + 1, opt.step, None, position);
            save_single(
                &checkpoints,
                manifest,
                &single_device_arrays(&model_cfg, &params, &opt)?,
            )?;
        }
    }

    let model_dir = cfg.out_dir.join("model");
    hf::save_model(&model_dir, &model_cfg, &params, save_dtype)?;
    copy_file(&tokenizer_path, &model_dir.join("tokenizer.json"))?;
    Ok(summary_of(
        last_loss,
        last_val,
        total_tokens as f64 / total_time.max(1e-9),
        layout,
        Vec::new(),
    ))
}

/// The MPI side of a mesh run: rank 0 writes the metrics and saves the model.
#[cfg(feature = "mpi")]
fn train_on_mpi(
    run: &MeshTraining,
    metrics_path: &Path,
    open_metrics: &dyn Fn() -> Result<std::fs::File>,
    on_step: &mut dyn FnMut(&StepReport),
    save_dtype: StorageDtype,
    tokenizer_path: &Path,
) -> Result<Option<super::mesh_train::MeshOutcome>> {
    let mut c = crate::comm::MpiComm::init(None)?;
    let rank = crate::comm::Comm::rank(&c);
    // Only rank 0 writes; the others' (unused) metrics go nowhere.
    let mut metrics = if rank == 0 {
        open_metrics()?
    } else {
        std::fs::File::create("/dev/null").map_err(|e| EngineError::io("/dev/null", e))?
    };
    let out = super::mesh_train::train_mesh_mpi(run, &mut c, &mut metrics, metrics_path, on_step)?;
    if let Some(out) = &out {
        let dir = run.cfg.out_dir.join("model");
        hf::save_model(&dir, run.model_cfg, &out.params, save_dtype)?;
        copy_file(tokenizer_path, &dir.join("tokenizer.json"))?;
    }
    Ok(out)
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let bytes = std::fs::read(from).map_err(|e| EngineError::io(from, e))?;
    hf::write_atomic(to, &bytes)
}

//! `train`: resolve the model and the layout, prepare the data, run every device on the world (the
//! unsplit model is the 1×1×1 mesh, run the same way), save the model.

use super::checkpointing::CheckpointPlan;
use super::config::TrainConfig;
use super::effective_batch;
use super::hang;
use super::lora_run::{self, BaseWeights};
use super::metrics::RunOutcome;
use super::metrics::{DeviceSummary, StepReport};
use super::resolve::{plan_input, resolve_layout};
use super::run_dir;
use super::training_run::TrainingRun;
use super::world::World;
use crate::checkpoint::Checkpoint;
use crate::data::{self, SequenceSampler, TokenSplit};
use crate::error::{EngineError, Result};
use crate::hf::{self, StorageDtype};
use crate::lora::Adapters;
use crate::model_source::{resolve_config, ModelSource};
use crate::parallel::WeightSource;
use crate::transformer::{ParamStore, TokenBatch};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig};
use ferrotron_core::plan::Plan;
use ferrotron_core::precision::BaseQuantization;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// None when nothing is held out (`val_fraction = 0` or `eval_batches = 0`).
    pub initial_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub final_train_loss: f64,
    pub tokens_per_s: f64,
    pub num_params: usize,
    /// The parameters that trained: all of them, or with LoRA the adapters'.
    pub trained_params: usize,
    pub model_dir: PathBuf,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub tokenizer: PathBuf,
    /// The layout that ran (the planner's choice under `layout = "auto"`).
    pub layout: Layout,
    /// Per device: measured peaks beside the planner's prediction, idle fraction, bytes sent and
    /// step times (empty on MPI ranks other than 0).
    pub devices: Vec<DeviceSummary>,
    /// Whether this process reports the run (false on MPI ranks other than 0, which hold no
    /// summary figures).
    pub reporter: bool,
}

/// How many of the planner's layouts `auto` tries when one turns out, measured, not to fit.
const AUTO_ATTEMPTS: usize = 4;

/// The model to train: its shape and starting parameters (from a checkpoint when resuming).
struct StartingPoint {
    model: ModelConfig,
    /// The model's parameters: what trains, or with LoRA the frozen base.
    params: StartWeights,
    source: ModelSource,
    resume: Option<Checkpoint>,
    /// LoRA: the adapters that train, where they start.
    adapters: Option<Adapters>,
    /// QLoRA: how the frozen base (`params`) is quantized.
    quantized: Option<BaseQuantization>,
    /// The first step to run.
    start: usize,
}

impl StartingPoint {
    fn resolve(cfg: &TrainConfig) -> Result<Self> {
        let (mut model, source) = resolve_config(&cfg.input.model)?;
        if let Some(f) = cfg.input.capacity_factor {
            let Some(moe) = model.moe.as_deref_mut() else {
                return Err(EngineError::Invalid(format!(
                    "capacity_factor {f}: {} has no experts to drop tokens from (leave it out)",
                    cfg.input.model
                )));
            };
            moe.capacity_factor = Some(f);
        }
        let resume = cfg
            .checkpointing
            .resume
            .as_deref()
            .map(Checkpoint::open)
            .transpose()?;
        let mut start = 0;
        if let Some(ck) = &resume {
            ck.check_model(&model)?;
            if ck.manifest.step >= cfg.optimizer.steps {
                return Err(EngineError::Invalid(format!(
                    "resume: {} is at step {}, and this run has `steps` = {}: nothing is left to \
                     train (raise `steps`)",
                    ck.dir.display(),
                    ck.manifest.step,
                    cfg.optimizer.steps
                )));
            }
            if ck.manifest.lora.is_some() {
                check_base(ck, &cfg.input.model)?;
            }
            start = ck.manifest.step;
        }
        let adapters = lora_run::resolve(cfg, &model, resume.as_ref())?;
        let quantized =
            lora_run::base_quantization(cfg, &model, resume.as_ref(), adapters.is_some())?;
        // A full-training checkpoint holds the weights; otherwise they are the model's (QLoRA:
        // quantized as they are read).
        let params = match (&resume, &source) {
            // Resuming full training: each device reads its shard from the checkpoint.
            (Some(ck), _) if ck.manifest.lora.is_none() => StartWeights::Resumed,
            // Full training from a model directory: each device reads its own shard of it.
            (None, ModelSource::HfDir(dir)) if adapters.is_none() => {
                StartWeights::Stored(hf::ModelWeights::open(dir, &model)?)
            }
            // LoRA on a stored, unquantized base: each device reads its own shard of the base.
            (_, ModelSource::HfDir(dir)) if adapters.is_some() && quantized.is_none() => {
                StartWeights::Base(BaseWeights::stored(
                    hf::ModelWeights::open(dir, &model)?,
                    &model,
                ))
            }
            _ if adapters.is_some() => StartWeights::Base(BaseWeights::Loaded(source.load(
                &model,
                cfg.input.seed,
                quantized,
            )?)),
            _ => StartWeights::Loaded(source.load(&model, cfg.input.seed, quantized)?),
        };
        if cfg.input.seq_len > model.max_sequence_length() {
            return Err(EngineError::Invalid(format!(
                "seq_len {} exceeds the model's max_position_embeddings {} ({})",
                cfg.input.seq_len,
                model.max_position_embeddings,
                match &source {
                    ModelSource::HfDir(d) => d.join("config.json").to_string(),
                    ModelSource::Preset(p) => format!("preset {p}"),
                }
            )));
        }
        Ok(Self {
            model,
            params,
            source,
            resume,
            adapters,
            quantized,
            start,
        })
    }

    /// What trains, where the devices read it from: every parameter, or the adapters.
    fn trained(&self) -> &dyn WeightSource {
        match (&self.adapters, &self.params) {
            (Some(a), _) => &a.params,
            (None, StartWeights::Loaded(p)) => p,
            (None, StartWeights::Stored(w)) => w,
            (None, StartWeights::Resumed) => self
                .resume
                .as_ref()
                .expect("a resumed run has its checkpoint"),
            (None, StartWeights::Base(_)) => unreachable!("a frozen base comes with adapters"),
        }
    }

    /// LoRA: the frozen base and the adapters' configuration.
    fn lora(&self) -> Option<(&BaseWeights, &LoraConfig)> {
        match (&self.adapters, &self.params) {
            (Some(a), StartWeights::Base(base)) => Some((base, &a.config)),
            _ => None,
        }
    }
}

/// A run's starting parameters: in memory (a preset), where the model is stored, the checkpoint
/// the run resumes from — in the last two each device reads its own shard — or LoRA's frozen base.
enum StartWeights {
    Loaded(ParamStore),
    Stored(hf::ModelWeights),
    Resumed,
    Base(BaseWeights),
}

/// How a run names its base model in a LoRA checkpoint: a model directory by its absolute path, a
/// preset by name.
fn base_model_name(spec: &str) -> String {
    let path = Path::new(spec);
    match path.canonicalize() {
        Ok(p) if path.is_dir() => p.display().to_string(),
        _ => spec.to_string(),
    }
}

/// A LoRA checkpoint's adapters continue only on the base they were trained on.
fn check_base(ck: &Checkpoint, model: &str) -> Result<()> {
    match &ck.manifest.base_model {
        Some(base) if *base != base_model_name(model) => Err(EngineError::Invalid(format!(
            "resume: the adapters in {} were trained on the base model {base}; this run's \
             --model is {model} (give that base)",
            ck.dir.display()
        ))),
        _ => Ok(()),
    }
}

/// The token streams and every step's batch, fixed before any device starts.
struct TrainingData {
    tokenizer_path: PathBuf,
    train_tokens: usize,
    val_tokens: usize,
    val_batches: Vec<TokenBatch>,
    /// The batch of every step from the start on, and the data loader's position after each.
    batches: Vec<TokenBatch>,
    loader_after: Vec<serde_json::Value>,
}

impl TrainingData {
    /// `reporter`: whether this process tells the user what it does (the first run trains a tokenizer).
    fn prepare(cfg: &TrainConfig, sp: &StartingPoint, reporter: bool) -> Result<Self> {
        let docs = data::read_corpus(&cfg.input.data)?;
        let (tokenizer, tokenizer_path) = match (&cfg.input.tokenizer, &sp.source) {
            (Some(path), _) => (data::load_tokenizer(path)?, path.clone()),
            (None, ModelSource::HfDir(dir)) if dir.join("tokenizer.json").is_file()? => {
                let p = local_copy(&dir.join("tokenizer.json"), cfg)?;
                (data::load_tokenizer(&p)?, p)
            }
            _ => {
                let cache = cfg
                    .input
                    .cache_dir
                    .clone()
                    .unwrap_or_else(default_cache_dir);
                let vocab = sp.model.vocab_size;
                let cached = data::tokenizer_cache_path(&docs, vocab, &cache);
                if reporter && !cached.exists() {
                    eprintln!(
                        "training a {vocab}-token byte-level BPE tokenizer on the data (once: it is cached as {})",
                        cached.display()
                    );
                }
                data::train_or_load_tokenizer(&docs, vocab, &cache)?
            }
        };
        data::check_tokenizer_fits(&tokenizer, &tokenizer_path, sp.model.vocab_size)?;
        let framing = data::DocumentFraming::for_tokenizer(&tokenizer, &tokenizer_path)?;
        let split = TokenSplit::new(
            data::encode_documents(&tokenizer, &framing, &docs)?,
            cfg.input.val_fraction,
            cfg.input.seq_len,
        )?;
        let val_batches = data::validation_batches(
            &split.val,
            cfg.input.seq_len,
            cfg.optimizer.batch_size,
            cfg.logging.eval_batches,
        );
        let mut sampler = match sp
            .resume
            .as_ref()
            .and_then(|ck| ck.manifest.data_loader.as_ref())
        {
            Some(position) => {
                SequenceSampler::resumed(position, split.train.len(), cfg.input.seq_len)?
            }
            None => SequenceSampler::new(split.train.len(), cfg.input.seq_len, cfg.input.seed),
        };
        let mut loader_after = Vec::new();
        let batches = (sp.start..cfg.optimizer.steps)
            .map(|_| {
                let b = sampler.next_batch(&split.train, cfg.optimizer.batch_size);
                loader_after.push(serde_json::to_value(&sampler).expect("serialisable"));
                b
            })
            .collect();
        Ok(Self {
            tokenizer_path,
            train_tokens: split.train.len(),
            val_tokens: split.val.len(),
            val_batches,
            batches,
            loader_after,
        })
    }
}

fn default_cache_dir() -> PathBuf {
    ferrotron_core::topology::cache_dir()
}

/// A small file of the model (its tokenizer) as a local file: itself, or (on an object store) a
/// copy in the cache directory, named by its URL.
fn local_copy(file: &crate::storage::Location, cfg: &TrainConfig) -> Result<PathBuf> {
    if let Some(p) = file.local() {
        return Ok(p.to_path_buf());
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&file.to_string(), &mut h);
    let cache = cfg
        .input
        .cache_dir
        .clone()
        .unwrap_or_else(default_cache_dir);
    std::fs::create_dir_all(&cache).map_err(|e| EngineError::io(&cache, e))?;
    let copy = cache.join(format!(
        "remote-{:016x}-tokenizer.json",
        std::hash::Hasher::finish(&h)
    ));
    hf::write_atomic(&copy, &file.read(ferrotron_core::bounded::TOKENIZER)?)?;
    Ok(copy)
}

/// The drills' devices (the slow one, the hung one) must be devices of every layout that may run.
fn check_slow_device(cfg: &TrainConfig, candidates: &[Plan]) -> Result<()> {
    let devices = candidates
        .iter()
        .map(|p| p.layout.world_size())
        .min()
        .unwrap_or(1);
    let drills = [
        ("slow_device", cfg.logging.slow_device),
        ("inject_hang", cfg.inject_hang()?.map(|(rank, _)| rank)),
    ];
    for (key, device) in drills {
        if let Some(d) = device.filter(|&d| d >= devices) {
            return Err(EngineError::Invalid(format!(
                "train config `{key}`: device {d}, but layout `{}` has {devices} devices",
                candidates[0].layout
            )));
        }
    }
    Ok(())
}

/// Trains as `cfg` says, calling `on_step` after every optimizer step (on the reporting process).
/// Appends one JSON object per step to `<out_dir>/metrics.jsonl`, saves sharded checkpoints, and
/// saves the final model as a Hugging Face directory.
pub fn train(cfg: &TrainConfig, on_step: &mut dyn FnMut(&StepReport)) -> Result<TrainSummary> {
    cfg.check()?;
    super::preemption::install();
    let save_dtype = cfg.checkpointing.save_dtype;
    let mut world = World::open(cfg)?;
    let sp = StartingPoint::resolve(cfg)?;
    // The LR follows the effective batch only as the user says (before the run directory is
    // claimed: a refused run leaves nothing behind).
    let earlier = effective_batch::EarlierRun::of(sp.resume.as_ref(), &sp.source)?;
    let (guarded, note) = effective_batch::guard(cfg, earlier.as_ref())?;
    let cfg = &guarded;
    // Held until the run ends: a second run, or an --overwrite, in these directories is refused.
    let _locks = if world.reporter() {
        Some(run_dir::claim(cfg).map_err(|e| world.fail_alone(e))?)
    } else {
        None
    };
    if world.reporter() {
        eprintln!("{}", effective_batch::describe(cfg));
        if let Some(note) = note {
            eprintln!("{note}");
        }
    }
    let mut input = plan_input(cfg, &sp.model, world.fixed_devices())?;
    input.lora = sp.adapters.as_ref().map(|a| a.config.clone());
    input.quantize_base = sp.quantized;
    if let (true, Some(a)) = (world.reporter(), &sp.adapters) {
        eprintln!(
            "LoRA: rank {}, alpha {} on {}: {} trained parameters beside {} frozen{}",
            a.config.rank,
            a.config.alpha,
            a.config.targets.join(", "),
            a.params.numel(),
            sp.model.num_params(),
            match sp.quantized {
                Some(q) => format!(" (projections in {q})"),
                None => String::new(),
            }
        );
    }
    let candidates = resolve_layout(&cfg.parallelism.layout, &input)?;
    check_slow_device(cfg, &candidates)?;
    if world.reporter() && cfg.parallelism.layout.is_auto() {
        // What `auto` chose and why, before training starts (as `plan` explains it).
        eprintln!(
            "layout auto: {} (the fastest of {} that fit), because:",
            candidates[0].layout,
            candidates.len()
        );
        for note in ferrotron_core::plan::search_notes(&input, candidates.first()) {
            eprintln!("  {note}");
        }
    }
    let data = TrainingData::prepare(cfg, &sp, world.reporter())?;
    if world.reporter() {
        run_dir::record_settings(cfg)?;
    }
    let (adam, schedule) = (cfg.adamw(), cfg.lr_schedule());
    let metrics_path = cfg.checkpointing.out_dir.join("metrics.jsonl");
    let auto = cfg.parallelism.layout.is_auto();
    let mut tried = Vec::new();
    for plan in candidates.iter().take(if auto { AUTO_ATTEMPTS } else { 1 }) {
        let layout = plan.layout;
        let checkpoints = CheckpointPlan::new(
            cfg,
            &sp.model,
            &layout,
            adam,
            schedule,
            &data.tokenizer_path,
        )?
        .with_lora(
            sp.adapters.as_ref().map(|a| &a.config),
            base_model_name(&cfg.input.model),
            sp.quantized,
        );
        let run = TrainingRun {
            cfg,
            model_cfg: &sp.model,
            weights: sp.trained(),
            lora: sp.lora(),
            layout,
            input: &input,
            plan,
            batches: &data.batches,
            val_batches: &data.val_batches,
            adam,
            schedule,
            start: sp.start,
            loader_after: &data.loader_after,
            checkpoints: &checkpoints,
            resume: sp.resume.as_ref(),
            kernel_threads: world.kernel_threads(cfg, layout.world_size()),
        };
        let metrics = if world.reporter() {
            Some(open_metrics(
                &metrics_path,
                sp.resume.is_some().then_some(sp.start),
            )?)
        } else {
            None
        };
        let outcome = match world.run(&run, metrics, &metrics_path, on_step) {
            // The planner's estimate was short for this layout: measured, it does not fit.
            Err(e @ (EngineError::RunOutOfMemory(_) | EngineError::PeerOutOfMemory(_))) if auto => {
                if world.reporter() {
                    // Said as it happens: the choice printed above is not the layout that trains.
                    let next = candidates
                        .iter()
                        .take(AUTO_ATTEMPTS)
                        .skip(tried.len() + 1)
                        .map(|p| p.layout.to_string())
                        .next()
                        .unwrap_or_else(|| "none left to try".into());
                    eprintln!(
                        "layout auto: {layout} went out of memory when run, over the planner's \
                         estimate:\n{e}\nlayout auto: trying the next fastest that fits: {next}"
                    );
                }
                tried.push(format!("{layout}: {e}"));
                continue;
            }
            Err(e) => {
                // A hang: what the devices' flight records say (MPI ranks write theirs as they
                // give up; a few seconds is enough).
                let wait = std::time::Duration::from_secs(if world.reporter() { 5 } else { 0 });
                let out = &cfg.checkpointing.out_dir;
                return Err(hang::explain(out, layout.world_size(), wait, e));
            }
            Ok(o) => o,
        };
        return finish(cfg, &sp, &data, layout, save_dtype, outcome);
    }
    Err(EngineError::RunOutOfMemory(format!(
        "layout auto: the planner's {} best layouts went out of memory when run:\n{}",
        tried.len(),
        tried.join("\n")
    )))
}

/// What a finished run leaves — on the reporting process the model (with LoRA, the adapters as
/// PEFT writes them and the model with them merged) and its tokenizer — and its summary.
fn finish(
    cfg: &TrainConfig,
    sp: &StartingPoint,
    data: &TrainingData,
    layout: Layout,
    save_dtype: StorageDtype,
    out: Option<RunOutcome>,
) -> Result<TrainSummary> {
    let reporter = out.is_some();
    let out = out.unwrap_or(RunOutcome {
        params: ParamStore::zeros(Vec::new()),
        initial_val_loss: None,
        last_loss: f64::NAN,
        last_val: None,
        tokens_per_s: 0.0,
        devices: Vec::new(),
    });
    if reporter {
        let dir = cfg.checkpointing.out_dir.join("model");
        match &sp.adapters {
            // LoRA: the adapters as PEFT writes them, and the model with them merged.
            Some(a) => {
                let trained = Adapters {
                    config: a.config.clone(),
                    params: out.params.clone(),
                };
                let adapter_dir = cfg.checkpointing.out_dir.join("adapter");
                trained.save_peft(
                    &adapter_dir,
                    &sp.model,
                    Some(&base_model_name(&cfg.input.model)),
                )?;
                let Some((base, _)) = sp.lora() else {
                    unreachable!("a LoRA run has its base")
                };
                let merged = trained.merge(&sp.model, base.whole()?)?;
                hf::save_model(&dir, &sp.model, &merged, save_dtype)?;
            }
            None => hf::save_model(&dir, &sp.model, &out.params, save_dtype)?,
        }
        copy_file(&data.tokenizer_path, &dir.join("tokenizer.json"))?;
    }
    Ok(TrainSummary {
        initial_val_loss: out.initial_val_loss,
        final_val_loss: out.last_val,
        final_train_loss: out.last_loss,
        tokens_per_s: out.tokens_per_s,
        num_params: sp.model.num_params(),
        trained_params: sp.trained().specs().iter().map(|s| s.numel()).sum(),
        model_dir: cfg.checkpointing.out_dir.join("model"),
        train_tokens: data.train_tokens,
        val_tokens: data.val_tokens,
        tokenizer: data.tokenizer_path.clone(),
        layout,
        devices: out.devices,
        reporter,
    })
}

/// `metrics.jsonl` to append to: a new run starts it empty; a resumed run from step `start` keeps
/// the lines of steps up to `start` (see [`super::metrics::keep_steps_up_to`]).
fn open_metrics(path: &Path, resumed_at: Option<usize>) -> Result<std::fs::File> {
    if let Some(start) = resumed_at {
        super::metrics::keep_steps_up_to(path, start)?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(resumed_at.is_some())
        .truncate(resumed_at.is_none())
        .open(path)
        .map_err(|e| EngineError::io(path, e))
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let bytes = std::fs::read(from).map_err(|e| EngineError::io(from, e))?;
    hf::write_atomic(to, &bytes)
}

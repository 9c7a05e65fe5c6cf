//! The settings of a training run: one declaration is the `ferrotron train` flags, the keys of
//! `run.toml` and the defaults. Each field's name is its flag (`--batch-size`) and its key
//! (`batch_size`); the expression after it is the default; its doc comment is the help text. Flags
//! override the file, the file overrides the defaults. The engine builds without clap: the flags
//! exist under the `cli` feature, which the command-line program turns on.

use crate::comm::CommBackend;
use crate::data;
use crate::error::{EngineError, Result};
use crate::optim::{AdamWConfig, LrScaling, LrSchedule};
use crate::parallel::LossScaling;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::precision::{BaseQuantization, MixedPrecision, StorageDtype};
use std::path::PathBuf;

/// Declares the settings once, in groups: each field's doc comment (the help text), its flag and key
/// (the field's name), its type and its default. It makes one struct per group (serde for the TOML
/// keys; with the `cli` feature, clap for the flags, whose defaults are these same expressions) with
/// its `Default`, and the whole struct that flattens them: the keys and flags stay flat (`lr`,
/// `--lr`), the code reads `cfg.optimizer.lr`, and `--help` shows one heading per group. A `value`
/// shows its default in `--help` (through `Display`), a `path` likewise for a path, an `option` has
/// none. The brackets hold further `#[arg(…)]` settings.
macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[doc = $group_doc:expr])*
                $group:ident : $group_ty:ident ($heading:literal) { $($body:tt)* }
            )*
        }
    ) => {
        $(settings!(@fields [$(#[doc = $group_doc])*] $group_ty [] [] $($body)*);)*

        $(#[$meta])*
        #[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        pub struct $name {
            $(
                $(#[doc = $group_doc])*
                #[serde(flatten)]
                #[cfg_attr(feature = "cli", command(flatten, next_help_heading = $heading))]
                pub $group: $group_ty,
            )*
        }

        impl $name {
            /// Each group's name (its `run.toml` table) and its keys.
            pub fn groups() -> Vec<(&'static str, Vec<String>)> {
                vec![$((stringify!($group), keys_of(&$group_ty::default())),)*]
            }
        }
    };
    (@fields $meta:tt $name:ident [$($fields:tt)*] [$($defaults:tt)*]
        $(#[doc = $doc:expr])* value [$($extra:tt)*] $field:ident : $ty:ty = $default:expr; $($rest:tt)*
    ) => {
        settings!(@fields $meta $name
            [$($fields)* $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg(long, default_value_t = $default, $($extra)*))]
                pub $field: $ty,]
            [$($defaults)* $field: $default,]
            $($rest)*);
    };
    (@fields $meta:tt $name:ident [$($fields:tt)*] [$($defaults:tt)*]
        $(#[doc = $doc:expr])* path [$($extra:tt)*] $field:ident : $ty:ty = $default:expr; $($rest:tt)*
    ) => {
        settings!(@fields $meta $name
            [$($fields)* $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg(long, default_value_os_t = $default, $($extra)*))]
                pub $field: $ty,]
            [$($defaults)* $field: $default,]
            $($rest)*);
    };
    (@fields $meta:tt $name:ident [$($fields:tt)*] [$($defaults:tt)*]
        $(#[doc = $doc:expr])* option [$($extra:tt)*] $field:ident : $ty:ty; $($rest:tt)*
    ) => {
        settings!(@fields $meta $name
            [$($fields)* $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg(long, $($extra)*))]
                pub $field: $ty,]
            [$($defaults)* $field: None,]
            $($rest)*);
    };
    (@fields [$(#[$meta:meta])*] $name:ident [$($fields:tt)*] [$($defaults:tt)*]) => {
        $(#[$meta])*
        #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        #[serde(default)]
        pub struct $name { $($fields)* }

        impl Default for $name {
            fn default() -> Self {
                Self { $($defaults)* }
            }
        }
    };
}

settings! {
    /// Every setting of a training run, grouped by concern. Each is a key of `run.toml` (at the top
    /// level, or in its group's table: `[optimizer] lr = 1e-3`) and a `ferrotron train` flag.
    pub struct TrainConfig {
        /// The model, its data and the sequences cut from it.
        input: InputSettings ("Model and data") {
            /// A preset (llama-small, llama-tiny, gpt2-tiny, llama-bench), trained from scratch, or a
            /// Hugging Face model directory, fine-tuned.
            value [] model: String = String::from("llama-small");
            /// `builtin:gnu-manuals`, or comma-separated text files or directories of text files.
            value [] data: String = String::from(data::BUILTIN_NAME);
            /// A tokenizer.json (default: the model directory's, or one trained on the data and cached).
            option [] tokenizer: Option<PathBuf>;
            /// Tokens per sequence.
            value [] seq_len: usize = 128;
            /// A mixture of experts: drop tokens past each expert's capacity, ⌈F · tokens · top_k /
            /// experts⌉ of a micro-batch's places on each device, recorded in metrics.jsonl
            /// (default: dropless, as transformers computes these models).
            option [] capacity_factor: Option<f64>;
            /// Seeds the preset's initial weights and the data order.
            value [] seed: u64 = 0;
            /// Fraction of the token stream (its tail) held out for validation.
            value [] val_fraction: f64 = 0.05;
            /// Where trained tokenizers are cached (default: `$XDG_CACHE_HOME/ferrotron` or
            /// `~/.cache/ferrotron`).
            option [] cache_dir: Option<PathBuf>;
        }
        /// How many steps of how many sequences, and AdamW with its learning-rate schedule.
        optimizer: OptimizerSettings ("Optimizer and schedule") {
            /// Optimizer steps.
            value [] steps: usize = 240;
            /// Sequences per optimizer step (the effective batch, whatever the layout).
            value [] batch_size: usize = 16;
            /// Peak learning rate (after warm-up; cosine decay to `min_lr`).
            value [] lr: f64 = 3e-3;
            /// The learning rate the cosine decay ends at.
            value [] min_lr: f64 = 3e-4;
            /// Steps of linear warm-up from 0 to `lr`.
            value [] warmup_steps: usize = 20;
            /// AdamW's decoupled weight decay.
            value [] weight_decay: f32 = 0.1;
            /// Adam's first-moment decay.
            value [] beta1: f32 = 0.9;
            /// Adam's second-moment decay.
            value [] beta2: f32 = 0.95;
            /// Adam's epsilon.
            value [] adam_eps: f32 = 1e-8;
            /// Clip the global gradient norm to this (0: no clipping).
            value [] grad_clip: f64 = 1.0;
            /// When this run continues one (`resume`, or fine-tuning a run's `model/`) with a different
            /// number of tokens per optimizer step: how the LR follows — `none` (keep `lr` and `min_lr`),
            /// `linear` or `sqrt` (the earlier run's, times the ratio or its square root). Without it such a
            /// run is refused.
            option [] lr_scaling: Option<LrScaling>;
        }
        /// Low-rank adapters on a frozen base (none: every parameter trains).
        lora: LoraSettings ("LoRA fine-tuning") {
            /// Fine-tune LoRA adapters of this rank on the frozen model: the base gets no gradients,
            /// optimizer state or master copy (without it, every parameter trains).
            option [] lora_rank: Option<usize>;
            /// LoRA's alpha: the adapters' product is scaled by alpha / rank (default: twice the rank).
            option [] lora_alpha: Option<f64>;
            /// The projections the adapters target, comma-separated (default: every projection —
            /// q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; GPT-2 c_attn,c_proj,c_fc).
            value [] lora_targets: String = String::from("");
            /// Start LoRA from this PEFT adapter directory (adapter_config.json +
            /// adapter_model.safetensors): its rank, alpha and targets.
            option [] adapter: Option<PathBuf>;
            /// QLoRA: store the frozen base's projections in 4 bits, `nf4` (as bitsandbytes' NF4 with
            /// double quantization), dequantized a panel at a time into the GEMM's operand.
            option [] quantize_base: Option<BaseQuantization>;
        }
        /// How the model is cut over which devices, and how they talk.
        parallelism: ParallelismSettings ("Layout and devices") {
            /// The `--layout` spec, e.g. `dp=2,tp=2,pp=2,zero=1,mbs=2`, or `auto` (empty: one device).
            value [] layout: LayoutSpec = LayoutSpec::default();
            /// The cluster the devices stand for (a `ferrotron plan --cluster` spec): node placement, the
            /// planner's predictions, and the device memory `layout = "auto"` plans for.
            value [] cluster: String = String::from("this-machine");
            /// Memory of each device, e.g. `64MiB`, `1.5GB` (default: the cluster's). Going over it is an
            /// out-of-memory error with the per-term breakdown.
            option [allow_hyphen_values = true] device_memory: Option<String>;
            /// Allow a tensor-parallel group to span nodes.
            value [action = clap::ArgAction::Set] force_cross_node_tp: bool = false;
            /// Where the devices run: `threads` (one process) or `mpi` (one rank per device under mpirun;
            /// needs a build with the `mpi` feature).
            value [] backend: CommBackend = CommBackend::Threads;
            /// Kernel threads of a device that has the process to itself (0: all cores). Several devices
            /// in one process compute on one thread each.
            value [] threads: usize = 0;
            /// Seconds a device waits for a peer (a message, a collective) before it names the peer and
            /// ends the run (default: 600 on threads, 60 under MPI).
            option [] peer_timeout: Option<f64>;
        }
        /// The mixed-precision policy and fp16 loss scaling.
        numerics: PrecisionSettings ("Precision") {
            /// `f32`, or mixed precision `bf16` / `fp16`: weights, gradients and activations stored (and
            /// moved) in 16 bits, master weights and Adam moments in f32.
            value [] precision: MixedPrecision = MixedPrecision::F32;
            /// fp16: the initial loss scale ...
            value [] loss_scale: f64 = LossScaling::DEFAULT.initial;
            /// ... and how many clean steps double it (an inf/NaN halves it and skips the step).
            value [] loss_scale_window: usize = LossScaling::DEFAULT.growth_interval;
            /// Testing: put an inf into the gradients at this step (fp16 must skip it).
            option [] inject_nonfinite_step: Option<usize>;
        }
        /// Where the run writes, what it may replace, and the checkpoints it keeps or resumes from.
        checkpointing: CheckpointSettings ("Run directory and checkpoints") {
            /// Run directory: metrics.jsonl, train_config.json, model/, checkpoints/.
            path [] out_dir: PathBuf = PathBuf::from("runs/default");
            /// When `out_dir` (or the checkpoint directory) already holds a run, replace it: its metrics,
            /// model and checkpoints are deleted. Without this or `resume` such a directory is refused.
            value [] overwrite: bool = false;
            /// Precision of the saved model: f32, bf16 or f16.
            value [] save_dtype: StorageDtype = StorageDtype::F32;
            /// Save a sharded checkpoint every this many steps (0: only after the last step, which always
            /// saves one).
            value [] checkpoint_every: usize = 0;
            /// Where checkpoints go (default: `<out_dir>/checkpoints`).
            option [] checkpoint_dir: Option<PathBuf>;
            /// Keep only the newest this many checkpoints (0: keep all).
            value [] keep_checkpoints: usize = 0;
            /// Save checkpoints in the background: the step's state is copied in memory and written
            /// (uploaded) by a thread while training continues; at most one save is in flight, and
            /// `latest` moves only once every rank's file is written.
            value [] checkpoint_async: bool = false;
            /// Continue from this checkpoint (a `step-NNNNNN` directory, or a checkpoint directory whose
            /// `latest` names one), on this run's layout: the parameters and Adam moments are resharded
            /// to it, the data loader, LR schedule and loss scaler continue where they were.
            option [] resume: Option<PathBuf>;
        }
        /// Validation, the report, straggler warnings and drills.
        logging: LoggingSettings ("Evaluation and logging") {
            /// Evaluate the validation loss every this many steps (and before the first and after the last).
            value [] eval_every: usize = 40;
            /// Validation batches per evaluation (at most; fewer when less is held out).
            value [] eval_batches: usize = 8;
            /// At the end of the run, write `report.html` into `out_dir`: loss, tokens/s, memory per device
            /// by term, idle per device over the steps and straggler warnings, from `metrics.jsonl`.
            value [] report: bool = false;
            /// Warn of a straggler when a device computes this fraction above the devices' median ...
            value [] straggler_threshold: f64 = 0.2;
            /// ... for this many steps in a row.
            value [] straggler_steps: usize = 3;
            /// Drills: make this device compute `slow_device_ms` longer per action.
            option [] slow_device: Option<usize>;
            /// How much longer the drill's slow device computes per action.
            value [] slow_device_ms: f64 = 10.0;
            /// Drills: `RANK@STEP` makes device RANK stop answering after step STEP (1-based) for
            /// twice the peer timeout, so that the others time out and every device writes its
            /// flight records (`<out_dir>/flight/rank-N.json`).
            option [] inject_hang: Option<String>;
        }
    }
}

impl TrainConfig {
    /// Defaults, then the keys of a TOML file (`toml`, already parsed to JSON), then the flags the
    /// user gave (`flags`: the parsed settings, `given`: whether a setting's flag was on the command
    /// line). `source` names the file in errors.
    pub fn layered(
        toml: Option<serde_json::Map<String, serde_json::Value>>,
        flags: &TrainConfig,
        given: &dyn Fn(&str) -> bool,
        source: &str,
    ) -> Result<TrainConfig> {
        let defaults = match serde_json::to_value(TrainConfig::default()) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => unreachable!("a struct serialises to an object"),
        };
        let mut merged = defaults.clone();
        if let Some(t) = toml {
            for (k, v) in flat_keys(t, source)? {
                if !merged.contains_key(&k) {
                    return Err(EngineError::Invalid(format!(
                        "{source}: unknown key `{k}` (the keys are the `ferrotron train` flags \
                         with `_` for `-`)"
                    )));
                }
                merged.insert(k, v);
            }
        }
        if let Ok(serde_json::Value::Object(f)) = serde_json::to_value(flags) {
            for (k, v) in f {
                if given(&k) {
                    // A flag given a NaN or infinity: it has no JSON form and arrives as null,
                    // which an optional setting would take for "not given".
                    if v.is_null() {
                        return Err(EngineError::Invalid(format!(
                            "{source}: `{k}` must be a finite number"
                        )));
                    }
                    merged.insert(k, v);
                }
            }
        }
        serde_json::from_value(serde_json::Value::Object(merged.clone())).map_err(|e| {
            // serde names the type it expected, not the key: find the key by trying each value
            // alone on the defaults. A NaN or infinity has no JSON form and arrives as null.
            let bad = merged.iter().find(|(k, v)| {
                let mut one = defaults.clone();
                one.insert((*k).clone(), (*v).clone());
                serde_json::from_value::<TrainConfig>(serde_json::Value::Object(one)).is_err()
            });
            EngineError::Invalid(match bad {
                Some((k, v)) if v.is_null() => {
                    format!("{source}: `{k}` must be a finite number")
                }
                Some((k, _)) => format!("{source}: `{k}`: {e}"),
                None => format!("{source}: bad train config: {e}"),
            })
        })
    }

    /// `lora_targets` as a list (empty: every projection).
    pub fn lora_targets(&self) -> Vec<String> {
        self.lora
            .lora_targets
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Kernel threads of a device that has its process to itself.
    pub fn kernel_threads(&self) -> usize {
        if self.parallelism.threads == 0 {
            crate::kernels::CpuBackend::default().threads
        } else {
            self.parallelism.threads
        }
    }

    /// Where checkpoints go.
    /// AdamW as these settings configure it.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            beta1: self.optimizer.beta1,
            beta2: self.optimizer.beta2,
            eps: self.optimizer.adam_eps,
            weight_decay: self.optimizer.weight_decay,
        }
    }

    /// Warm-up to `lr`, then cosine decay to `min_lr` at the last step.
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            peak_lr: self.optimizer.lr,
            min_lr: self.optimizer.min_lr,
            warmup_steps: self.optimizer.warmup_steps,
            total_steps: self.optimizer.steps,
        }
    }

    pub fn checkpoint_root(&self) -> PathBuf {
        self.checkpointing
            .checkpoint_dir
            .clone()
            .unwrap_or_else(|| self.checkpointing.out_dir.join("checkpoints"))
    }

    /// [`TrainConfig::checkpoint_root`] as a location: a local directory or an `s3://` prefix.
    pub fn checkpoint_location(&self) -> Result<crate::storage::Location> {
        crate::storage::Location::parse(&self.checkpoint_root().to_string_lossy())
    }

    /// The hang drill's device and step (`inject_hang`), checked.
    pub fn inject_hang(&self) -> Result<Option<(usize, usize)>> {
        let Some(text) = &self.logging.inject_hang else {
            return Ok(None);
        };
        let parsed = text
            .split_once('@')
            .and_then(|(r, s)| Some((r.trim().parse().ok()?, s.trim().parse().ok()?)));
        match parsed {
            Some((rank, step)) if step >= 1 => Ok(Some((rank, step))),
            _ => Err(EngineError::Invalid(format!(
                "train config `inject_hang`: `{text}` is not RANK@STEP (a device and a step from 1, e.g. `1@3`)"
            ))),
        }
    }

    /// Refuses settings that cannot run, naming the setting.
    pub fn check(&self) -> Result<()> {
        let bad = |field: &str, msg: &str| {
            Err(EngineError::Invalid(format!(
                "train config `{field}`: {msg}"
            )))
        };
        if self.optimizer.steps == 0 {
            return bad("steps", "must be positive");
        }
        if self.optimizer.batch_size == 0 {
            return bad("batch_size", "must be positive");
        }
        if self.input.seq_len < 2 {
            return bad(
                "seq_len",
                "must be at least 2 (one token predicts the next)",
            );
        }
        if !(self.optimizer.lr.is_finite() && self.optimizer.lr > 0.0) {
            return bad("lr", "must be a positive number");
        }
        if let Some(f) = self.input.capacity_factor {
            if let Err(why) = ferrotron_core::model::MoeConfig::check_capacity_factor(f) {
                return bad("capacity_factor", &why);
            }
        }
        if !(self.optimizer.min_lr.is_finite() && self.optimizer.min_lr >= 0.0) {
            return bad("min_lr", "must be a non-negative number");
        }
        let o = &self.optimizer;
        if o.min_lr > o.lr {
            return bad(
                "min_lr",
                &format!(
                    "{} is above lr {}: the decay would raise the learning rate; give a min_lr of at most lr",
                    o.min_lr, o.lr
                ),
            );
        }
        for (name, value) in [("beta1", o.beta1), ("beta2", o.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return bad(name, &format!("{value} is outside [0, 1): Adam's moments would not average (1 never forgets, above 1 grows without bound)"));
            }
        }
        if !(o.adam_eps.is_finite() && o.adam_eps > 0.0) {
            return bad(
                "adam_eps",
                &format!(
                    "{} must be a positive number (0 divides by zero where a gradient is 0)",
                    o.adam_eps
                ),
            );
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return bad(
                "weight_decay",
                &format!("{} must be a non-negative number", o.weight_decay),
            );
        }
        if !(o.grad_clip.is_finite() && o.grad_clip >= 0.0) {
            return bad(
                "grad_clip",
                &format!(
                    "{} must be a non-negative number (0: no clipping)",
                    o.grad_clip
                ),
            );
        }
        if self.numerics.loss_scale_window == 0 {
            return bad(
                "loss_scale_window",
                "must be at least 1 (clean steps before the loss scale grows)",
            );
        }
        if self.logging.straggler_steps == 0 {
            return bad(
                "straggler_steps",
                "must be at least 1 (steps a device must be slow before it is named)",
            );
        }
        const MAX_THREADS: usize = 4096;
        if self.parallelism.threads > MAX_THREADS {
            return bad(
                "threads",
                &format!(
                    "{} is more than {MAX_THREADS}: give the cores a device should use (0: all)",
                    self.parallelism.threads
                ),
            );
        }
        if self.checkpointing.out_dir.as_os_str().is_empty() {
            return bad("out_dir", "is empty: name the run's directory (an empty name would write into the current directory)");
        }
        if self
            .checkpointing
            .checkpoint_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            return bad(
                "checkpoint_dir",
                "is empty: name the directory, or leave it out for <out_dir>/checkpoints",
            );
        }
        if let Some(r) = self.lora.lora_rank {
            if r == 0 || r > ferrotron_core::model::MAX_RANK {
                return bad(
                    "lora_rank",
                    &format!("must be between 1 and {}", ferrotron_core::model::MAX_RANK),
                );
            }
        }
        if let Some(t) = self.parallelism.peer_timeout {
            if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
                return bad("peer_timeout", "must be a number of seconds in (0, 86400]");
            }
        }
        if let Some(a) = self.lora.lora_alpha {
            if !(a.is_finite() && a > 0.0) {
                return bad("lora_alpha", "must be a positive number");
            }
        }
        let no_lora = self.lora.lora_rank.is_none() && self.lora.adapter.is_none();
        if no_lora && (self.lora.lora_alpha.is_some() || !self.lora_targets().is_empty()) {
            return bad(
                if self.lora.lora_alpha.is_some() {
                    "lora_alpha"
                } else {
                    "lora_targets"
                },
                "applies to LoRA: give `lora_rank` (or `adapter`) too",
            );
        }
        if no_lora && self.checkpointing.resume.is_none() && self.lora.quantize_base.is_some() {
            return bad(
                "quantize_base",
                "quantizes a frozen base: give `lora_rank` (or `adapter`) too (full training \
                 updates every weight, which a 4-bit base cannot hold)",
            );
        }
        if !(self.numerics.loss_scale.is_finite() && self.numerics.loss_scale >= 1.0) {
            return bad("loss_scale", "must be a finite number of at least 1");
        }
        if !(self.logging.straggler_threshold.is_finite()
            && self.logging.straggler_threshold >= 0.0)
        {
            return bad("straggler_threshold", "must be a non-negative fraction");
        }
        if !(self.logging.slow_device_ms.is_finite() && self.logging.slow_device_ms >= 0.0) {
            return bad(
                "slow_device_ms",
                "must be a non-negative number of milliseconds",
            );
        }
        self.inject_hang()?;
        if !(0.0..1.0).contains(&self.input.val_fraction) {
            return bad("val_fraction", "must be in [0, 1)");
        }
        ferrotron_core::topology::Cluster::parse(&self.parallelism.cluster)?;
        if let Some(m) = &self.parallelism.device_memory {
            parse_bytes(m)?;
        }
        Ok(())
    }
}

/// A serialised group's keys.
fn keys_of<T: serde::Serialize>(group: &T) -> Vec<String> {
    match serde_json::to_value(group) {
        Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
        _ => unreachable!("a group serialises to an object"),
    }
}

/// The keys of a `run.toml`, its group tables (`[optimizer] lr = 1e-3`) opened into flat keys. A key
/// in the wrong table, or given twice, is refused by name.
fn flat_keys(
    toml: serde_json::Map<String, serde_json::Value>,
    source: &str,
) -> Result<Vec<(String, serde_json::Value)>> {
    let groups = TrainConfig::groups();
    let mut flat: Vec<(String, serde_json::Value)> = Vec::new();
    for (k, v) in toml {
        let group = groups.iter().find(|(name, _)| *name == k);
        match (group, v) {
            (Some((name, keys)), serde_json::Value::Object(table)) => {
                for (key, value) in table {
                    if !keys.contains(&key) {
                        let home = groups.iter().find(|(_, ks)| ks.contains(&key));
                        return Err(EngineError::Invalid(match home {
                            Some((home, _)) => format!(
                                "{source}: `{key}` is not a key of `[{name}]`; it belongs in \
                                 `[{home}]` (or at the top level)"
                            ),
                            None => format!(
                                "{source}: unknown key `{key}` in `[{name}]` (its keys: {})",
                                keys.join(", ")
                            ),
                        }));
                    }
                    flat.push((key, value));
                }
            }
            (Some((name, _)), _) => {
                return Err(EngineError::Invalid(format!(
                    "{source}: `{name}` is a group of settings: write it as a table, `[{name}]`"
                )))
            }
            (None, v) => flat.push((k, v)),
        }
    }
    for (i, (k, _)) in flat.iter().enumerate() {
        if flat[..i].iter().any(|(earlier, _)| earlier == k) {
            return Err(EngineError::Invalid(format!(
                "{source}: `{k}` is given twice (at the top level and in its table, or in both)"
            )));
        }
    }
    Ok(flat)
}

/// `64MiB`, `1.5GB`, `200000000` → bytes.
pub fn parse_bytes(spec: &str) -> Result<u64> {
    let t = spec.trim();
    // The unit starts at the first letter that is not an exponent (`1e3GB`, `1.5E-2GiB`).
    let chars: Vec<(usize, char)> = t.char_indices().collect();
    let split = chars
        .iter()
        .enumerate()
        .find(|&(i, &(_, c))| {
            let exponent = matches!(c, 'e' | 'E')
                && i > 0
                && chars
                    .get(i + 1)
                    .is_some_and(|&(_, n)| n.is_ascii_digit() || n == '-' || n == '+');
            c.is_ascii_alphabetic() && !exponent
        })
        .map_or(t.len(), |(_, &(at, _))| at);
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
    let bytes = x * scale;
    if bytes >= u64::MAX as f64 {
        return Err(EngineError::Invalid(format!(
            "device_memory `{spec}` is {bytes:e} bytes, more than 2⁶⁴: is it the size you meant?"
        )));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_embedded_run() {
        let d = TrainConfig::default();
        assert_eq!(d.input.model, "llama-small");
        assert_eq!(
            (d.optimizer.steps, d.optimizer.batch_size, d.input.seq_len),
            (240, 16, 128)
        );
        assert_eq!(d.checkpointing.out_dir, PathBuf::from("runs/default"));
        assert!(d.checkpointing.resume.is_none() && !d.parallelism.force_cross_node_tp);
    }

    #[test]
    fn flags_override_the_file_which_overrides_the_defaults() {
        let toml: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"steps": 7, "lr": 0.01}"#).unwrap();
        let flags = {
            let mut c = TrainConfig::default();
            c.optimizer.steps = 9;
            c.optimizer.lr = 0.5;
            c
        };
        let cfg = TrainConfig::layered(Some(toml.clone()), &flags, &|k| k == "steps", "run.toml")
            .unwrap();
        assert_eq!(
            (
                cfg.optimizer.steps,
                cfg.optimizer.lr,
                cfg.optimizer.batch_size
            ),
            (9, 0.01, 16)
        );
        let mut bad = toml;
        bad.insert("stepz".into(), 3.into());
        let e = TrainConfig::layered(Some(bad), &flags, &|_| false, "run.toml").unwrap_err();
        assert!(e.to_string().contains("unknown key `stepz`"), "{e}");
        // A NaN flag and a wrongly typed key are named.
        let nan = {
            let mut c = TrainConfig::default();
            c.optimizer.lr = f64::NAN;
            c
        };
        let e = TrainConfig::layered(None, &nan, &|k| k == "lr", "flags").unwrap_err();
        assert_eq!(e.to_string(), "flags: `lr` must be a finite number");
        let typed: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"batch_size": "eight"}"#).unwrap();
        let e = TrainConfig::layered(Some(typed), &flags, &|_| false, "run.toml").unwrap_err();
        assert!(e.to_string().starts_with("run.toml: `batch_size`: "), "{e}");
    }

    #[test]
    fn a_toml_may_group_its_keys_in_their_tables() {
        let json = |t: &str| -> serde_json::Map<String, serde_json::Value> {
            serde_json::from_str(t).unwrap()
        };
        let d = TrainConfig::default();
        let toml = json(
            r#"{"optimizer": {"lr": 0.01, "steps": 7}, "parallelism": {"layout": "dp=2"},
                "seq_len": 64}"#,
        );
        let cfg = TrainConfig::layered(Some(toml), &d, &|_| false, "run.toml").unwrap();
        assert_eq!((cfg.optimizer.lr, cfg.optimizer.steps), (0.01, 7));
        assert_eq!(
            (cfg.parallelism.layout.text.as_str(), cfg.input.seq_len),
            ("dp=2", 64)
        );
        // Every key is in exactly one group, and the groups cover every key.
        let groups = TrainConfig::groups();
        let mut keys: Vec<&String> = groups.iter().flat_map(|(_, ks)| ks).collect();
        let n = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n);
        match serde_json::to_value(&d).unwrap() {
            serde_json::Value::Object(m) => assert_eq!(m.len(), n),
            _ => unreachable!(),
        }
        let refused = |t: &str| {
            TrainConfig::layered(Some(json(t)), &d, &|_| false, "run.toml")
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            refused(r#"{"optimizer": {"layout": "dp=2"}}"#),
            "run.toml: `layout` is not a key of `[optimizer]`; it belongs in `[parallelism]` \
             (or at the top level)"
        );
        let e = refused(r#"{"optimizer": {"lrr": 1}}"#);
        assert!(
            e.contains("unknown key `lrr` in `[optimizer]`") && e.contains("min_lr"),
            "{e}"
        );
        assert_eq!(
            refused(r#"{"optimizer": 3}"#),
            "run.toml: `optimizer` is a group of settings: write it as a table, `[optimizer]`"
        );
        let e = refused(r#"{"lr": 1, "optimizer": {"lr": 2}}"#);
        assert!(e.contains("`lr` is given twice"), "{e}");
    }
}

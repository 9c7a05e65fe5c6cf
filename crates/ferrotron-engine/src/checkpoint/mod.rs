//! Sharded checkpoints: one safetensors file per rank with exactly what that rank owns (parameter
//! shards as f32 master values, Adam moments), and a JSON manifest that names, for every tensor by
//! its Hugging Face name, its global shape and which file holds which slice; plus the layout, the
//! step, the optimizer, LR-schedule, loss-scaler and data-loader positions, and a SHA-256 per file.
//!
//! A slice is described in two steps, the way the runtime cuts a tensor: the tensor-parallel shard
//! (along `dim`, the concatenation of global `ranges`, then `pad` zero rows of vocabulary padding),
//! then the part `flat` of that shard flattened (all of it, or a ZeRO piece). Any layout can read any
//! other's slices: a reader intersects the slices it needs with the ones the files hold.
//!
//! Saving is atomic: rank files and the manifest go to a hidden staging directory, which is renamed
//! to `step-NNNNNN` only when all are written, synced and checked; `latest` is replaced last.

mod files;
mod layout;
mod order;
mod read;
pub mod remote;
mod slice;
mod tools;
mod write;

pub use layout::{manifest_tensors, rank_holdings, Holding};
pub use order::StoredOrder;
pub use read::Checkpoint;
pub use slice::overlap_spans;
pub use tools::{
    export_adapter, export_hf, export_merged, import_hf, inspect, load_params, reshard,
};
pub use write::{
    begin_save, commit, finish_save, prepare_staging, prune, save_distributed, write_own,
    write_rank_file, RankArrays, RankFile, CRASH_ENV,
};

use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::tensor::Slice;
use ferrotron_core::model::{LoraConfig, ModelConfig, ParamSpec};
use std::path::Path;

/// The manifest's `format` field.
pub const FORMAT: &str = "ferrotron-checkpoint";
pub const VERSION: u32 = 1;
pub const MANIFEST: &str = "manifest.json";
pub const LATEST: &str = "latest";

/// What a checkpoint holds besides the tensors, and where every slice of every tensor is.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Optimizer steps done (the LR schedule's position; training resumes at this 0-based step).
    pub step: usize,
    pub model: ModelConfig,
    /// The `--layout` the files were written under.
    pub layout: String,
    pub world_size: usize,
    /// `f32`, `bf16` or `fp16` (the stored values are always the f32 master weights).
    pub precision: ferrotron_core::precision::MixedPrecision,
    pub optimizer: OptimizerState,
    pub lr_schedule: Option<LrSchedule>,
    /// fp16 dynamic loss scaling: the scale and the clean steps since it last changed.
    pub loss_scaler: Option<LossScalerState>,
    /// The data loader's position (its shuffle RNG is seeded per epoch from `seed` and `epoch`,
    /// so this is the run's whole RNG state: training itself draws no random numbers).
    pub data_loader: Option<serde_json::Value>,
    /// The run's settings, for a person reading the manifest.
    pub run: Option<serde_json::Value>,
    /// Where the model came from when it was imported (`step` 0).
    pub source: Option<String>,
    pub files: Vec<FileEntry>,
    pub tensors: Vec<TensorEntry>,
    /// The run's `tokenizer.json`, kept beside the rank files so that an export is a whole model.
    #[serde(default)]
    pub tokenizer: Option<AuxFile>,
    /// Where [`write::commit`] copies the tokenizer from (not written: `tokenizer` records it).
    #[serde(skip)]
    pub tokenizer_source: Option<std::path::PathBuf>,
    /// LoRA: the adapters' configuration. The checkpoint's tensors are then the adapters (named as
    /// PEFT names them, less its `base_model.model.` prefix) and their optimizer state; the frozen
    /// base is not in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// LoRA: the base model the adapters were trained on (a Hugging Face directory or a preset),
    /// which `export --merge` and a resume read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// QLoRA: how the frozen base was quantized; a resume and `export --merge` quantize it the same
    /// way (from the base model: quantization is deterministic, so the base is bit for bit the one
    /// the adapters trained on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize_base: Option<ferrotron_core::precision::BaseQuantization>,
    /// SHA-256 of the manifest itself (its JSON with this field left out): an edited `step`,
    /// `cursor` or `total_steps` would make a resume skip or repeat data, so it is caught.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

impl Manifest {
    /// SHA-256 of this manifest's JSON, its checksum left out.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let unsealed = Manifest {
            checksum: None,
            ..self.clone()
        };
        let json = serde_json::to_vec(&unsealed).expect("the manifest serialises");
        Sha256::digest(&json)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The tensors the checkpoint holds: the model's parameters, or with LoRA its adapters.
    pub fn trained_specs(&self) -> Vec<ParamSpec> {
        match &self.lora {
            Some(l) => l.adapter_specs(&self.model),
            None => self.model.param_specs(),
        }
    }
}

/// A file of a checkpoint that is not a rank's: its name in the checkpoint, size and SHA-256.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AuxFile {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

/// The name of the tokenizer's copy in a checkpoint.
pub const TOKENIZER: &str = "tokenizer.json";

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerState {
    /// Adam's bias-correction count (0: fresh moments, none stored).
    pub step: u64,
    pub adamw: AdamWConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScalerState {
    pub scale: f64,
    pub clean_steps: usize,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    pub rank: usize,
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
    /// SHA-256 of the file's header, which holds each array's SHA-256 (`sha256:<key>`): a reader
    /// of some arrays (a resume from an object store) verifies just those. Absent in checkpoints
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_sha256: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TensorEntry {
    /// The Hugging Face name.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub pieces: Vec<Piece>,
}

/// Which state of a parameter an array holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The f32 master weights.
    Param,
    /// Adam's first moment.
    ExpAvg,
    /// Adam's second moment.
    ExpAvgSq,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Param, Kind::ExpAvg, Kind::ExpAvgSq];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Param => "param",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
        }
    }
    /// The array's key in a rank file.
    pub fn key(self, tensor: &str) -> String {
        format!("{}/{tensor}", self.name())
    }
}

/// One array of a rank file: part `flat` of the tensor-parallel shard `tp_slice` (shape
/// `shard_shape`) of a tensor, flattened, its elements in the order `order`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Piece {
    pub kind: Kind,
    pub file: String,
    pub key: String,
    pub tp_slice: SliceEntry,
    pub shard_shape: Vec<usize>,
    pub flat: [usize; 2],
    /// Absent: row-major (every piece of checkpoints written before cut-major order existed).
    #[serde(default, skip_serializing_if = "StoredOrder::is_row_major")]
    pub order: StoredOrder,
}

/// A tensor-parallel shard as the manifest writes it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SliceEntry {
    pub dim: usize,
    pub ranges: Vec<[usize; 2]>,
    pub pad: usize,
}

impl From<&Slice> for SliceEntry {
    fn from(s: &Slice) -> Self {
        Self {
            dim: s.dim,
            ranges: s.ranges.iter().map(|r| [r.start, r.end]).collect(),
            pad: s.pad,
        }
    }
}

impl From<&SliceEntry> for Slice {
    fn from(s: &SliceEntry) -> Self {
        Self {
            dim: s.dim,
            ranges: s.ranges.iter().map(|r| r[0]..r[1]).collect(),
            pad: s.pad,
        }
    }
}

/// A checkpoint directory's name.
/// Whether the checkpoint directory `root` holds checkpoints: `latest`, or a step directory.
pub fn holds_checkpoints(root: &Path) -> bool {
    root.join(LATEST).exists()
        || std::fs::read_dir(root).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("step-") && e.path().is_dir())
        })
}

/// Deletes the checkpoints in `root`: its step directories and `latest`, nothing else (the
/// directory may hold a user's other files).
pub fn remove_checkpoints(root: &Path) -> crate::error::Result<()> {
    use crate::error::EngineError;
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let p = entry.path();
        if name.starts_with("step-") && p.is_dir() {
            std::fs::remove_dir_all(&p).map_err(|e| EngineError::io(&p, e))?;
        } else if name == LATEST {
            std::fs::remove_file(&p).map_err(|e| EngineError::io(&p, e))?;
        }
    }
    Ok(())
}

pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// A rank file's name.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// A model's shape in a few words, for messages.
pub fn describe_model(cfg: &ModelConfig) -> String {
    format!(
        "{:?}: {} layers, hidden {}, {} heads ({} KV), MLP {}, vocabulary {}",
        cfg.arch,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size
    )
}

//! The offline tools: inspect a checkpoint, reshard it to another layout, export it as a Hugging
//! Face model directory, import a Hugging Face model as a step-0 checkpoint. Each works one rank
//! file (reshard, import) or one tensor (export) at a time.

use super::layout::rank_holdings;
use super::write::{commit, prepare_staging, write_rank_file, RankArrays, RankFile};
use super::{Checkpoint, Kind, Manifest, OptimizerState, FORMAT, MANIFEST, TOKENIZER, VERSION};
use crate::dir_lock::{self, DirLock, Stale};
use crate::error::{EngineError, Result};
use crate::hf::{self, StorageDtype};
use crate::memory::format_bytes;
use crate::optim::AdamWConfig;
use crate::parallel::TpShard;
use crate::transformer::ParamStore;
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::StagePartition;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// What an offline tool writes into its destination.
#[derive(Clone, Copy)]
enum Writes {
    /// A checkpoint (a step directory, and `latest` naming it).
    Checkpoint,
    /// A Hugging Face model or PEFT adapter directory.
    Model,
}

/// The files a model or adapter directory is made of: one already there belongs to another model.
const MODEL_FILES: [&str; 6] = [
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    TOKENIZER,
];

/// Locks the destination `dir` of `what` and checks that it holds nothing the tool would replace:
/// another run's checkpoints (their `latest` would then name a different run's step) or another
/// model's files. With `overwrite` they are replaced: a checkpoint directory is emptied of its
/// steps and `latest` first, so that no step of the other run is left beside the new one.
fn claim_destination(dir: &Path, what: &str, writes: Writes, overwrite: bool) -> Result<DirLock> {
    let stale = if overwrite {
        Stale::TakeOver
    } else {
        Stale::Refuse("pass --overwrite to take it over")
    };
    let lock = dir_lock::acquire(dir, what, stale)?;
    let held = match writes {
        Writes::Checkpoint => super::holds_checkpoints(dir).then(|| "checkpoints".to_string()),
        Writes::Model => MODEL_FILES
            .iter()
            .find(|f| dir.join(f).exists())
            .map(|f| format!("a model (`{f}`)")),
    };
    match (held, overwrite) {
        (None, _) => Ok(lock),
        (Some(held), false) => Err(EngineError::Invalid(format!(
            "`{}` already holds {held} that `{what}` would replace; write to an empty directory, or pass --overwrite to replace them",
            dir.display()
        ))),
        (Some(_), true) => {
            if let Writes::Checkpoint = writes {
                super::remove_checkpoints(dir)?;
            }
            Ok(lock)
        }
    }
}

/// Checks that `layout` can hold `cfg` (heads, KV heads, MLP and layers divide as it needs).
fn check_layout(cfg: &ModelConfig, layout: &Layout) -> Result<()> {
    TpShard::check(cfg, layout.tp.max(1))?;
    StagePartition::for_layout(cfg, layout)?;
    Ok(())
}

/// Writes a checkpoint of `manifest`'s step under `root` in `layout`, rank by rank, each rank's
/// arrays from `arrays_of(holding)`.
fn write_layout(
    root: &Path,
    mut manifest: Manifest,
    layout: &Layout,
    arrays_of: &dyn Fn(&super::Holding) -> Result<RankArrays>,
) -> Result<PathBuf> {
    check_layout(&manifest.model, layout)?;
    let step = manifest.step;
    let staging = prepare_staging(root, step)?;
    let mut files: Vec<RankFile> = Vec::new();
    for rank in 0..layout.world_size() {
        let arrays = rank_holdings(&manifest.model, manifest.lora.as_ref(), layout, rank)?
            .iter()
            .map(arrays_of)
            .collect::<Result<Vec<_>>>()?;
        files.push(write_rank_file(&staging, rank, step, &arrays)?);
    }
    manifest.layout = layout.to_string();
    manifest.world_size = layout.world_size();
    commit(root, &staging, manifest, files, 0)
}

/// Rewrites the checkpoint at `src` for `layout` under `out_root` (parameters and Adam moments
/// resharded; everything else carried over). Returns the new checkpoint's directory.
pub fn reshard(src: &Path, layout: &Layout, out_root: &Path, overwrite: bool) -> Result<PathBuf> {
    let ck = Checkpoint::open(src)?;
    if out_root.canonicalize().ok() == ck.dir.parent().and_then(|p| p.canonicalize().ok()) {
        return Err(EngineError::Invalid(format!(
            "checkpoint reshard: write to another directory than {} (it would replace the source)",
            ck.dir.parent().unwrap_or(&ck.dir).display()
        )));
    }
    let _lock = claim_destination(
        out_root,
        "checkpoint reshard",
        Writes::Checkpoint,
        overwrite,
    )?;
    let moments = ck.manifest.optimizer.step > 0;
    let mut manifest = ck.manifest.clone();
    manifest.tokenizer_source = ck.tokenizer();
    write_layout(out_root, manifest, layout, &|h| {
        let read = |k| ck.read(&h.name, k, &h.tp_slice, h.flat.clone());
        Ok(RankArrays {
            holding: h.clone(),
            param: read(Kind::Param)?,
            moments: if moments {
                Some((read(Kind::ExpAvg)?, read(Kind::ExpAvgSq)?))
            } else {
                None
            },
        })
    })
}

/// Imports the Hugging Face model directory `hf_dir` as a step-0 checkpoint in `layout` under
/// `out_root` (fresh optimizer: no moments stored). The model is read one tensor at a time.
pub fn import_hf(
    hf_dir: &Path,
    layout: &Layout,
    out_root: &Path,
    overwrite: bool,
) -> Result<PathBuf> {
    let cfg = hf::read_config(hf_dir)?;
    let weights = hf::WeightReader::open(hf_dir)?;
    weights.check(&cfg)?;
    let _lock = claim_destination(out_root, "checkpoint import", Writes::Checkpoint, overwrite)?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        step: 0,
        model: cfg.clone(),
        layout: String::new(),
        world_size: 0,
        precision: ferrotron_core::precision::MixedPrecision::F32,
        optimizer: OptimizerState {
            step: 0,
            adamw: AdamWConfig::default(),
        },
        lr_schedule: None,
        loss_scaler: None,
        data_loader: None,
        run: None,
        source: Some(hf_dir.display().to_string()),
        files: Vec::new(),
        tensors: Vec::new(),
        tokenizer: None,
        tokenizer_source: Some(hf_dir.join(TOKENIZER)).filter(|p| p.exists()),
        lora: None,
        base_model: None,
        quantize_base: None,
        checksum: None,
    };
    let specs = cfg.param_specs();
    // The cut is the slice's alone: any shard object makes it.
    let cutter = TpShard::new(&cfg, 1, 0, false)?;
    write_layout(out_root, manifest, layout, &|h| {
        let spec = specs
            .iter()
            .find(|s| s.name == h.name)
            .expect("a holding names a model tensor");
        let shard = cutter.cut(spec, &h.tp_slice, &weights.read(&h.name)?);
        Ok(RankArrays {
            holding: h.clone(),
            param: shard[h.flat.clone()].to_vec(),
            moments: None,
        })
    })
}

/// One tensor of an export, read from the checkpoint only when the file writer reaches it.
struct ExportView<'a> {
    ck: &'a Checkpoint,
    name: String,
    shape: Vec<usize>,
    dtype: StorageDtype,
    error: &'a std::cell::RefCell<Option<EngineError>>,
}

impl View for &ExportView<'_> {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            StorageDtype::F32 => Dtype::F32,
            StorageDtype::Bf16 => Dtype::BF16,
            StorageDtype::F16 => Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let n = self.shape.iter().product::<usize>();
        let values = match self.ck.read_whole(&self.name, Kind::Param) {
            Ok(v) => v,
            Err(e) => {
                self.error.borrow_mut().get_or_insert(e);
                vec![0.0; n]
            }
        };
        Cow::Owned(hf::encode(&values, self.dtype).1)
    }
    fn data_len(&self) -> usize {
        let n = self.shape.iter().product::<usize>();
        n * if self.dtype == StorageDtype::F32 {
            4
        } else {
            2
        }
    }
}

/// Writes the checkpoint at `src` as a Hugging Face model directory `out` (`config.json` and
/// `model.safetensors` in `dtype`), one tensor in memory at a time.
pub fn export_hf(src: &Path, out: &Path, dtype: StorageDtype, overwrite: bool) -> Result<()> {
    let ck = Checkpoint::open(src)?;
    if ck.manifest.lora.is_some() {
        return Err(EngineError::Invalid(format!(
            "{} holds LoRA adapters, not a model: export them with `--adapter DIR` (a PEFT \
             adapter), or merge them into their base with `--merge` (`--base DIR` to name the \
             base model; default the one it was trained on, {})",
            ck.dir.display(),
            ck.manifest.base_model.as_deref().unwrap_or("not recorded")
        )));
    }
    let cfg = &ck.manifest.model;
    let _lock = claim_destination(out, "checkpoint export", Writes::Model, overwrite)?;
    let error = std::cell::RefCell::new(None);
    let views: Vec<(String, ExportView)> = cfg
        .param_specs()
        .into_iter()
        .map(|s| {
            (
                s.name.clone(),
                ExportView {
                    ck: &ck,
                    name: s.name,
                    shape: s.shape,
                    dtype,
                    error: &error,
                },
            )
        })
        .collect();
    let file = out.join("model.safetensors");
    let tmp = out.join(".model.safetensors.partial");
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views.iter().map(|(k, v)| (k.clone(), v)), Some(meta), &tmp)
        .map_err(|e| EngineError::format(&tmp, e.to_string()))?;
    if let Some(e) = error.into_inner() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| EngineError::io(&tmp, e))?;
    std::fs::rename(&tmp, &file).map_err(|e| EngineError::io(&file, e))?;
    if let Some(src) = ck.tokenizer() {
        let dst = out.join(TOKENIZER);
        std::fs::copy(&src, &dst).map_err(|e| EngineError::io(&dst, e))?;
    }
    hf::write_config(out, cfg, dtype)
}

/// The LoRA checkpoint at `src` and its adapters, whole.
fn open_adapters(src: &Path) -> Result<(Checkpoint, crate::lora::Adapters)> {
    let ck = Checkpoint::open(src)?;
    let Some(config) = ck.manifest.lora.clone() else {
        return Err(EngineError::Invalid(format!(
            "{} holds a whole model, not LoRA adapters: export it with `--hf DIR`",
            ck.dir.display()
        )));
    };
    let params = ck.params()?;
    Ok((ck, crate::lora::Adapters { config, params }))
}

/// Writes the LoRA adapters of the checkpoint at `src` as a PEFT adapter directory `out` (what
/// `peft.PeftModel.from_pretrained` loads onto the base model).
pub fn export_adapter(src: &Path, out: &Path, overwrite: bool) -> Result<()> {
    let (ck, adapters) = open_adapters(src)?;
    let _lock = claim_destination(out, "checkpoint export", Writes::Model, overwrite)?;
    adapters.save_peft(out, &ck.manifest.model, ck.manifest.base_model.as_deref())
}

/// Writes the LoRA checkpoint at `src` merged into its base (`base`, or the base model the
/// manifest records) as a Hugging Face model directory `out`: every target's weight becomes
/// `W + (alpha/r)·B·A`.
pub fn export_merged(
    src: &Path,
    base: Option<&Path>,
    out: &Path,
    dtype: StorageDtype,
    overwrite: bool,
) -> Result<()> {
    let (ck, adapters) = open_adapters(src)?;
    let _lock = claim_destination(out, "checkpoint export", Writes::Model, overwrite)?;
    let m = &ck.manifest;
    let base_spec = match (base, &m.base_model) {
        (Some(b), _) => b.display().to_string(),
        (None, Some(b)) => b.clone(),
        (None, None) => {
            return Err(EngineError::Invalid(format!(
                "{}: the base model is not recorded; name it with `--base DIR`",
                ck.dir.display()
            )))
        }
    };
    let (cfg, mut base_params, source) = crate::model_source::resolve_model(&base_spec, 0)?;
    if matches!(source, crate::model_source::ModelSource::Preset(_)) {
        return Err(EngineError::Invalid(format!(
            "the adapters' base is the preset `{base_spec}`, whose weights were drawn from a \
             seed, not saved: name the base model directory with `--base DIR`"
        )));
    }
    ck.check_model(&cfg)?;
    // QLoRA: the adapters trained on the quantized base; merged onto it (dequantized), as PEFT
    // merges on a 4-bit base.
    if let Some(ferrotron_core::precision::BaseQuantization::Nf4) = m.quantize_base {
        base_params.quantize_nf4(&cfg);
    }
    let merged = adapters.merge(&cfg, &base_params)?;
    hf::save_model(out, &cfg, &merged, dtype)?;
    if let Some(src) = ck.tokenizer() {
        let dst = out.join(TOKENIZER);
        std::fs::copy(&src, &dst).map_err(|e| EngineError::io(&dst, e))?;
    }
    Ok(())
}

/// A person's summary of the checkpoint at `path`, after verifying every file's checksum.
pub fn inspect(path: &Path) -> Result<String> {
    let ck = Checkpoint::open(path)?;
    let m = &ck.manifest;
    let mut out = String::new();
    let _ = writeln!(out, "checkpoint {}", ck.dir.display());
    let _ = writeln!(
        out,
        "step {}  ·  layout {}  ·  {} ranks  ·  precision {}",
        m.step, m.layout, m.world_size, m.precision
    );
    let _ = writeln!(
        out,
        "model {}; {} parameters",
        super::describe_model(&m.model),
        m.model.num_params()
    );
    let _ = writeln!(
        out,
        "optimizer AdamW step {} (β1 {}, β2 {}, eps {:e}, weight decay {})",
        m.optimizer.step,
        m.optimizer.adamw.beta1,
        m.optimizer.adamw.beta2,
        m.optimizer.adamw.eps,
        m.optimizer.adamw.weight_decay
    );
    if let Some(s) = &m.lr_schedule {
        let _ = writeln!(
            out,
            "LR schedule: peak {:e}, min {:e}, warm-up {}, {} steps; next step {}",
            s.peak_lr, s.min_lr, s.warmup_steps, s.total_steps, m.step
        );
    }
    if let Some(s) = &m.loss_scaler {
        let _ = writeln!(
            out,
            "loss scaler: scale {}, {} clean steps",
            s.scale, s.clean_steps
        );
    }
    if let Some(d) = &m.data_loader {
        let _ = writeln!(out, "data loader: {d}");
    }
    if let Some(s) = &m.source {
        let _ = writeln!(out, "imported from {s}");
    }
    if let Some(l) = &m.lora {
        let _ = writeln!(
            out,
            "LoRA adapters: rank {}, alpha {}, on {}; {} trained parameters; base model {}{}",
            l.rank,
            l.alpha,
            l.targets.join(", "),
            l.num_params(&m.model),
            m.base_model.as_deref().unwrap_or("not recorded"),
            match m.quantize_base {
                Some(q) => format!(" (its projections quantized to {q})"),
                None => String::new(),
            }
        );
    }
    let _ = writeln!(
        out,
        "\n{:>5}  {:<24} {:>12}  sha256",
        "rank", "file", "bytes"
    );
    for f in &m.files {
        let _ = writeln!(
            out,
            "{:>5}  {:<24} {:>12}  {}  OK",
            f.rank, f.file, f.bytes, f.sha256
        );
    }
    let _ = writeln!(
        out,
        "\n{:<48} {:<14} {:>7}  {:>10}",
        "tensor", "shape", "pieces", "stored"
    );
    let mut total = 0u64;
    for t in &m.tensors {
        let bytes: u64 = t
            .pieces
            .iter()
            .map(|p| 4 * (p.flat[1] - p.flat[0]) as u64)
            .sum();
        total += bytes;
        let _ = writeln!(
            out,
            "{:<48} {:<14} {:>7}  {:>10}",
            t.name,
            format!("{:?}", t.shape),
            t.pieces.len(),
            format_bytes(bytes)
        );
    }
    let _ = writeln!(
        out,
        "\n{} tensors, {} stored; every file's size and SHA-256 match {MANIFEST}: checksums OK",
        m.tensors.len(),
        format_bytes(total)
    );
    Ok(out)
}

/// The whole parameters of the checkpoint at `path` (for tests and small models).
pub fn load_params(path: &Path) -> Result<(ModelConfig, ParamStore)> {
    let ck = Checkpoint::open(path)?;
    Ok((ck.manifest.model.clone(), ck.params()?))
}

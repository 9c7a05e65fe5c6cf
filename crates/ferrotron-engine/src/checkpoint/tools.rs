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
use crate::storage::Location;
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

/// Where an offline tool writes: a local directory, locked for the tool; or an `s3://` prefix,
/// written through a local stage that [`Destination::publish`] uploads when the tool is done (a
/// checkpoint in a save's order, manifest and `latest` last; a model with `config.json` last).
struct Destination {
    /// Where the tool writes its files.
    local: PathBuf,
    remote: Option<Location>,
    writes: Writes,
    _lock: Option<DirLock>,
}

impl Destination {
    /// Claims `dest` for `what`: it must hold nothing the tool would replace — another run's
    /// checkpoints (their `latest` would then name a different run's step) or another model's
    /// files. With `overwrite` they are replaced: a checkpoint directory is emptied of its steps
    /// and `latest` first, so that no step of the other run is left beside the new one.
    fn claim(dest: &Path, what: &str, writes: Writes, overwrite: bool) -> Result<Self> {
        let at = Location::parse(&dest.to_string_lossy())?;
        let (lock, local) = match &at {
            Location::Local(dir) => {
                let stale = if overwrite {
                    Stale::TakeOver
                } else {
                    Stale::Refuse("pass --overwrite to take it over")
                };
                (Some(dir_lock::acquire(dir, what, stale)?), dir.clone())
            }
            Location::S3(_) => {
                at.check_reachable()?;
                static STAGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = STAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let stage = ferrotron_core::topology::cache_dir()
                    .join("publish")
                    .join(format!("{}-{n}", std::process::id()));
                let _ = std::fs::remove_dir_all(&stage);
                std::fs::create_dir_all(&stage).map_err(|e| EngineError::io(&stage, e))?;
                (None, stage)
            }
        };
        let held = match writes {
            Writes::Checkpoint => match &at {
                Location::Local(dir) => super::holds_checkpoints(dir),
                remote => super::remote::holds_checkpoints(remote)?,
            }
            .then(|| "checkpoints".to_string()),
            Writes::Model => {
                let mut found = None;
                for f in MODEL_FILES {
                    if at.join(f).exists()? {
                        found = Some(format!("a model (`{f}`)"));
                        break;
                    }
                }
                found
            }
        };
        match (held, overwrite) {
            (Some(held), false) => {
                return Err(EngineError::Invalid(format!(
                    "`{at}` already holds {held} that `{what}` would replace; write to an empty directory, or pass --overwrite to replace them"
                )))
            }
            (Some(_), true) => match (&at, writes) {
                (Location::Local(dir), Writes::Checkpoint) => super::remove_checkpoints(dir)?,
                (remote @ Location::S3(_), Writes::Checkpoint) => {
                    super::remote::remove_checkpoints(remote)?
                }
                (Location::S3(_), Writes::Model) => {
                    for f in MODEL_FILES {
                        at.join(f).remove()?;
                    }
                }
                (Location::Local(_), Writes::Model) => {}
            },
            (None, _) => {}
        }
        let remote = matches!(at, Location::S3(_)).then_some(at);
        Ok(Self {
            local,
            remote,
            writes,
            _lock: lock,
        })
    }

    /// Where the tool writes its files.
    fn dir(&self) -> &Path {
        &self.local
    }

    /// Uploads what the tool wrote (on an object store); `written` is what it returned for the
    /// local stage (a checkpoint's directory), given back for the destination.
    fn publish(self, written: PathBuf) -> Result<PathBuf> {
        let Some(remote) = &self.remote else {
            return Ok(written);
        };
        let published = match self.writes {
            Writes::Checkpoint => super::remote::publish(&self.local, remote)?.to_string(),
            Writes::Model => {
                let mut files: Vec<PathBuf> = std::fs::read_dir(&self.local)
                    .map_err(|e| EngineError::io(&self.local, e))?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_file())
                    .collect();
                // `config.json` last: a reader that finds it finds the weights complete.
                files.sort_by_key(|p| p.file_name().is_some_and(|n| n == "config.json"));
                for f in files {
                    let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                    if !name.starts_with('.') {
                        remote.join(name).upload_file(&f)?;
                    }
                }
                remote.to_string()
            }
        };
        let _ = std::fs::remove_dir_all(&self.local);
        Ok(PathBuf::from(published))
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
    let same = |a: &Path, b: &Path| {
        a.canonicalize()
            .ok()
            .is_some_and(|x| b.canonicalize().ok() == Some(x))
            || a.to_string_lossy().trim_end_matches('/')
                == b.to_string_lossy().trim_end_matches('/')
    };
    let src_root = Checkpoint::locate(src)?.to_string();
    let src_parent = Path::new(&src_root)
        .parent()
        .unwrap_or(Path::new(&src_root));
    if same(out_root, src_parent) {
        return Err(EngineError::Invalid(format!(
            "checkpoint reshard: write to another directory than {} (it would replace the source)",
            src_parent.display()
        )));
    }
    let dest = Destination::claim(
        out_root,
        "checkpoint reshard",
        Writes::Checkpoint,
        overwrite,
    )?;
    let moments = ck.manifest.optimizer.step > 0;
    let mut manifest = ck.manifest.clone();
    manifest.tokenizer_source = ck.tokenizer();
    let written = write_layout(dest.dir(), manifest, layout, &|h| {
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
    })?;
    dest.publish(written)
}

/// Imports the Hugging Face model directory `hf_dir` as a step-0 checkpoint in `layout` under
/// `out_root` (fresh optimizer: no moments stored). The model is read one tensor at a time.
pub fn import_hf(
    hf_dir: &Path,
    layout: &Layout,
    out_root: &Path,
    overwrite: bool,
) -> Result<PathBuf> {
    let model = Location::parse(&hf_dir.to_string_lossy())?;
    model.check_reachable()?;
    let cfg = hf::read_config_at(&model)?;
    let weights = hf::WeightReader::open_at(&model)?;
    weights.check(&cfg)?;
    let dest = Destination::claim(out_root, "checkpoint import", Writes::Checkpoint, overwrite)?;
    // The tokenizer is copied into the checkpoint from a local file (an object store's, fetched
    // into the stage first).
    let tokenizer = match (&model, model.join(TOKENIZER).is_file()?) {
        (_, false) => None,
        (Location::Local(dir), true) => Some(dir.join(TOKENIZER)),
        (remote, true) => {
            let copy = dest.dir().join(".tokenizer.json");
            hf::write_atomic(
                &copy,
                &remote
                    .join(TOKENIZER)
                    .read(ferrotron_core::bounded::TOKENIZER)?,
            )?;
            Some(copy)
        }
    };
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
        source: Some(model.to_string()),
        files: Vec::new(),
        tensors: Vec::new(),
        tokenizer: None,
        tokenizer_source: tokenizer.clone(),
        lora: None,
        base_model: None,
        quantize_base: None,
        checksum: None,
    };
    let specs = cfg.param_specs();
    // The cut is the slice's alone: any shard object makes it.
    let cutter = TpShard::new(&cfg, 1, 0, false)?;
    let written = write_layout(dest.dir(), manifest, layout, &|h| {
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
    })?;
    if let Some(t) = tokenizer.filter(|t| t.starts_with(dest.dir())) {
        let _ = std::fs::remove_file(t);
    }
    dest.publish(written)
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
    let dest = Destination::claim(out, "checkpoint export", Writes::Model, overwrite)?;
    let out_dir = dest.dir().to_path_buf();
    let out = out_dir.as_path();
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
    hf::write_config(out, cfg, dtype)?;
    dest.publish(out_dir.clone()).map(|_| ())
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
    let dest = Destination::claim(out, "checkpoint export", Writes::Model, overwrite)?;
    adapters.save_peft(
        dest.dir(),
        &ck.manifest.model,
        ck.manifest.base_model.as_deref(),
    )?;
    let written = dest.dir().to_path_buf();
    dest.publish(written).map(|_| ())
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
    let dest = Destination::claim(out, "checkpoint export", Writes::Model, overwrite)?;
    let out_dir = dest.dir().to_path_buf();
    let out = out_dir.as_path();
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
    dest.publish(out_dir.clone()).map(|_| ())
}

/// A person's summary of the checkpoint at `path`, after verifying every file's checksum.
pub fn inspect(path: &Path) -> Result<String> {
    let ck = Checkpoint::open(path)?;
    ck.verify_all()?;
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

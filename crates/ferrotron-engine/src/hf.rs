//! Hugging Face model directories: `config.json` + `model.safetensors` (or a sharded
//! `model.safetensors.index.json`), read by parameter name in f32, bf16 or f16, and written back in a
//! form transformers loads.

use crate::error::{EngineError, Result};
use crate::parallel::weights::{Runs, WeightSource};
use crate::storage::Location;
use crate::transformer::ParamStore;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::model::ParamSpec;
use ferrotron_core::precision::BaseQuantization;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Tensors by name: (shape, values).
pub type NamedTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

pub use ferrotron_core::precision::StorageDtype;

/// Buffers a model directory carries that are not parameters; skipped on load.
fn is_known_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") && !name.contains("c_attn")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    read_config_at(&Location::Local(dir.to_path_buf()))
}

/// The `config.json` of the model directory (or object-store prefix) `model`.
pub fn read_config_at(model: &Location) -> Result<ModelConfig> {
    let file = model.join("config.json");
    let bytes = file.read(ferrotron_core::bounded::SETTINGS)?;
    let text = String::from_utf8(bytes)
        .map_err(|_| EngineError::format(file.as_error_path(), "not UTF-8 text"))?;
    Ok(ModelConfig::from_hf_json(&text, &file.as_error_path())?)
}

/// Loads config and weights of a Hugging Face model directory.
pub fn load_model(dir: &Path) -> Result<(ModelConfig, ParamStore)> {
    let cfg = read_config(dir)?;
    let params = load_params(dir, &cfg)?;
    Ok((cfg, params))
}

/// The safetensors files of a model directory or prefix, single-file or sharded.
fn weight_files(model: &Location) -> Result<Vec<Location>> {
    let single = model.join("model.safetensors");
    if single.exists()? {
        return Ok(vec![single]);
    }
    let index = model.join("model.safetensors.index.json");
    let Some(bytes) = index.try_read(ferrotron_core::bounded::SETTINGS)? else {
        return Err(EngineError::format(
            model.as_error_path(),
            "no model.safetensors or model.safetensors.index.json",
        ));
    };
    let index_path = index.as_error_path();
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::format(&index_path, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| {
            EngineError::format(
                &index_path,
                "field `weight_map` is missing or not an object",
            )
        })?;
    let mut names: Vec<&str> = map
        .values()
        .map(|f| {
            f.as_str().ok_or_else(|| {
                EngineError::format(&index_path, "field `weight_map` has a non-string file name")
            })
        })
        .collect::<Result<_>>()?;
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(EngineError::format(
            &index_path,
            "field `weight_map` names no tensor: the index lists no weight file",
        ));
    }
    names
        .into_iter()
        .map(|name| match model {
            Location::Local(dir) => {
                crate::paths::contained(dir, name, &index_path).map(Location::Local)
            }
            Location::S3(_) => {
                crate::paths::plain_name(name, &index_path)?;
                Ok(model.join(name))
            }
        })
        .collect()
}

/// Converts a stored tensor to f32 (exactly: bf16 and f16 values are representable in f32).
fn to_f32(view: &TensorView, file: &Path, name: &str) -> Result<Vec<f32>> {
    decode_weight(view.dtype(), view.data(), file, name)
}

/// A weight's values as f32; a NaN or an infinity among them is refused, naming the tensor (it
/// would make every step's loss NaN, and the run would save a NaN model).
fn decode_weight(dtype: Dtype, d: &[u8], file: &Path, name: &str) -> Result<Vec<f32>> {
    let values = decode_f32(dtype, d, file, name)?;
    check_finite(&values, 0, file, name)?;
    Ok(values)
}

/// Refuses a non-finite weight (`values` start at flat index `at` of tensor `name`).
fn check_finite(values: &[f32], at: usize, file: &Path, name: &str) -> Result<()> {
    match values.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(EngineError::format(
            file,
            format!(
                "tensor `{name}` holds a non-finite value ({} at flat index {}): the weights are damaged; use an intact copy",
                values[i],
                at + i
            ),
        )),
        None => Ok(()),
    }
}

/// Little-endian values of `dtype` as f32 (exact for bf16 and f16).
pub fn decode_f32(dtype: Dtype, d: &[u8], file: &Path, name: &str) -> Result<Vec<f32>> {
    let width = (dtype.bitsize() / 8).max(1);
    let mut out = vec![0f32; d.len() / width];
    decode_into(dtype, d, &mut out, file, name)?;
    Ok(out)
}

/// Little-endian values of `dtype` into `out`, as f32 (exact for bf16 and f16).
fn decode_into(dtype: Dtype, d: &[u8], out: &mut [f32], file: &Path, name: &str) -> Result<()> {
    match dtype {
        Dtype::F32 => {
            for (x, b) in out.iter_mut().zip(d.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::BF16 => {
            for (x, b) in out.iter_mut().zip(d.chunks_exact(2)) {
                *x = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Dtype::F16 => {
            for (x, b) in out.iter_mut().zip(d.chunks_exact(2)) {
                *x = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Dtype::F64 => {
            for (x, b) in out.iter_mut().zip(d.chunks_exact(8)) {
                *x = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32;
            }
        }
        other => {
            return Err(EngineError::format(
                file,
                format!("tensor `{name}` has unsupported dtype {other:?}"),
            ))
        }
    }
    Ok(())
}

/// One array of a safetensors file: its dtype, shape and where its bytes are in the file.
#[derive(Debug, Clone)]
pub struct ArrayInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: std::ops::Range<usize>,
}

/// Every array of the safetensors file `file`, whose whole content is `bytes` (typically mapped),
/// by name; the header is parsed once, no data is read.
pub fn array_index(file: &Path, bytes: &[u8]) -> Result<BTreeMap<String, ArrayInfo>> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::format(file, format!("not a valid safetensors file: {e}")))?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            // The view borrows from `bytes`: its offset there is the array's place in the file.
            let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
            let info = ArrayInfo {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                bytes: start..start + view.data().len(),
            };
            (name, info)
        })
        .collect())
}

/// Maps `file` into memory.
pub fn map_file(file: &Path) -> Result<memmap2::Mmap> {
    // A regular file only: mapping a device or a FIFO would never end well.
    let (f, _) =
        ferrotron_core::bounded::open(file, u64::MAX).map_err(|e| EngineError::io(file, e))?;
    // SAFETY: model and checkpoint files are read-only inputs (a checkpoint save writes a new
    // directory and renames it; nothing here writes a mapped file).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| EngineError::io(file, e))
}

/// Reads every tensor of one safetensors file as f32, by name, with its shape.
pub fn read_tensors_f32(file: &Path) -> Result<NamedTensors> {
    let bytes = std::fs::read(file).map_err(|e| EngineError::io(file, e))?;
    tensors_f32(&bytes, file)
}

/// [`read_tensors_f32`] of a file on disk or on an object store.
pub fn read_tensors_f32_at(file: &Location) -> Result<NamedTensors> {
    tensors_f32(&file.read(u64::MAX)?, &file.as_error_path())
}

/// Every tensor of the safetensors file `file`, whose content is `bytes`, as f32.
fn tensors_f32(bytes: &[u8], file: &Path) -> Result<NamedTensors> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::format(file, format!("not a valid safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = to_f32(&view, file, &name)?;
        out.insert(name, (view.shape().to_vec(), data));
    }
    Ok(out)
}

/// A model's weights where they are (a local directory or an object-store prefix): the headers
/// are read once; a tensor, or the rows and columns of it a device keeps, is read only when asked
/// for, so a reader holds one tensor at a time and a device reads only its slice.
pub struct WeightReader {
    files: Vec<WeightFile>,
    /// Tensor name → the file holding it and where.
    index: BTreeMap<String, (usize, ArrayInfo)>,
    /// Bytes of the files' headers (read by every reader).
    pub header_bytes: u64,
}

/// One safetensors file of a model, kept open.
struct WeightFile {
    location: Location,
    /// A local file, open (read at offsets by any thread).
    local: Option<std::fs::File>,
}

impl WeightFile {
    fn read_at(&self, range: std::ops::Range<u64>) -> Result<Vec<u8>> {
        match &self.local {
            Some(f) => {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; (range.end - range.start) as usize];
                f.read_exact_at(&mut buf, range.start)
                    .map_err(|e| EngineError::io(self.location.as_error_path(), e))?;
                Ok(buf)
            }
            None => self.location.read_range(range),
        }
    }
}

/// The header of the safetensors file `file`: its arrays by name, placed in the file.
fn read_header(file: &WeightFile) -> Result<(BTreeMap<String, ArrayInfo>, u64)> {
    let path = file.location.as_error_path();
    let bad = |e: String| EngineError::format(&path, format!("not a valid safetensors file: {e}"));
    let size = match &file.local {
        Some(f) => f.metadata().map_err(|e| EngineError::io(&path, e))?.len(),
        None => file
            .location
            .size()?
            .ok_or_else(|| EngineError::format(&path, "missing"))?,
    };
    if size < 8 {
        return Err(bad(format!("{size} bytes, shorter than a header")));
    }
    let n = u64::from_le_bytes(file.read_at(0..8)?.try_into().expect("8 bytes"));
    if n > size - 8 {
        return Err(bad(format!("a header of {n} bytes in a file of {size}")));
    }
    // Parsing checks the arrays follow each other, each of the size its dtype and shape make;
    // the file's length is checked against their end below.
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&file.read_at(8..8 + n)?).map_err(|e| bad(e.to_string()))?;
    let start = 8 + n as usize;
    let mut index = BTreeMap::new();
    let mut end = start;
    for (name, info) in metadata.tensors() {
        let (a, b) = info.data_offsets;
        end = end.max(start + b);
        let info = ArrayInfo {
            dtype: info.dtype,
            shape: info.shape.clone(),
            bytes: start + a..start + b,
        };
        index.insert(name, info);
    }
    if end as u64 != size {
        return Err(bad(format!(
            "its header places data up to byte {end}, the file has {size} bytes (truncated or damaged)"
        )));
    }
    Ok((index, 8 + n))
}

impl WeightReader {
    /// Reads the headers of the model at `model` (its weights stay where they are).
    pub fn open_at(model: &Location) -> Result<Self> {
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        let mut header_bytes = 0;
        for (k, location) in weight_files(model)?.into_iter().enumerate() {
            let local = match &location {
                Location::Local(p) => Some(
                    ferrotron_core::bounded::open(p, u64::MAX)
                        .map_err(|e| EngineError::io(p, e))?
                        .0,
                ),
                Location::S3(_) => None,
            };
            let file = WeightFile { location, local };
            let (arrays, head) = read_header(&file)?;
            header_bytes += head;
            for (name, info) in arrays {
                index.insert(name, (k, info));
            }
            files.push(file);
        }
        Ok(Self {
            files,
            index,
            header_bytes,
        })
    }

    fn file_path(&self, k: usize) -> PathBuf {
        self.files[k].location.as_error_path()
    }

    /// Checks that the directory holds every parameter of `cfg` with its shape, and nothing that
    /// is not one (known buffers and a tied model's `lm_head` aside).
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        // Counted before the tensors' list is built: a config declaring 10⁹ layers beside a small
        // file is refused here, not after gigabytes of names.
        let with_layers = |n| {
            ModelConfig {
                num_layers: n,
                ..cfg.clone()
            }
            .param_specs()
            .len()
        };
        let per_layer = with_layers(1).saturating_sub(with_layers(0));
        let declared = with_layers(0).saturating_add(per_layer.saturating_mul(cfg.num_layers));
        // More than a whole layer beyond what the file holds: the config is another model's (a
        // tensor or two fewer is named below, tensor by tensor).
        if declared > self.index.len().saturating_add(per_layer) {
            return Err(EngineError::format(
                self.file_path(0),
                format!(
                    "holds {} tensors, but config.json's {} layers need {declared}: the config and the weights are not one model",
                    self.index.len(),
                    cfg.num_layers
                ),
            ));
        }
        let specs = cfg.param_specs();
        for (name, (k, info)) in &self.index {
            let (file, shape) = (self.file_path(*k), &info.shape);
            let Some(spec) = specs.iter().find(|s| &s.name == name) else {
                if name == "lm_head.weight" && cfg.tie_word_embeddings {
                    self.check_tied_head(cfg, &file)?;
                    continue;
                }
                if is_known_buffer(name) {
                    continue;
                }
                return Err(EngineError::format(
                    &file,
                    format!(
                        "tensor `{name}` is not a parameter of this {:?} model",
                        cfg.arch
                    ),
                ));
            };
            if *shape != spec.shape {
                return Err(EngineError::Shape {
                    file,
                    name: name.clone(),
                    expected: spec.shape.clone(),
                    found: shape.clone(),
                });
            }
        }
        if let Some(missing) = specs.iter().find(|s| !self.index.contains_key(&s.name)) {
            return Err(EngineError::MissingTensor {
                file: self.file_path(0),
                name: missing.name.clone(),
            });
        }
        Ok(())
    }

    /// A file with `lm_head.weight` beside `tie_word_embeddings: true`: the model uses the
    /// embedding as its head, so the head must be the embedding (as tied models save it), or it
    /// would be dropped without a word.
    fn check_tied_head(&self, cfg: &ModelConfig, file: &Path) -> Result<()> {
        let embedding = cfg.embedding_name();
        if self.index.contains_key(embedding)
            && self.read("lm_head.weight")? != self.read(embedding)?
        {
            return Err(EngineError::format(
                file,
                format!(
                    "tensor `lm_head.weight` differs from `{embedding}`, but config.json says `tie_word_embeddings: true`, so the head would be dropped and the embedding used in its place; set `tie_word_embeddings` to false to keep it"
                ),
            ));
        }
        Ok(())
    }

    /// Tensor `name`, converted to f32.
    pub fn read(&self, name: &str) -> Result<Vec<f32>> {
        let info = &self.info(name)?.1;
        let numel = info.shape.iter().product::<usize>().max(1);
        Ok(self.read_rows(name, &[(0..numel, 0)])?.0)
    }

    fn info(&self, name: &str) -> Result<&(usize, ArrayInfo)> {
        self.index
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor {
                file: self.file_path(0),
                name: name.to_string(),
            })
    }

    /// The elements `runs` of tensor `name` (each a range of flat indices, followed by that many
    /// zeros of padding), concatenated, as f32; and the bytes read. Adjacent runs are read in one
    /// request.
    pub fn read_rows(&self, name: &str, runs: &Runs) -> Result<(Vec<f32>, u64)> {
        let (k, info) = self.info(name)?;
        let file = &self.files[*k];
        let width = info.dtype.bitsize() / 8;
        // Requests: the longest stretches of runs that follow each other in the file with no
        // padding between them (bytes, the first element, elements, padding after).
        let mut requests = Vec::new();
        let mut i = 0;
        while i < runs.len() {
            let mut j = i;
            while j + 1 < runs.len() && runs[j].1 == 0 && runs[j + 1].0.start == runs[j].0.end {
                j += 1;
            }
            let (first, last) = (runs[i].0.start, runs[j].0.end);
            let at = (info.bytes.start + first * width) as u64;
            let bytes = at..at + ((last - first) * width) as u64;
            requests.push((bytes, first, last - first, runs[j].1));
            i = j + 1;
        }
        // Each request's values go straight to their place in the shard (the padding stays zero):
        // a reader holds the shard and one request's bytes, never a second copy.
        let total = requests.iter().map(|r| r.2 + r.3).sum();
        let mut out = vec![0f32; total];
        let mut places = Vec::with_capacity(requests.len());
        let mut rest = out.as_mut_slice();
        for r in &requests {
            let (mine, after) = rest.split_at_mut(r.2 + r.3);
            places.push((r, &mut mine[..r.2]));
            rest = after;
        }
        let path = file.location.as_error_path();
        let fetch = |(r, dst): &mut (&(std::ops::Range<u64>, usize, usize, usize), &mut [f32])| {
            match (&file.local, info.dtype) {
                // f32 on disk: read into place, no byte buffer beside it.
                (Some(f), Dtype::F32) => {
                    use std::os::unix::fs::FileExt;
                    // SAFETY: any 4 bytes are a valid f32; the view covers exactly `dst`.
                    let raw = unsafe {
                        std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), dst.len() * 4)
                    };
                    f.read_exact_at(raw, r.0.start)
                        .map_err(|e| EngineError::io(&path, e))?;
                    for x in dst.iter_mut() {
                        *x = f32::from_bits(u32::from_le(x.to_bits()));
                    }
                }
                _ => {
                    let bytes = file.read_at(r.0.clone())?;
                    decode_into(info.dtype, &bytes, dst, &path, name)?;
                }
            }
            check_finite(dst, r.1, &path, name)
        };
        // A column cut is one request per row: on an object store, where each request waits a
        // round trip, they go several at a time (the HTTP agent keeps a connection per worker).
        if file.local.is_none() && places.len() > 1 {
            let per = places.len().div_ceil(REQUESTS_IN_FLIGHT);
            std::thread::scope(|scope| {
                let workers: Vec<_> = places
                    .chunks_mut(per)
                    .map(|chunk| scope.spawn(|| chunk.iter_mut().try_for_each(fetch)))
                    .collect();
                workers
                    .into_iter()
                    .try_for_each(|w| w.join().expect("a reading thread panicked"))
            })?;
        } else {
            places.iter_mut().try_for_each(fetch)?;
        }
        let read = requests.iter().map(|r| r.0.end - r.0.start).sum();
        Ok((out, read))
    }
}

/// Requests to an object store a reader keeps in flight at once.
const REQUESTS_IN_FLIGHT: usize = 16;

/// A model's parameters where they are stored, checked against its configuration: each device
/// reads the rows and columns of its shard ([`WeightSource`]), nothing more.
pub struct ModelWeights {
    reader: WeightReader,
    specs: Vec<ParamSpec>,
}

impl ModelWeights {
    /// The weights of `cfg` at `model`: every header read and checked, no tensor yet.
    pub fn open(model: &Location, cfg: &ModelConfig) -> Result<Self> {
        let reader = WeightReader::open_at(model)?;
        reader.check(cfg)?;
        Ok(Self {
            reader,
            specs: cfg.param_specs(),
        })
    }

    /// Every tensor, whole, with (QLoRA) the projections quantized as they are read: one tensor
    /// is in f32 at a time, never the whole model.
    pub fn load(
        &self,
        cfg: &ModelConfig,
        quantize: Option<BaseQuantization>,
    ) -> Result<ParamStore> {
        let specs = self.specs.clone();
        let mut store = ParamStore::from_tensors(specs.clone(), vec![Vec::new(); specs.len()]);
        for (i, s) in specs.iter().enumerate() {
            store.tensors[i] = self.reader.read(&s.name)?;
            if let Some(BaseQuantization::Nf4) = quantize {
                store.quantize_tensor_nf4(cfg, i);
            }
        }
        Ok(store)
    }
}

impl WeightSource for ModelWeights {
    fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn read_runs(&self, i: usize, runs: &Runs) -> Result<(Vec<f32>, u64)> {
        self.reader.read_rows(&self.specs[i].name, runs)
    }

    fn fixed_bytes(&self) -> u64 {
        self.reader.header_bytes
    }
}

/// Reads the model's parameters by Hugging Face name, checking every shape.
pub fn load_params(dir: &Path, cfg: &ModelConfig) -> Result<ParamStore> {
    load_params_as(&Location::Local(dir.to_path_buf()), cfg, None)
}

/// [`load_params`], with (QLoRA) the projections quantized as they are read
/// ([`ModelWeights::load`]).
pub fn load_params_as(
    model: &Location,
    cfg: &ModelConfig,
    quantize: Option<BaseQuantization>,
) -> Result<ParamStore> {
    ModelWeights::open(model, cfg)?.load(cfg, quantize)
}

/// `data` in `dtype`, as little-endian bytes.
pub fn encode(data: &[f32], dtype: StorageDtype) -> (Dtype, Vec<u8>) {
    match dtype {
        StorageDtype::F32 => (
            Dtype::F32,
            data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        StorageDtype::Bf16 => (
            Dtype::BF16,
            data.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        StorageDtype::F16 => (
            Dtype::F16,
            data.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        ),
    }
}

/// Writes `tensors` (name, shape, values) as one safetensors file, atomically (temp file + rename).
pub fn write_tensors(
    file: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    dtype: StorageDtype,
) -> Result<()> {
    let encoded: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            let (dt, bytes) = encode(d, dtype);
            (n.clone(), s.clone(), dt, bytes)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(n, s, dt, b)| {
            TensorView::new(*dt, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| EngineError::format(file, format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let bytes = safetensors::serialize(views, meta)
        .map_err(|e| EngineError::format(file, e.to_string()))?;
    write_atomic(file, &bytes)
}

pub use crate::storage::write_atomic;

/// Writes a Hugging Face model directory: `config.json` and `model.safetensors`.
pub fn save_model(
    dir: &Path,
    cfg: &ModelConfig,
    params: &ParamStore,
    dtype: StorageDtype,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let tensors: Vec<(String, Vec<usize>, &[f32])> = params
        .specs
        .iter()
        .zip(&params.tensors)
        .map(|(s, t)| (s.name.clone(), s.shape.clone(), t.as_slice()))
        .collect();
    write_tensors(&dir.join("model.safetensors"), &tensors, dtype)?;
    write_config(dir, cfg, dtype)
}

/// Writes a model directory's `config.json`, its `torch_dtype` saying how the weights are stored.
pub fn write_config(dir: &Path, cfg: &ModelConfig, dtype: StorageDtype) -> Result<()> {
    let mut config = cfg.to_hf_json();
    config["torch_dtype"] = serde_json::json!(match dtype {
        StorageDtype::F32 => "float32",
        StorageDtype::Bf16 => "bfloat16",
        StorageDtype::F16 => "float16",
    });
    let text = serde_json::to_string_pretty(&config).expect("config serialises");
    write_atomic(&dir.join("config.json"), text.as_bytes())
}

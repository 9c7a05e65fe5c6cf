//! Opening a checkpoint: the manifest parsed and checked against the files (each present, of the
//! size and SHA-256 the manifest records, holding every array the manifest names), then slices read
//! from the memory-mapped files — only the bytes a reader asks for are touched.

use super::order::{CutMajor, StoredOrder};
use super::slice::{overlap_spans, whole};
use super::{Kind, Manifest, TensorEntry, FORMAT, LATEST, MANIFEST, VERSION};
use crate::error::{EngineError, Result};
use crate::hf::{array_index, map_file, ArrayInfo};
use crate::parallel::tensor::Slice;
use crate::transformer::ParamStore;
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::model::ModelConfig;
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// An opened, verified checkpoint.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Each rank file: mapped, or on an object store (its arrays read by range, each verified).
    files: HashMap<String, RankData>,
    /// Each rank file's arrays: byte range and element count, by key.
    index: HashMap<String, ArrayIndex>,
    /// What it holds (the model's parameters, or with LoRA its adapters), in store order.
    specs: Vec<ferrotron_core::model::ParamSpec>,
    /// The tokenizer's copy, checked (on an object store: fetched into the cache).
    tokenizer: Option<PathBuf>,
}

type ArrayIndex = std::collections::BTreeMap<String, ArrayInfo>;

/// Where a rank file's bytes are.
enum RankData {
    /// A local file, mapped (verified whole when opened).
    Mapped(Mmap),
    /// An object on a store, its header verified; each array is read by range and checked against
    /// the SHA-256 its header records.
    Remote {
        at: crate::storage::Location,
        sha256: HashMap<String, String>,
    },
}

/// A rank file's arrays, which must all be f32.
fn f32_arrays(file: &Path, bytes: &[u8]) -> Result<ArrayIndex> {
    let index = array_index(file, bytes)?;
    if let Some((name, a)) = index.iter().find(|(_, a)| a.dtype != Dtype::F32) {
        return Err(EngineError::format(
            file,
            format!("array `{name}` is {:?}; checkpoints hold f32", a.dtype),
        ));
    }
    Ok(index)
}

/// Whether a piece describes a real part of a tensor of `shape`: its cut dimension exists, its
/// ranges lie inside it, its shard shape is what the ranges and padding make, and its flat range
/// lies inside the shard.
fn check_piece(shape: &[usize], p: &super::Piece) -> std::result::Result<(), String> {
    let s = &p.tp_slice;
    let Some(&len) = shape.get(s.dim) else {
        return Err(format!(
            "cut along dimension {} of a {}-d tensor",
            s.dim,
            shape.len()
        ));
    };
    if let Some(r) = s.ranges.iter().find(|r| r[0] > r[1] || r[1] > len) {
        return Err(format!("range {}..{} outside 0..{len}", r[0], r[1]));
    }
    let mut shard = shape.to_vec();
    shard[s.dim] = s.ranges.iter().map(|r| r[1] - r[0]).sum::<usize>() + s.pad;
    if shard != p.shard_shape {
        return Err(format!(
            "shard shape {:?}, but its ranges and padding make {shard:?}",
            p.shard_shape
        ));
    }
    let numel: usize = shard.iter().product();
    if p.flat[0] > p.flat[1] || p.flat[1] > numel {
        return Err(format!(
            "flat range {}..{} outside the shard's {numel} elements",
            p.flat[0], p.flat[1]
        ));
    }
    Ok(())
}

/// The manifest at `mpath`, parsed and checked on its own: its format, its model (validated like a
/// `config.json` before any size is computed from it), one file per rank, its model's tensors with
/// their shapes.
fn read_manifest(mpath: &Path) -> Result<Manifest> {
    let text = ferrotron_core::bounded::read_to_string(mpath, ferrotron_core::bounded::SETTINGS)
        .map_err(|e| EngineError::io(mpath, e))?;
    parse_manifest(&text, mpath)
}

/// [`read_manifest`] of the manifest's text (`mpath` names it in errors).
fn parse_manifest(text: &str, mpath: &Path) -> Result<Manifest> {
    let manifest: Manifest = serde_json::from_str(text)
        .map_err(|e| EngineError::format(mpath, format!("not a valid manifest: {e}")))?;
    match &manifest.checksum {
        Some(sum) if *sum != manifest.digest() => {
            return Err(EngineError::format(
                mpath,
                "its checksum does not match its content: it was edited or damaged after it was written (a changed `step` or data position would skip or repeat data); use another checkpoint",
            ))
        }
        Some(_) => {}
        None => eprintln!(
            "note: {} has no checksum of its own (written by a build before manifests were checksummed): its fields are taken as they are",
            mpath.display()
        ),
    }
    if manifest.format != FORMAT || manifest.version != VERSION {
        return Err(EngineError::format(
            mpath,
            format!(
                "format `{}` version {}; this build reads `{FORMAT}` version {VERSION}",
                manifest.format, manifest.version
            ),
        ));
    }
    // The model is data like the rest: checked before any size is computed from it.
    manifest.model.validate().map_err(|(field, msg)| {
        EngineError::format(mpath, format!("model field `{field}`: {msg}"))
    })?;
    if manifest.files.len() != manifest.world_size {
        return Err(EngineError::format(
            mpath,
            format!(
                "lists {} rank files for {} ranks",
                manifest.files.len(),
                manifest.world_size
            ),
        ));
    }
    if let Some(lora) = &manifest.lora {
        lora.validate(&manifest.model)
            .map_err(|e| EngineError::format(mpath, format!("field `lora`: {e}")))?;
    }
    // The tensor list is the manifest's own model's (or its adapters'), shape for shape.
    for spec in manifest.trained_specs() {
        match manifest.tensors.iter().find(|t| t.name == spec.name) {
            Some(t) if t.shape == spec.shape => {}
            Some(t) => {
                return Err(EngineError::format(
                    mpath,
                    format!(
                        "tensor `{}` has shape {:?}; its model has {:?}",
                        spec.name, t.shape, spec.shape
                    ),
                ))
            }
            None => {
                return Err(EngineError::format(
                    mpath,
                    format!("lists no tensor `{}` of its model", spec.name),
                ))
            }
        }
    }
    Ok(manifest)
}

impl Checkpoint {
    /// The checkpoint directory `path` names: itself when it holds a manifest, or the one its
    /// `latest` file points to.
    pub fn resolve(path: &Path) -> Result<PathBuf> {
        if path.join(MANIFEST).exists() {
            return Ok(path.to_path_buf());
        }
        let latest = path.join(LATEST);
        if latest.exists() {
            let name = std::fs::read_to_string(&latest).map_err(|e| EngineError::io(&latest, e))?;
            let dir = crate::paths::contained(path, name.trim(), &latest)?;
            if !dir.join(MANIFEST).exists() {
                return Err(EngineError::format(
                    &latest,
                    format!("points to `{}`, which holds no {MANIFEST}", name.trim()),
                ));
            }
            return Ok(dir);
        }
        Err(EngineError::format(
            path,
            format!("not a checkpoint: no {MANIFEST} and no `{LATEST}` file"),
        ))
    }

    /// [`Checkpoint::resolve`] for a local directory or an `s3://` prefix: where the checkpoint
    /// `path` names is, without reading it.
    pub fn locate(path: &Path) -> Result<crate::storage::Location> {
        use crate::storage::Location;
        match Location::parse(&path.to_string_lossy())? {
            Location::Local(p) => Ok(Location::Local(Self::resolve(&p)?)),
            remote => Ok(super::remote::resolve(&remote)?.0),
        }
    }

    /// Opens and verifies the checkpoint at `path` (a checkpoint directory, or a directory of them
    /// with a `latest` file). Every file is hashed; nothing is trusted that does not check out.
    pub fn open(path: &Path) -> Result<Self> {
        // On an object store: downloaded into the cache, then checked like any local one.
        let spec = path.to_string_lossy();
        if crate::storage::is_remote(&spec) {
            return Self::open_remote(&crate::storage::Location::parse(&spec)?);
        }
        let dir = Self::resolve(path)?;
        let mpath = dir.join(MANIFEST);
        let manifest = read_manifest(&mpath)?;
        let mut files = HashMap::new();
        let mut index = HashMap::new();
        for f in &manifest.files {
            let path = crate::paths::contained(&dir, &f.file, &mpath)?;
            if !path.exists() {
                return Err(EngineError::format(
                    &path,
                    format!("rank {}'s file is missing (the manifest lists it)", f.rank),
                ));
            }
            let (bytes, sha) = super::files::sha256_file(&path)?;
            if bytes != f.bytes || sha != f.sha256 {
                return Err(EngineError::format(
                    &path,
                    format!(
                        "checksum mismatch: {bytes} bytes with SHA-256 {sha}, the manifest \
                         records {} bytes with {} — the file is corrupt",
                        f.bytes, f.sha256
                    ),
                ));
            }
            let map = map_file(&path)?;
            index.insert(f.file.clone(), f32_arrays(&path, &map)?);
            files.insert(f.file.clone(), RankData::Mapped(map));
        }
        if let Some(t) = &manifest.tokenizer {
            let path = crate::paths::contained(&dir, &t.file, &mpath)?;
            let (bytes, sha) = super::files::sha256_file(&path)?;
            if bytes != t.bytes || sha != t.sha256 {
                return Err(EngineError::format(
                    &path,
                    "checksum mismatch with the manifest: the tokenizer copy is corrupt",
                ));
            }
        }
        check_pieces(&manifest, &index, &mpath, &dir)?;
        let specs = manifest.trained_specs();
        let tokenizer = manifest.tokenizer.as_ref().map(|t| dir.join(&t.file));
        Ok(Self {
            dir,
            manifest,
            files,
            index,
            specs,
            tokenizer,
        })
    }

    /// Opens the checkpoint an `s3://` prefix names. With each file's header hash in the manifest,
    /// nothing but the headers is read now, each checked; every array read later is checked against
    /// its own hash — a device reads only its arrays. Older checkpoints are downloaded whole into
    /// the cache and checked like local ones. Either way the tokenizer is fetched and checked.
    fn open_remote(root: &crate::storage::Location) -> Result<Self> {
        let cache = ferrotron_core::topology::cache_dir().join("checkpoints");
        let (dir, name) = super::remote::resolve(root)?;
        let mpath = dir.join(MANIFEST).as_error_path();
        let text = String::from_utf8(dir.join(MANIFEST).read(ferrotron_core::bounded::SETTINGS)?)
            .map_err(|_| EngineError::format(&mpath, "not UTF-8 text"))?;
        let manifest = parse_manifest(&text, &mpath)?;
        if manifest.files.iter().any(|f| f.header_sha256.is_none()) {
            return Self::open(&super::remote::fetch(root, &cache)?);
        }
        let mut files = HashMap::new();
        let mut index = HashMap::new();
        for f in &manifest.files {
            crate::paths::plain_name(&f.file, &mpath)?;
            let at = dir.join(&f.file);
            let (arrays, sha256) = remote_header(&at, f)?;
            index.insert(f.file.clone(), arrays);
            files.insert(f.file.clone(), RankData::Remote { at, sha256 });
        }
        let err_dir = PathBuf::from(dir.to_string());
        check_pieces(&manifest, &index, &mpath, &err_dir)?;
        let tokenizer = match &manifest.tokenizer {
            Some(t) => {
                crate::paths::plain_name(&t.file, &mpath)?;
                let local = cache.join(super::remote::cache_name(&dir)).join(&name);
                std::fs::create_dir_all(&local).map_err(|e| EngineError::io(&local, e))?;
                let copy = local.join(&t.file);
                crate::hf::write_atomic(
                    &copy,
                    &dir.join(&t.file).read(ferrotron_core::bounded::TOKENIZER)?,
                )?;
                let (bytes, sha) = super::files::sha256_file(&copy)?;
                if bytes != t.bytes || sha != t.sha256 {
                    return Err(EngineError::format(
                        dir.join(&t.file).as_error_path(),
                        "checksum mismatch with the manifest: the tokenizer copy is corrupt",
                    ));
                }
                Some(copy)
            }
            None => None,
        };
        let specs = manifest.trained_specs();
        Ok(Self {
            dir: err_dir,
            manifest,
            files,
            index,
            specs,
            tokenizer,
        })
    }

    /// Reads every array of every rank file once: on an object store each is checked against its
    /// SHA-256 (with the headers checked at open, every byte of every file is then verified); a
    /// local checkpoint was verified whole when opened.
    pub fn verify_all(&self) -> Result<()> {
        for (file, arrays) in &self.index {
            if let Some(RankData::Remote { .. }) = self.files.get(file) {
                for key in arrays.keys() {
                    let len = arrays[key].bytes.len();
                    self.array_bytes(file, key, std::slice::from_ref(&(0..len)))?;
                }
            }
        }
        Ok(())
    }

    /// The layout the checkpoint was written under.
    pub fn layout(&self) -> Result<Layout> {
        Ok(LayoutSpec::parse(&self.manifest.layout)?.layout)
    }

    /// Refuses a checkpoint of another model than `cfg`.
    pub fn check_model(&self, cfg: &ModelConfig) -> Result<()> {
        let m = &self.manifest.model;
        if m != cfg {
            return Err(EngineError::format(
                self.dir.join(MANIFEST),
                format!(
                    "a checkpoint of another model: it holds {}; this run's model is {}",
                    super::describe_model(m),
                    super::describe_model(cfg)
                ),
            ));
        }
        Ok(())
    }

    fn tensor(&self, name: &str) -> Result<&TensorEntry> {
        self.manifest
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| {
                EngineError::format(self.dir.join(MANIFEST), format!("lists no tensor `{name}`"))
            })
    }

    /// Part `flat` of the tensor-parallel shard `slice` of tensor `name`'s `kind`, assembled from
    /// whichever files hold it. Shard padding reads as zeros; fresh moments (optimizer step 0) too.
    pub fn read(
        &self,
        name: &str,
        kind: Kind,
        slice: &Slice,
        flat: Range<usize>,
    ) -> Result<Vec<f32>> {
        Ok(self.read_counted(name, kind, slice, flat)?.0)
    }

    /// [`Checkpoint::read`], and the bytes of the files it read.
    fn read_counted(
        &self,
        name: &str,
        kind: Kind,
        slice: &Slice,
        flat: Range<usize>,
    ) -> Result<(Vec<f32>, u64)> {
        let t = self.tensor(name)?;
        let mut out = vec![0f32; flat.len()];
        if kind != Kind::Param && self.manifest.optimizer.step == 0 {
            return Ok((out, 0));
        }
        let mut read = 0u64;
        let mut covered = vec![false; flat.len()];
        for p in t.pieces.iter().filter(|p| p.kind == kind) {
            let src = Slice::from(&p.tp_slice);
            let spans = overlap_spans(&t.shape, &src, p.flat[0]..p.flat[1], slice, flat.clone())?;
            if spans.is_empty() {
                continue;
            }
            // A mapped file is touched only where the spans are; an array on a store is fetched
            // by the hash blocks the spans touch (each checked). A cut-major array holds each
            // wanted index of the cut in one stored range: those are read, then put back in the
            // shard's row-major order.
            let (bytes, fetched) = match p.order {
                StoredOrder::RowMajor => {
                    let wanted: Vec<Range<usize>> = spans
                        .iter()
                        .map(|&(so, _, n)| 4 * so..4 * (so + n))
                        .collect();
                    self.array_bytes(&p.file, &p.key, &wanted)?
                }
                StoredOrder::CutMajor => {
                    let order = CutMajor::new(&p.shard_shape, src.dim, p.flat[0]..p.flat[1]);
                    let need = order.touched(spans.iter().map(|&(so, _, n)| (so, n)));
                    let wanted: Vec<Range<usize>> = order
                        .stored_ranges(&need)
                        .into_iter()
                        .map(|r| 4 * r.start..4 * r.end)
                        .collect();
                    let (stored, fetched) = self.array_bytes(&p.file, &p.key, &wanted)?;
                    (Cow::Owned(order.load_bytes(&stored, 4, &need)), fetched)
                }
            };
            read += fetched;
            for (so, to, n) in spans {
                for (x, b) in out[to..to + n]
                    .iter_mut()
                    .zip(bytes[4 * so..4 * (so + n)].chunks_exact(4))
                {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                covered[to..to + n].fill(true);
            }
        }
        // Every element of the wanted part that is not padding must have come from a file.
        for (_, to, n) in overlap_spans(
            &t.shape,
            &whole(&t.shape),
            0..t.shape.iter().product(),
            slice,
            flat.clone(),
        )? {
            if let Some(k) = covered[to..to + n].iter().position(|c| !c) {
                return Err(EngineError::format(
                    self.dir.join(MANIFEST),
                    format!(
                        "no file holds element {} of the wanted part of `{name}` ({}): the \
                         checkpoint is incomplete",
                        flat.start + to + k,
                        kind.name()
                    ),
                ));
            }
        }
        Ok((out, read))
    }

    /// The whole tensor `name`'s `kind`.
    pub fn read_whole(&self, name: &str, kind: Kind) -> Result<Vec<f32>> {
        let shape = self.tensor(name)?.shape.clone();
        self.read(name, kind, &whole(&shape), 0..shape.iter().product())
    }

    /// The model's parameters (with LoRA its adapters), whole, read one tensor at a time.
    pub fn params(&self) -> Result<ParamStore> {
        let specs = self.manifest.trained_specs();
        let tensors = specs
            .iter()
            .map(|s| self.read_whole(&s.name, Kind::Param))
            .collect::<Result<Vec<_>>>()?;
        Ok(ParamStore::from_tensors(specs, tensors))
    }

    /// The tokenizer saved with the checkpoint (verified by [`Checkpoint::open`]), if it has one.
    pub fn tokenizer(&self) -> Option<PathBuf> {
        self.tokenizer.clone()
    }

    /// The raw bytes of array `key` of `file` (both checked by [`Checkpoint::open`]), of which
    /// the byte ranges `wanted` are read (the rest of an array on a store is left zero); and the
    /// bytes read from storage for them. On a store the hash blocks `wanted` touch are fetched, each
    /// checked against the hash the file's header records.
    fn array_bytes(
        &self,
        file: &str,
        key: &str,
        wanted: &[Range<usize>],
    ) -> Result<(Cow<'_, [u8]>, u64)> {
        let missing =
            || EngineError::format(self.dir.join(file), format!("holds no array `{key}`"));
        let a = self
            .index
            .get(file)
            .and_then(|i| i.get(key))
            .ok_or_else(missing)?;
        match self.files.get(file).ok_or_else(missing)? {
            RankData::Mapped(map) => {
                let touched = wanted.iter().map(|r| r.len() as u64).sum();
                Ok((Cow::Borrowed(&map[a.bytes.clone()]), touched))
            }
            RankData::Remote { at, sha256 } => {
                let block = super::files::HASH_BLOCK_BYTES;
                let len = a.bytes.len();
                let hashes = sha256.get(key).ok_or_else(missing)?;
                let blocks = len.div_ceil(block).max(1);
                if hashes.len() != 64 * blocks {
                    return Err(EngineError::format(
                        at.as_error_path(),
                        format!("array `{key}`: its header records {} block hashes for {blocks} blocks — the file is corrupt", hashes.len() / 64),
                    ));
                }
                let mut need = vec![false; blocks];
                for r in wanted.iter().filter(|r| !r.is_empty()) {
                    need[r.start / block..=(r.end - 1) / block].fill(true);
                }
                let mut out = vec![0u8; len];
                let mut fetched = 0u64;
                let mut b = 0;
                while b < blocks {
                    if !need[b] {
                        b += 1;
                        continue;
                    }
                    // A run of needed blocks: one request.
                    let mut e = b;
                    while e + 1 < blocks && need[e + 1] {
                        e += 1;
                    }
                    let (lo, hi) = (b * block, ((e + 1) * block).min(len));
                    let bytes =
                        at.read_range((a.bytes.start + lo) as u64..(a.bytes.start + hi) as u64)?;
                    for (k, chunk) in bytes.chunks(block).enumerate() {
                        let i = b + k;
                        if super::files::sha256_hex(chunk) != hashes[64 * i..64 * (i + 1)] {
                            return Err(EngineError::format(
                                at.as_error_path(),
                                format!("array `{key}`: block {i} does not match the SHA-256 its header records — the file is corrupt"),
                            ));
                        }
                    }
                    out[lo..hi].copy_from_slice(&bytes);
                    fetched += bytes.len() as u64;
                    b = e + 1;
                }
                super::remote::pause_drill(key);
                Ok((Cow::Owned(out), fetched))
            }
        }
    }
}

/// A rank file on an object store: its header, read by range and checked against the manifest's
/// hash; its arrays (f32, of the size the manifest records for the file) and each one's SHA-256.
fn remote_header(
    at: &crate::storage::Location,
    f: &super::FileEntry,
) -> Result<(ArrayIndex, HashMap<String, String>)> {
    let path = at.as_error_path();
    let size = at.size()?.ok_or_else(|| {
        EngineError::format(
            &path,
            format!("rank {}'s file is missing (the manifest lists it)", f.rank),
        )
    })?;
    let corrupt = |why: String| EngineError::format(&path, format!("{why} — the file is corrupt"));
    if size != f.bytes || size < 8 {
        return Err(corrupt(format!(
            "{size} bytes, the manifest records {}",
            f.bytes
        )));
    }
    let n = u64::from_le_bytes(at.read_range(0..8)?.try_into().expect("8 bytes"));
    if n > size - 8 {
        return Err(corrupt(format!(
            "a header of {n} bytes in a file of {size}"
        )));
    }
    let mut head = at.read_range(0..8 + n)?;
    if Some(super::files::sha256_hex(&head)) != f.header_sha256 {
        return Err(corrupt(
            "its header does not match the manifest's SHA-256".into(),
        ));
    }
    let json = head.split_off(8);
    let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&json)
        .map_err(|e| corrupt(format!("not a valid safetensors header ({e})")))?;
    let start = 8 + n as usize;
    let mut arrays = ArrayIndex::new();
    for (name, info) in metadata.tensors() {
        if info.dtype != Dtype::F32 {
            return Err(EngineError::format(
                &path,
                format!("array `{name}` is {:?}; checkpoints hold f32", info.dtype),
            ));
        }
        let (a, b) = info.data_offsets;
        arrays.insert(
            name,
            ArrayInfo {
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: start + a..start + b,
            },
        );
    }
    if arrays.values().any(|a| a.bytes.end as u64 > size) {
        return Err(corrupt("its header places arrays beyond its end".into()));
    }
    let recorded = metadata.metadata().clone().unwrap_or_default();
    let mut sha256 = HashMap::new();
    for key in arrays.keys() {
        let Some(h) = recorded.get(&super::files::array_sha_key(key)) else {
            return Err(corrupt(format!(
                "its header records no SHA-256 of array `{key}`"
            )));
        };
        sha256.insert(key.clone(), h.clone());
    }
    Ok((arrays, sha256))
}

/// Every piece the manifest names is a real part of its tensor and lies in the rank file it names,
/// with the number of values it says.
fn check_pieces(
    manifest: &Manifest,
    index: &HashMap<String, ArrayIndex>,
    mpath: &Path,
    dir: &Path,
) -> Result<()> {
    for t in &manifest.tensors {
        for p in &t.pieces {
            if let Err(why) = check_piece(&t.shape, p) {
                return Err(EngineError::format(
                    mpath,
                    format!(
                        "tensor `{}`, piece `{}` in `{}`: {why}",
                        t.name, p.key, p.file
                    ),
                ));
            }
            let Some(arrays) = index.get(&p.file) else {
                return Err(EngineError::format(
                    mpath,
                    format!(
                        "tensor `{}` is said to be in `{}`, which is not one of the rank files",
                        t.name, p.file
                    ),
                ));
            };
            let want = p.flat[1].saturating_sub(p.flat[0]);
            match arrays.get(&p.key).map(|a| a.bytes.len() / 4) {
                Some(n) if n == want => {}
                Some(n) => {
                    return Err(EngineError::format(
                        dir.join(&p.file),
                        format!("array `{}` has {n} values; the manifest says {want}", p.key),
                    ))
                }
                None => {
                    return Err(EngineError::format(
                        dir.join(&p.file),
                        format!(
                            "holds no array `{}`, which the manifest names for tensor `{}`",
                            p.key, t.name
                        ),
                    ))
                }
            }
        }
    }
    Ok(())
}

/// A checkpoint as the source of a resumed run's parameters: each device reads its own shard of
/// them from the files (the slices intersected as [`Checkpoint::read`] does), no process the
/// whole model.
impl crate::parallel::WeightSource for Checkpoint {
    fn specs(&self) -> &[ferrotron_core::model::ParamSpec] {
        &self.specs
    }

    fn read_runs(
        &self,
        i: usize,
        runs: &crate::parallel::weights::Runs,
    ) -> Result<(Vec<f32>, u64)> {
        let name = &self.specs[i].name;
        let whole = self.read_whole(name, Kind::Param)?;
        let bytes = 4 * whole.len() as u64;
        let mut out = Vec::new();
        for (r, pad) in runs {
            out.extend_from_slice(&whole[r.clone()]);
            out.resize(out.len() + pad, 0.0);
        }
        Ok((out, bytes))
    }

    fn read_shard(&self, i: usize, slice: &Slice) -> Result<(Vec<f32>, u64)> {
        let spec = &self.specs[i];
        let numel = crate::parallel::TpShard::shard_shape(&spec.shape, slice)
            .iter()
            .product();
        self.read_counted(&spec.name, Kind::Param, slice, 0..numel)
    }
}

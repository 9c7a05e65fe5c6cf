//! Writing a checkpoint atomically. Every rank writes its file into a hidden staging directory,
//! syncs it and hashes what landed on disk; rank 0 checks that every file is there with the size its
//! writer reported, writes the manifest, renames the staging directory to `step-NNNNNN`, and only
//! then replaces `latest`. A crash at any point leaves the previous checkpoint and `latest` as they
//! were; a staging directory is never taken for a checkpoint (it has another name), and the next
//! save clears it.

pub use super::files::CRASH_ENV;
use super::files::{crash_at, crash_point, sha256_file};
use super::layout::{manifest_tensors, Holding};
use super::{
    rank_file_name, step_dir_name, AuxFile, FileEntry, Kind, Manifest, LATEST, MANIFEST, TOKENIZER,
};
use crate::comm::{Comm, Group, ReduceOp};
use crate::error::{EngineError, Result};
use crate::hf::write_atomic;
use crate::storage::Location;
use ferrotron_core::layout::LayoutSpec;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What one rank saves: each holding with its master values and (after the first optimizer step)
/// its two Adam moments, all over the holding's `flat` range.
pub struct RankArrays {
    pub holding: Holding,
    pub param: Vec<f32>,
    pub moments: Option<(Vec<f32>, Vec<f32>)>,
}

/// A rank file as written: its name, size and SHA-256.
#[derive(Debug, Clone, PartialEq)]
pub struct RankFile {
    pub rank: usize,
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
    /// SHA-256 of the file's header (its length and JSON), which holds each array's SHA-256: a
    /// reader of some arrays verifies them without the whole file.
    pub header_sha256: String,
}

/// An f32 array of a holding, put in its stored order and encoded only when the file writer asks
/// for it (one array at a time).
struct F32View<'a> {
    shape: Vec<usize>,
    holding: &'a Holding,
    data: &'a [f32],
}

impl F32View<'_> {
    fn bytes(&self) -> Vec<u8> {
        crate::hf::encode(
            &self.holding.stored(self.data),
            crate::hf::StorageDtype::F32,
        )
        .1
    }
}

impl View for &F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.bytes())
    }
    fn data_len(&self) -> usize {
        4 * self.data.len()
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| EngineError::io(dir, e))
}

/// The staging directory of step `step`'s checkpoint under `root`.
fn staging_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!(".{}.partial", step_dir_name(step)))
}

/// Creates an empty staging directory for step `step` (rank 0, before any rank writes), clearing
/// what earlier crashed saves left.
pub fn prepare_staging(root: &Path, step: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(|e| EngineError::io(root, e))?;
    for entry in std::fs::read_dir(root).map_err(|e| EngineError::io(root, e))? {
        let path = entry.map_err(|e| EngineError::io(root, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(".step-") && (name.ends_with(".partial") || name.contains(".old-")) {
            std::fs::remove_dir_all(&path).map_err(|e| EngineError::io(&path, e))?;
        } else if name.starts_with(&format!(".{LATEST}.")) && name.ends_with(".tmp") {
            std::fs::remove_file(&path).map_err(|e| EngineError::io(&path, e))?;
        }
    }
    let dir = staging_dir(root, step);
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    Ok(dir)
}

/// Writes rank `rank`'s file into `dir` (synced), and hashes what is on disk.
pub fn write_rank_file(
    dir: &Path,
    rank: usize,
    step: usize,
    arrays: &[RankArrays],
) -> Result<RankFile> {
    let name = rank_file_name(rank);
    let path = dir.join(&name);
    let views: Vec<(String, F32View)> = arrays
        .iter()
        .flat_map(|a| {
            let h = &a.holding;
            // A whole shard keeps its shape (cut-major: the cut dimension first); a ZeRO piece
            // is flat.
            let shape = if h.flat.len() != h.shard_shape.iter().product::<usize>() {
                vec![h.flat.len()]
            } else if h.order() == super::StoredOrder::CutMajor {
                let mut s = h.shard_shape.clone();
                let len = s.remove(h.tp_slice.dim);
                s.insert(0, len);
                s
            } else {
                h.shard_shape.clone()
            };
            let mut out = vec![(
                Kind::Param.key(&h.name),
                F32View {
                    shape: shape.clone(),
                    holding: h,
                    data: &a.param,
                },
            )];
            if let Some((m, v)) = &a.moments {
                for (kind, data) in [(Kind::ExpAvg, m), (Kind::ExpAvgSq, v)] {
                    out.push((
                        kind.key(&h.name),
                        F32View {
                            shape: shape.clone(),
                            holding: h,
                            data,
                        },
                    ));
                }
            }
            out
        })
        .collect();
    for (key, v) in &views {
        if v.data.len() != v.shape.iter().product::<usize>() {
            return Err(EngineError::Invalid(format!(
                "checkpoint: rank {rank}'s `{key}` has {} values for shape {:?}",
                v.data.len(),
                v.shape
            )));
        }
    }
    let mut meta = HashMap::from([
        ("format".to_string(), super::FORMAT.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    for (key, v) in &views {
        meta.insert(
            super::files::array_sha_key(key),
            super::files::block_hashes(&v.bytes()),
        );
    }
    safetensors::serialize_to_file(views.iter().map(|(k, v)| (k.clone(), v)), Some(meta), &path)
        .map_err(|e| EngineError::format(&path, e.to_string()))?;
    if crash_point("rank-file", step) {
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(len / 2));
        crash_at("rank-file", step);
    }
    std::fs::File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(|e| EngineError::io(&path, e))?;
    let (bytes, sha256) = sha256_file(&path)?;
    let header_sha256 = super::files::header_sha256(&path)?;
    Ok(RankFile {
        rank,
        file: name,
        bytes,
        sha256,
        header_sha256,
    })
}

/// Completes a checkpoint (rank 0): checks that every rank's file is in `staging` with the size
/// its writer reported, fills in and writes the manifest, renames `staging` to `step-NNNNNN` and
/// points `latest` at it; then keeps only the newest `keep` checkpoints (0: all). Returns the
/// checkpoint's directory.
pub fn commit(
    root: &Path,
    staging: &Path,
    mut manifest: Manifest,
    files: Vec<RankFile>,
    keep: usize,
) -> Result<PathBuf> {
    let step = manifest.step;
    crash_at("manifest", step);
    for f in &files {
        let path = staging.join(&f.file);
        let len = std::fs::metadata(&path)
            .map_err(|e| EngineError::io(&path, e))?
            .len();
        if len != f.bytes {
            return Err(EngineError::format(
                &path,
                format!("{len} bytes on disk, its writer wrote {}", f.bytes),
            ));
        }
    }
    let tokenizer = match manifest.tokenizer_source.take() {
        Some(src) => {
            let copy = staging.join(TOKENIZER);
            std::fs::copy(&src, &copy).map_err(|e| EngineError::io(&src, e))?;
            Some(aux_file(&copy)?)
        }
        None => None,
    };
    let text = seal(&mut manifest, files, tokenizer)?;
    write_atomic(&staging.join(MANIFEST), text.as_bytes())?;
    sync_dir(staging)?;
    crash_at("rename", step);
    let name = step_dir_name(step);
    let dir = root.join(&name);
    if dir.exists() {
        // A checkpoint of this step already there (a rerun from an earlier one), which `latest`
        // may name: swapped with the new one in one step, so the name never goes missing.
        exchange(staging, &dir)?;
        std::fs::remove_dir_all(staging).map_err(|e| EngineError::io(staging, e))?;
    } else {
        std::fs::rename(staging, &dir).map_err(|e| EngineError::io(&dir, e))?;
    }
    sync_dir(root)?;
    crash_at("latest", step);
    write_atomic(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    sync_dir(root)?;
    prune(root, keep)?;
    Ok(dir)
}

/// The tokenizer's entry in a manifest, from the file as it is stored (or uploaded).
fn aux_file(file: &Path) -> Result<AuxFile> {
    let (bytes, sha256) = sha256_file(file)?;
    Ok(AuxFile {
        file: TOKENIZER.into(),
        bytes,
        sha256,
    })
}

/// Completes `manifest` for the rank `files` written under `layout` (every tensor's pieces, each
/// file's size and SHA-256, the tokenizer, the manifest's own checksum); returns its JSON.
fn seal(
    manifest: &mut Manifest,
    files: Vec<RankFile>,
    tokenizer: Option<AuxFile>,
) -> Result<String> {
    let layout = &LayoutSpec::parse(&manifest.layout)?.layout;
    if files.len() != manifest.world_size {
        return Err(EngineError::Invalid(format!(
            "checkpoint of step {}: {} rank files for {} ranks",
            manifest.step,
            files.len(),
            manifest.world_size
        )));
    }
    let kinds: &[Kind] = if manifest.optimizer.step > 0 {
        &Kind::ALL
    } else {
        &[Kind::Param]
    };
    manifest.tensors = manifest_tensors(&manifest.model, manifest.lora.as_ref(), layout, kinds)?;
    manifest.files = files
        .into_iter()
        .map(|f| FileEntry {
            rank: f.rank,
            file: f.file,
            bytes: f.bytes,
            sha256: f.sha256,
            header_sha256: Some(f.header_sha256),
        })
        .collect();
    manifest.tokenizer = tokenizer;
    manifest.checksum = Some(manifest.digest());
    Ok(serde_json::to_string_pretty(&*manifest).expect("the manifest serialises"))
}

/// Swaps two directories atomically (Linux `renameat2(RENAME_EXCHANGE)`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| EngineError::Invalid(format!("{}: a NUL in the path", p.display())))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths; the call reads them only.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        return Err(EngineError::io(b, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Elsewhere: the old one moved aside, then the new one into place (a crash in between leaves the
/// name missing until the next save).
#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    let aside = a.with_extension("swap");
    std::fs::rename(b, &aside).map_err(|e| EngineError::io(b, e))?;
    std::fs::rename(a, b).map_err(|e| EngineError::io(a, e))?;
    std::fs::rename(&aside, a).map_err(|e| EngineError::io(a, e))
}

/// Removes all but the newest `keep` checkpoints under `root` (0: keeps all); never the one
/// `latest` names.
pub fn prune(root: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let latest = std::fs::read_to_string(root.join(LATEST)).unwrap_or_default();
    let mut steps: Vec<(usize, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| EngineError::io(root, e))?
        .filter_map(|e| {
            let path = e.ok()?.path();
            let n = path
                .file_name()?
                .to_str()?
                .strip_prefix("step-")?
                .parse()
                .ok()?;
            Some((n, path))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, path) in steps.into_iter().take(excess) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == latest.trim() {
            continue;
        }
        // Renamed out of sight first: a crash while deleting must not leave a `step-*` that lacks
        // files (the next save clears the hidden remains).
        let doomed = root.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&path, &doomed).map_err(|e| EngineError::io(&path, e))?;
        std::fs::remove_dir_all(&doomed).map_err(|e| EngineError::io(&doomed, e))?;
    }
    Ok(())
}

/// Saves a checkpoint from every rank of `c`'s world at once (every rank calls it with its own
/// arrays; rank 0 with the manifest), under a local directory or an `s3://` prefix:
/// [`begin_save`], [`write_own`], [`finish_save`] in a row.
pub fn save_distributed<C: Comm>(
    c: &mut C,
    root: &Location,
    step: usize,
    arrays: &[RankArrays],
    manifest: Option<Manifest>,
    keep: usize,
) -> Result<()> {
    let written_in = begin_save(c, root, step)?;
    let written = write_own(root, &written_in, c.rank(), step, arrays);
    finish_save(c, root, step, &written_in, written, manifest, keep)
}

/// The first part of a save, on every rank at once: rank 0 prepares (a staging directory; on an
/// object store, the step's prefix) and every rank learns whether it could. Returns where this
/// rank writes its file (the staging directory, or on an object store a spool of this host's).
pub fn begin_save<C: Comm>(c: &mut C, root: &Location, step: usize) -> Result<PathBuf> {
    let all = Group::new("world", (0..c.world_size()).collect());
    let written_in = match root {
        Location::Local(root) => staging_dir(root, step),
        Location::S3(_) => ferrotron_core::topology::cache_dir()
            .join("spool")
            .join(format!("{}-{}", std::process::id(), step_dir_name(step))),
    };
    let prepared = match (c.rank(), root) {
        (0, Location::Local(root)) => prepare_staging(root, step).map(|_| ()),
        (0, Location::S3(_)) => super::remote::prepare(root, step),
        _ => Ok(()),
    };
    let mut failed = [f64::from(prepared.is_err())];
    c.all_reduce(&all, &mut failed, ReduceOp::Sum)?;
    prepared?;
    if failed[0] > 0.0 {
        return Err(EngineError::Invalid(format!(
            "checkpoint of step {step}: rank 0 could not prepare it under {root}"
        )));
    }
    Ok(written_in)
}

/// This rank's file of step `step`, written into `written_in` (synced and hashed) and, on an object
/// store, uploaded from there. Needs no other rank: an asynchronous save runs it on a thread.
pub fn write_own(
    root: &Location,
    written_in: &Path,
    rank: usize,
    step: usize,
    arrays: &[RankArrays],
) -> Result<RankFile> {
    match root {
        Location::Local(_) => write_rank_file(written_in, rank, step, arrays),
        Location::S3(_) => {
            std::fs::create_dir_all(written_in).map_err(|e| EngineError::io(written_in, e))?;
            let f = write_rank_file(written_in, rank, step, arrays)?;
            let local = written_in.join(&f.file);
            let uploaded = super::remote::upload_rank_file(root, step, &local, &f.file);
            let _ = std::fs::remove_file(&local);
            uploaded.map(|_| f)
        }
    }
}

/// The last part of a save, on every rank at once: every rank reports its file's size and hash
/// (or its failure) to rank 0, which commits; every rank returns rank 0's verdict.
pub fn finish_save<C: Comm>(
    c: &mut C,
    root: &Location,
    step: usize,
    written_in: &Path,
    written: Result<RankFile>,
    manifest: Option<Manifest>,
    keep: usize,
) -> Result<()> {
    const TAG: u64 = 1 << 58;
    let (rank, world) = (c.rank(), c.world_size());
    let all = Group::new("world", (0..world).collect());
    // Size, SHA-256 and the header's SHA-256 (each as four 64-bit words); a negative size reports
    // a failure.
    let report = |f: &Result<RankFile>| -> [f64; 9] {
        let mut out = [-1f64; 9];
        if let Ok(f) = f {
            out[0] = f.bytes as f64;
            for (k, w) in out[1..].iter_mut().enumerate() {
                let hex = if k < 4 { &f.sha256 } else { &f.header_sha256 };
                let k = k % 4;
                *w = f64::from_bits(
                    u64::from_str_radix(&hex[16 * k..16 * (k + 1)], 16).expect("hex"),
                );
            }
        }
        out
    };
    let mut verdict = [0f64];
    if rank != 0 {
        c.send(0, &report(&written), TAG)?;
        c.all_reduce(&all, &mut verdict, ReduceOp::Sum)?;
        written?;
        if verdict[0] > 0.0 {
            return Err(EngineError::Invalid(format!(
                "checkpoint of step {step}: rank 0 could not complete it (see its error)"
            )));
        }
        return Ok(());
    }
    let mut reports = vec![report(&written)];
    for r in 1..world {
        let mut v = [0f64; 9];
        c.recv(r, &mut v, TAG)?;
        reports.push(v);
    }
    let result = written.and_then(|mine| {
        let mut files = vec![mine];
        for (r, v) in reports.iter().enumerate().skip(1) {
            if v[0] < 0.0 {
                return Err(EngineError::Invalid(format!(
                    "checkpoint of step {step}: rank {r} could not write its file"
                )));
            }
            let hex = |w: &[f64]| w.iter().map(|w| format!("{:016x}", w.to_bits())).collect();
            files.push(RankFile {
                rank: r,
                file: rank_file_name(r),
                bytes: v[0] as u64,
                sha256: hex(&v[1..5]),
                header_sha256: hex(&v[5..9]),
            });
        }
        let manifest = manifest.expect("rank 0 brings the manifest");
        match root {
            Location::Local(root) => commit(root, written_in, manifest, files, keep).map(|_| ()),
            Location::S3(_) => commit_remote(root, manifest, files, keep),
        }
    });
    verdict[0] = f64::from(result.is_err());
    c.all_reduce(&all, &mut verdict, ReduceOp::Sum)?;
    result
}

/// [`commit`] on an object store: every rank's file is uploaded; the manifest, then `latest`.
fn commit_remote(
    root: &Location,
    mut manifest: Manifest,
    files: Vec<RankFile>,
    keep: usize,
) -> Result<()> {
    let step = manifest.step;
    let tokenizer_source = manifest.tokenizer_source.take();
    let tokenizer = match &tokenizer_source {
        Some(src) => Some(aux_file(src)?),
        None => None,
    };
    let text = seal(&mut manifest, files, tokenizer)?;
    super::remote::commit(root, step, &text, tokenizer_source.as_deref(), keep).map(|_| ())
}

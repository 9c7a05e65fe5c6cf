//! Checkpoints on an object store (`s3://bucket/prefix`), with the guarantees they have on disk.
//!
//! An object store has no rename, so the order of the writes is what makes a save atomic: every
//! rank uploads its file into `step-NNNNNN/` (each rank its own, from its own host), then rank 0
//! uploads the tokenizer and the manifest — **a step prefix without `manifest.json` is not a
//! checkpoint** (`Checkpoint::open` and `inspect` refuse it by name) — and only then `latest`.
//! A save interrupted anywhere leaves `latest` naming the previous complete checkpoint. A save over
//! an existing `step-NNNNNN` (a run resumed from an earlier step) first points `latest` at the
//! newest other complete checkpoint, then removes the old one manifest first.
//!
//! Reading downloads the checkpoint's files into the local cache (verified against the manifest's
//! sizes and SHA-256 as on disk), so everything that reads a local checkpoint reads it.

use super::{step_dir_name, LATEST, MANIFEST, TOKENIZER};
use crate::error::{EngineError, Result};
use crate::storage::Location;
use std::path::{Path, PathBuf};

/// The complete checkpoints under `root` (step prefixes holding a manifest), by step, ascending.
pub fn complete_steps(root: &Location) -> Result<Vec<(usize, String)>> {
    let mut steps = Vec::new();
    for entry in root.list()? {
        let Some(n) = entry
            .name
            .strip_prefix("step-")
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        if entry.is_dir && root.join(&entry.name).join(MANIFEST).exists()? {
            steps.push((n, entry.name));
        }
    }
    steps.sort();
    Ok(steps)
}

/// Whether `root` holds checkpoints (`latest`, or a step prefix).
pub fn holds_checkpoints(root: &Location) -> Result<bool> {
    Ok(root.join(LATEST).exists()?
        || root
            .list()?
            .iter()
            .any(|e| e.is_dir && e.name.starts_with("step-")))
}

/// Deletes the checkpoints under `root`: `latest` first, then each step prefix (its manifest first).
pub fn remove_checkpoints(root: &Location) -> Result<()> {
    root.join(LATEST).remove()?;
    for entry in root.list()? {
        if entry.is_dir && entry.name.starts_with("step-") {
            remove_step(&root.join(&entry.name))?;
        }
    }
    Ok(())
}

/// Removes one step prefix, its manifest first: interrupted, it is no longer a checkpoint.
fn remove_step(step: &Location) -> Result<()> {
    step.join(MANIFEST).remove()?;
    step.remove_all()
}

/// What `latest` names, if anything.
fn latest(root: &Location) -> Result<Option<String>> {
    Ok(root
        .join(LATEST)
        .try_read(4096)?
        .map(|b| String::from_utf8_lossy(&b).trim().to_string()))
}

/// Points `latest` at the newest complete checkpoint other than `except`, or removes it.
fn repoint_latest(root: &Location, except: &str) -> Result<()> {
    let newest = complete_steps(root)?
        .into_iter()
        .rev()
        .find(|(_, name)| name != except);
    match newest {
        Some((_, name)) => root.join(LATEST).write(format!("{name}\n").as_bytes()),
        None => root.join(LATEST).remove(),
    }
}

/// Rank 0, before any rank uploads step `step`: an earlier checkpoint of that step (a run resumed
/// from before it) is replaced — `latest` moved off it first, then it is removed, manifest first.
pub fn prepare(root: &Location, step: usize) -> Result<()> {
    root.check_reachable()?;
    let name = step_dir_name(step);
    let dir = root.join(&name);
    if dir.list()?.is_empty() {
        return Ok(());
    }
    if latest(root)?.as_deref() == Some(name.as_str()) {
        repoint_latest(root, &name)?;
    }
    remove_step(&dir)
}

/// Uploads rank `rank`'s file (written and hashed locally at `file`) into step `step`'s prefix.
pub fn upload_rank_file(root: &Location, step: usize, file: &Path, name: &str) -> Result<()> {
    root.join(&step_dir_name(step)).join(name).upload_file(file)
}

/// Rank 0, once every rank's file is uploaded: the tokenizer, then the manifest (`text`), then
/// `latest`; then keeps only the newest `keep` complete checkpoints (0: all).
pub fn commit(
    root: &Location,
    step: usize,
    manifest_text: &str,
    tokenizer: Option<&Path>,
    keep: usize,
) -> Result<Location> {
    let name = step_dir_name(step);
    let dir = root.join(&name);
    if let Some(t) = tokenizer {
        dir.join(TOKENIZER).upload_file(t)?;
    }
    super::files::crash_at("manifest", step);
    dir.join(MANIFEST).write(manifest_text.as_bytes())?;
    super::files::crash_at("latest", step);
    root.join(LATEST).write(format!("{name}\n").as_bytes())?;
    prune(root, keep)?;
    Ok(dir)
}

/// Removes all but the newest `keep` complete checkpoints (0: keeps all); never the one `latest`
/// names.
pub fn prune(root: &Location, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let latest = latest(root)?.unwrap_or_default();
    let steps = complete_steps(root)?;
    let excess = steps.len().saturating_sub(keep);
    for (_, name) in steps.into_iter().take(excess) {
        if name != latest {
            remove_step(&root.join(&name))?;
        }
    }
    Ok(())
}

/// The checkpoint `root` names: itself when it holds a manifest, else the one its `latest` names
/// (which must hold one). Returns its prefix and a name for it.
pub fn resolve(root: &Location) -> Result<(Location, String)> {
    root.check_reachable()?;
    if root.join(MANIFEST).exists()? {
        return Ok((root.clone(), "checkpoint".to_string()));
    }
    let Some(name) = latest(root)? else {
        return Err(EngineError::Storage {
            location: root.to_string(),
            msg: format!("not a checkpoint: no {MANIFEST} and no `{LATEST}`"),
        });
    };
    crate::paths::plain_name(&name, &root.join(LATEST).as_error_path())?;
    let dir = root.join(&name);
    if !dir.join(MANIFEST).exists()? {
        return Err(EngineError::Storage {
            location: root.join(LATEST).to_string(),
            msg: format!(
                "points to `{name}`, which holds no {MANIFEST} (an interrupted save): use another checkpoint"
            ),
        });
    }
    Ok((dir, name))
}

/// The checkpoint `root` names ([`resolve`]), downloaded into `cache` to be checked there like a
/// local one. Returns the local directory.
pub fn fetch(root: &Location, cache: &Path) -> Result<PathBuf> {
    let (dir, name) = resolve(root)?;
    let local = cache.join(cache_name(&dir)).join(&name);
    std::fs::create_dir_all(&local).map_err(|e| EngineError::io(&local, e))?;
    let manifest_bytes = dir.join(MANIFEST).read(ferrotron_core::bounded::SETTINGS)?;
    let manifest: super::Manifest = serde_json::from_slice(&manifest_bytes).map_err(|e| {
        EngineError::format(
            dir.join(MANIFEST).as_error_path(),
            format!("not a valid manifest: {e}"),
        )
    })?;
    let mut files: Vec<(&str, u64, &str)> = manifest
        .files
        .iter()
        .map(|f| (f.file.as_str(), f.bytes, f.sha256.as_str()))
        .collect();
    if let Some(t) = &manifest.tokenizer {
        files.push((t.file.as_str(), t.bytes, t.sha256.as_str()));
    }
    for (file, bytes, sha256) in files {
        crate::paths::plain_name(file, &dir.join(MANIFEST).as_error_path())?;
        let to = local.join(file);
        // A copy already in the cache is reused only when it is the file the manifest records
        // (an interrupted download is resumed file by file, never trusted by its size).
        let cached = std::fs::metadata(&to).is_ok_and(|m| m.len() == bytes)
            && super::files::sha256_file(&to).is_ok_and(|(_, sha)| sha == sha256);
        if !cached {
            download(&dir.join(file), &to)?;
            pause_drill(file);
        }
    }
    crate::hf::write_atomic(&local.join(MANIFEST), &manifest_bytes)?;
    Ok(local)
}

/// Testing: seconds to wait, once per process, after the first part of a checkpoint read from a
/// store (a file a fetch downloads, or an array a device reads): the fault tests stop the server
/// in the middle of a resume's reads.
pub const FETCH_PAUSE_ENV: &str = "FERROTRON_CHECKPOINT_FETCH_PAUSE";

pub(super) fn pause_drill(what: &str) {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(s) = std::env::var(FETCH_PAUSE_ENV)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    else {
        return;
    };
    if !DONE.swap(true, std::sync::atomic::Ordering::SeqCst) {
        eprintln!("{FETCH_PAUSE_ENV}: {what} fetched; waiting {s} s");
        std::thread::sleep(std::time::Duration::from_secs_f64(s));
    }
}

/// Copies `from` to the local file `to` in parts (never the whole file in memory), atomically.
fn download(from: &Location, to: &Path) -> Result<()> {
    use std::io::Write;
    const PART: u64 = 64 << 20;
    let size = from.size()?.ok_or_else(|| EngineError::Storage {
        location: from.to_string(),
        msg: "missing: the manifest lists it, the store does not hold it (the checkpoint is incomplete)"
            .into(),
    })?;
    // A name of this process's own: ranks of one host may fetch the same checkpoint at once.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = to.with_extension(format!("{}-{n}.download", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
    let mut at = 0;
    while at < size {
        let end = (at + PART).min(size);
        f.write_all(&from.read_range(at..end)?)
            .map_err(|e| EngineError::io(&tmp, e))?;
        at = end;
    }
    f.sync_all().map_err(|e| EngineError::io(&tmp, e))?;
    std::fs::rename(&tmp, to).map_err(|e| EngineError::io(to, e))
}

/// A directory name for a location in the cache (its URL, made a plain name).
pub(super) fn cache_name(at: &Location) -> String {
    at.to_string()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Publishes the checkpoint an offline tool wrote under the local directory `local_root` (its
/// `latest` and the step it names) to `root`, in a save's order: the step's files, its manifest,
/// then `latest`. Returns the step's prefix.
pub fn publish(local_root: &Path, root: &Location) -> Result<Location> {
    let latest_file = local_root.join(LATEST);
    let name =
        std::fs::read_to_string(&latest_file).map_err(|e| EngineError::io(&latest_file, e))?;
    let name = name.trim();
    let step_dir = local_root.join(name);
    let dir = root.join(name);
    let entries = std::fs::read_dir(&step_dir).map_err(|e| EngineError::io(&step_dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| EngineError::io(&step_dir, e))?.path();
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if file != MANIFEST && !file.starts_with('.') {
            dir.join(file).upload_file(&path)?;
        }
    }
    dir.join(MANIFEST).upload_file(&step_dir.join(MANIFEST))?;
    root.join(LATEST).write(format!("{name}\n").as_bytes())?;
    Ok(dir)
}

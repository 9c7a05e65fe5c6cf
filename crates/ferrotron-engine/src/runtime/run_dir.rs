//! A run directory holds one run. Training into a directory that already holds a run would mix
//! two runs' metrics, models and checkpoints, so it is refused unless the run says what it means:
//! `resume` (continue that run from one of its own checkpoints) or `overwrite` (replace it).

use super::config::TrainConfig;
use crate::checkpoint::Checkpoint;
use crate::dir_lock::{self, DirLock, Stale};
use crate::error::{EngineError, Result};
use crate::storage::Location;
use std::path::{Path, PathBuf};

/// What marks a directory as holding a run.
const RUN_FILES: [&str; 2] = ["train_config.json", "metrics.jsonl"];
/// What a run writes into its directory (all of it goes with `overwrite`).
const RUN_OUTPUTS: [&str; 5] = [
    "train_config.json",
    "metrics.jsonl",
    "model",
    "report.html",
    "flight",
];

/// Locks `cfg`'s run directory (and its checkpoint directory, when that lies elsewhere) for the
/// run, checks that the run may write them, and with `overwrite` empties them of the earlier run.
/// The reporting process calls it before it reads or writes anything there, and holds the locks
/// until the run ends.
pub(super) fn claim(cfg: &TrainConfig) -> Result<Vec<DirLock>> {
    let out = &cfg.checkpointing.out_dir;
    let checkpoints = cfg.checkpoint_location()?;
    // A run that died holding the lock is continued by --resume or replaced by --overwrite.
    let stale = if cfg.checkpointing.overwrite || cfg.checkpointing.resume.is_some() {
        Stale::TakeOver
    } else {
        Stale::Refuse(
            "continue it with --resume <its checkpoint directory>, replace it with --overwrite, or give a new --out-dir",
        )
    };
    let mut locks = vec![dir_lock::acquire(out, "train", stale)?];
    // An object store has no locks: its prefix is the run directory's (locked) to write.
    if let Location::Local(dir) = &checkpoints {
        if !within(dir, out) {
            locks.push(dir_lock::acquire(dir, "train", stale)?);
        }
    }
    check_and_clear(cfg, out, &checkpoints)?;
    // Found now rather than at the first save, after the training it was meant to keep.
    probe_writable(&checkpoints)?;
    // An earlier attempt's flight records would be read as this run's.
    super::hang::clear(out)?;
    Ok(locks)
}

fn check_and_clear(cfg: &TrainConfig, out: &Path, checkpoints: &Location) -> Result<()> {
    let holds_run = RUN_FILES.iter().any(|f| out.join(f).exists());
    let holds_checkpoints = checkpoints.join(crate::checkpoint::LATEST).exists()?;
    if !holds_run && !holds_checkpoints {
        // Files a run would write, not written by a run (a user's model in `model/`): replacing
        // them needs --overwrite.
        let foreign = RUN_OUTPUTS[2..]
            .iter()
            .map(|name| out.join(name))
            .find(|p| p.exists() && !is_empty_dir(p));
        return match (foreign, cfg.checkpointing.overwrite) {
            (Some(p), false) => Err(EngineError::Invalid(format!(
                "`{}` holds files no run wrote (there is no train_config.json or metrics.jsonl beside it), and this run would replace them with its own; move them, give a new --out-dir, or replace them with --overwrite",
                p.display()
            ))),
            (Some(_), true) => clear(out, checkpoints),
            (None, _) => Ok(()),
        };
    }
    if cfg.checkpointing.overwrite {
        if let Some(from) = &cfg.checkpointing.resume {
            let ck = Checkpoint::locate(from)?;
            if ck_within(&ck, checkpoints) {
                return Err(EngineError::Invalid(format!(
                    "--overwrite would delete {ck}, the checkpoint --resume continues from; resume without --overwrite, or resume into a new --out-dir"
                )));
            }
        }
        return clear(out, checkpoints);
    }
    match &cfg.checkpointing.resume {
        Some(from) => {
            let ck = Checkpoint::locate(from)?;
            if ck_within(&ck, checkpoints) {
                Ok(()) // continuing this directory's own run
            } else {
                Err(EngineError::Invalid(format!(
                    "{} holds another run: resuming {ck} into it would mix the two; give a new --out-dir (or --overwrite to replace it)",
                    describe(out, checkpoints, holds_run),
                )))
            }
        }
        None => Err(EngineError::Invalid(match last_step(checkpoints) {
            Some(step) => format!(
                "{} already holds a run (last checkpoint: {step}); continue it with --resume {checkpoints}, replace it with --overwrite, or give a new --out-dir",
                describe(out, checkpoints, holds_run),
            ),
            // Stopped before its first checkpoint: there is nothing to continue from.
            None => format!(
                "{} already holds a run that wrote no checkpoint to continue from; replace it with --overwrite, or give a new --out-dir",
                describe(out, checkpoints, holds_run)
            ),
        })),
    }
}

/// Creates `dir` and a file in it, then removes the file: a read-only or full checkpoint directory
/// (on an object store: a missing bucket, credentials that may not write) is an error before the
/// run starts.
fn probe_writable(dir: &Location) -> Result<()> {
    let refuse = |e: String| {
        EngineError::Invalid(format!(
            "checkpoint directory `{dir}` cannot be written ({e}): the run could not save what it trains; give a writable --checkpoint-dir or --out-dir"
        ))
    };
    if let Location::Local(p) = dir {
        std::fs::create_dir_all(p).map_err(|e| refuse(e.to_string()))?;
    }
    dir.check_reachable()?;
    let probe = dir.join(&format!(".write-probe.{}", std::process::id()));
    probe.write(b"probe").map_err(|e| refuse(e.to_string()))?;
    probe.remove().map_err(|e| refuse(e.to_string()))
}

/// Whether the checkpoint `ck` lies under the checkpoint directory `dir`.
fn ck_within(ck: &Location, dir: &Location) -> bool {
    match (ck, dir) {
        (Location::Local(c), Location::Local(d)) => within(c, d),
        (Location::S3(c), Location::S3(d)) => {
            c.bucket == d.bucket
                && (d.key.is_empty() || c.key == d.key || c.key.starts_with(&format!("{}/", d.key)))
        }
        _ => false,
    }
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_none())
}

fn describe(out: &Path, checkpoints: &Location, holds_run: bool) -> String {
    if holds_run {
        format!("`{}`", out.display())
    } else {
        format!("checkpoint directory `{checkpoints}`")
    }
}

/// The step directory `latest` names, if any.
fn last_step(checkpoints: &Location) -> Option<String> {
    let name = checkpoints
        .join(crate::checkpoint::LATEST)
        .try_read(ferrotron_core::bounded::SMALL)
        .ok()??;
    Some(String::from_utf8_lossy(&name).trim().to_string())
}

/// Whether `path` lies inside `dir` (both made absolute; neither need exist beyond `path`).
fn within(path: &Path, dir: &Path) -> bool {
    match (absolute(path), absolute(dir)) {
        (Some(p), Some(d)) => p.starts_with(d),
        _ => false,
    }
}

fn absolute(p: &Path) -> Option<PathBuf> {
    p.canonicalize()
        .ok()
        .or_else(|| std::path::absolute(p).ok())
}

/// Deletes what the earlier run wrote: its outputs in `out` and its checkpoints.
fn clear(out: &Path, checkpoints: &Location) -> Result<()> {
    for name in RUN_OUTPUTS {
        let p = out.join(name);
        let gone = if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        match gone {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(EngineError::io(&p, e))
            }
            _ => {}
        }
    }
    // Only what a run writes there: the directory may be the user's, holding other things.
    match checkpoints {
        Location::Local(dir) => crate::checkpoint::remove_checkpoints(dir),
        remote => crate::checkpoint::remote::remove_checkpoints(remote),
    }
}

/// Writes the run's resolved settings, `train_config.json`, into its (claimed) directory.
pub(super) fn record_settings(cfg: &TrainConfig) -> Result<()> {
    let out = &cfg.checkpointing.out_dir;
    std::fs::create_dir_all(out).map_err(|e| EngineError::io(out, e))?;
    let text = serde_json::to_string_pretty(cfg).expect("the settings serialise");
    crate::hf::write_atomic(&out.join(RUN_FILES[0]), text.as_bytes())
}

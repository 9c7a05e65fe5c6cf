//! A run directory holds one run. Training into a directory that already holds a run would mix
//! two runs' metrics, models and checkpoints, so it is refused unless the run says what it means:
//! `resume` (continue that run from one of its own checkpoints) or `overwrite` (replace it).

use super::config::TrainConfig;
use crate::checkpoint::Checkpoint;
use crate::dir_lock::{self, DirLock, Stale};
use crate::error::{EngineError, Result};
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
    let checkpoints = cfg.checkpoint_root();
    // A run that died holding the lock is continued by --resume or replaced by --overwrite.
    let stale = if cfg.checkpointing.overwrite || cfg.checkpointing.resume.is_some() {
        Stale::TakeOver
    } else {
        Stale::Refuse(
            "continue it with --resume <its checkpoint directory>, replace it with --overwrite, or give a new --out-dir",
        )
    };
    let mut locks = vec![dir_lock::acquire(out, "train", stale)?];
    if !within(&checkpoints, out) {
        locks.push(dir_lock::acquire(&checkpoints, "train", stale)?);
    }
    check_and_clear(cfg, out, &checkpoints)?;
    // Found now rather than at the first save, after the training it was meant to keep.
    probe_writable(&checkpoints)?;
    // An earlier attempt's flight records would be read as this run's.
    super::hang::clear(out)?;
    Ok(locks)
}

fn check_and_clear(cfg: &TrainConfig, out: &Path, checkpoints: &Path) -> Result<()> {
    let holds_run = RUN_FILES.iter().any(|f| out.join(f).exists());
    let holds_checkpoints = checkpoints.join(crate::checkpoint::LATEST).exists();
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
            let ck = Checkpoint::resolve(from)?;
            if within(&ck, checkpoints) {
                return Err(EngineError::Invalid(format!(
                    "--overwrite would delete {}, the checkpoint --resume continues from; resume without --overwrite, or resume into a new --out-dir",
                    ck.display()
                )));
            }
        }
        return clear(out, checkpoints);
    }
    match &cfg.checkpointing.resume {
        Some(from) => {
            let ck = Checkpoint::resolve(from)?;
            if within(&ck, checkpoints) {
                Ok(()) // continuing this directory's own run
            } else {
                Err(EngineError::Invalid(format!(
                    "{} holds another run: resuming {} into it would mix the two; give a new --out-dir (or --overwrite to replace it)",
                    describe(out, checkpoints, holds_run),
                    ck.display()
                )))
            }
        }
        None => Err(EngineError::Invalid(match last_step(checkpoints) {
            Some(step) => format!(
                "{} already holds a run (last checkpoint: {step}); continue it with --resume {}, replace it with --overwrite, or give a new --out-dir",
                describe(out, checkpoints, holds_run),
                checkpoints.display()
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
/// is an error before the run starts.
fn probe_writable(dir: &Path) -> Result<()> {
    let refuse = |e: std::io::Error| {
        EngineError::Invalid(format!(
            "checkpoint directory `{}` cannot be written ({e}): the run could not save what it trains; give a writable --checkpoint-dir or --out-dir",
            dir.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(refuse)?;
    let probe = dir.join(format!(".write-probe.{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(refuse)?;
    std::fs::remove_file(&probe).map_err(refuse)
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_none())
}

fn describe(out: &Path, checkpoints: &Path, holds_run: bool) -> String {
    if holds_run {
        format!("`{}`", out.display())
    } else {
        format!("checkpoint directory `{}`", checkpoints.display())
    }
}

/// The step directory `latest` names, if any.
fn last_step(checkpoints: &Path) -> Option<String> {
    let name = ferrotron_core::bounded::read_to_string(
        &checkpoints.join(crate::checkpoint::LATEST),
        ferrotron_core::bounded::SMALL,
    )
    .ok()?;
    Some(name.trim().to_string())
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
fn clear(out: &Path, checkpoints: &Path) -> Result<()> {
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
    crate::checkpoint::remove_checkpoints(checkpoints)
}

/// Writes the run's resolved settings, `train_config.json`, into its (claimed) directory.
pub(super) fn record_settings(cfg: &TrainConfig) -> Result<()> {
    let out = &cfg.checkpointing.out_dir;
    std::fs::create_dir_all(out).map_err(|e| EngineError::io(out, e))?;
    let text = serde_json::to_string_pretty(cfg).expect("the settings serialise");
    crate::hf::write_atomic(&out.join(RUN_FILES[0]), text.as_bytes())
}

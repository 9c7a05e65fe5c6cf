//! The effective-batch guard. A learning rate belongs to the batch it was tuned for: a run that
//! continues another (`resume`, or fine-tuning the model a run wrote) with a different number of
//! tokens per optimizer step must say how the LR follows (`lr_scaling`), or it is refused. The
//! layout never enters: it splits the same tokens per step over the devices — but for
//! `schedule=pipedream`, which updates after every micro-batch, so that its effective batch is
//! dp × mbs sequences.

use super::config::TrainConfig;
use crate::checkpoint::Checkpoint;
use crate::error::{EngineError, Result};
use crate::model_source::ModelSource;
use ferrotron_core::layout::{LayoutSpec, Schedule};
use std::path::Path;

/// What the run this one continues trained with.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlierRun {
    /// Where its settings were read (a checkpoint, or a run's `train_config.json`).
    pub origin: String,
    pub batch_size: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub min_lr: f64,
    /// Its `--layout` (its schedule may update more often than once a step).
    pub layout: LayoutSpec,
}

/// Sequences per optimizer update: the batch, or under `schedule=pipedream` (an update after every
/// micro-batch) dp × mbs.
fn sequences_per_update(batch_size: usize, layout: &LayoutSpec) -> usize {
    let l = &layout.layout;
    if l.schedule == Schedule::PipeDream {
        l.dp.max(1) * l.micro_batch_size.max(1)
    } else {
        batch_size
    }
}

impl EarlierRun {
    fn tokens_per_update(&self) -> usize {
        sequences_per_update(self.batch_size, &self.layout) * self.seq_len
    }

    fn from_settings(origin: String, v: &serde_json::Value) -> Option<Self> {
        Some(Self {
            origin,
            batch_size: v.get("batch_size")?.as_u64()? as usize,
            seq_len: v.get("seq_len")?.as_u64()? as usize,
            lr: v.get("lr")?.as_f64()?,
            min_lr: v.get("min_lr")?.as_f64()?,
            layout: LayoutSpec::parse(v.get("layout").and_then(|l| l.as_str()).unwrap_or(""))
                .ok()?,
        })
    }

    /// The run a resumed checkpoint was written by, or the run that wrote the model directory being
    /// fine-tuned (`<run>/model`, beside `<run>/train_config.json`). None when neither is known (a
    /// Hugging Face download, an imported checkpoint); an error when the run's settings are there
    /// but cannot be read, rather than a guard that silently does nothing.
    pub fn of(resume: Option<&Checkpoint>, source: &ModelSource) -> Result<Option<Self>> {
        if let Some(ck) = resume {
            let origin = format!("checkpoint {}", ck.dir.display());
            return Ok(ck
                .manifest
                .run
                .as_ref()
                .and_then(|v| Self::from_settings(origin, v)));
        }
        // A local model directory only: the run that wrote it is beside it.
        let Some(dir) = (match source {
            ModelSource::HfDir(model) => model.local(),
            ModelSource::Preset(_) => None,
        }) else {
            return Ok(None);
        };
        let Some(run) = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.parent().map(Path::to_path_buf))
        else {
            return Ok(None);
        };
        let settings = run.join("train_config.json");
        if !settings.exists() {
            return Ok(None);
        }
        let unreadable = |why: String| {
            EngineError::Invalid(format!(
                "{}: the settings of the run that wrote {} cannot be read ({why}); this run's batch \
                 and learning rate are checked against them",
                settings.display(),
                dir.display()
            ))
        };
        let text =
            ferrotron_core::bounded::read_to_string(&settings, ferrotron_core::bounded::SETTINGS)
                .map_err(|e| unreadable(e.to_string()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
        Self::from_settings(settings.display().to_string(), &v)
            .map(Some)
            .ok_or_else(|| {
                unreadable(
                    "no batch_size, seq_len, lr or min_lr, or a layout that does not parse".into(),
                )
            })
    }
}

/// One line for the start of every run: tokens per optimizer step and the LR schedule they go with.
pub fn describe(cfg: &TrainConfig) -> String {
    let per_update = sequences_per_update(cfg.optimizer.batch_size, &cfg.parallelism.layout);
    let batch = if per_update == cfg.optimizer.batch_size {
        format!(
            "{} sequences × {} tokens = {} tokens per optimizer step (whatever the layout)",
            cfg.optimizer.batch_size,
            cfg.input.seq_len,
            cfg.optimizer.batch_size * cfg.input.seq_len
        )
    } else {
        format!(
            "schedule=pipedream updates after every micro-batch: dp × mbs = {per_update} \
             sequences × {} tokens = {} tokens per optimizer update, {} updates per step of {} \
             sequences",
            cfg.input.seq_len,
            per_update * cfg.input.seq_len,
            cfg.optimizer.batch_size / per_update.max(1),
            cfg.optimizer.batch_size
        )
    };
    format!(
        "effective batch: {batch}; LR: linear warm-up over {} steps to {:e}, cosine decay to {:e} \
         at step {}",
        cfg.optimizer.warmup_steps, cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.steps
    )
}

/// This run's settings with the guard applied: unchanged when the tokens per step are the same (or
/// nothing earlier is known); refused when they differ and `lr_scaling` is not given; otherwise
/// with the LR the rule gives. The second value says what was done, for the user.
pub fn guard(
    cfg: &TrainConfig,
    earlier: Option<&EarlierRun>,
) -> Result<(TrainConfig, Option<String>)> {
    let mut out = cfg.clone();
    let Some(e) = earlier else {
        return Ok((out, None));
    };
    let (before, now) = (
        e.tokens_per_update(),
        sequences_per_update(cfg.optimizer.batch_size, &cfg.parallelism.layout) * cfg.input.seq_len,
    );
    if before == now {
        return Ok((out, None));
    }
    let ratio = now as f64 / before as f64;
    let sizes = format!(
        "{} sequences × {} tokens = {before} tokens per optimizer step at lr {:e} in {}, {} × {} = \
         {now} in this run",
        sequences_per_update(e.batch_size, &e.layout),
        e.seq_len,
        e.lr,
        e.origin,
        sequences_per_update(cfg.optimizer.batch_size, &cfg.parallelism.layout),
        cfg.input.seq_len
    );
    let Some(rule) = cfg.optimizer.lr_scaling else {
        return Err(EngineError::Invalid(format!(
            "the effective batch changes: {sizes}. The learning rate that worked belongs to the \
             old batch; say how it follows with --lr-scaling none (keep --lr {:e}), linear \
             (lr {:e}) or sqrt (lr {:e})",
            cfg.optimizer.lr,
            e.lr * ratio,
            e.lr * ratio.sqrt()
        )));
    };
    let rule_name = rule.name();
    let note = match rule.factor(ratio) {
        None => format!(
            "effective batch: {sizes}; --lr-scaling none keeps lr {:e} (min_lr {:e})",
            cfg.optimizer.lr, cfg.optimizer.min_lr
        ),
        Some(f) => {
            out.optimizer.lr = e.lr * f;
            out.optimizer.min_lr = e.min_lr * f;
            format!(
                "effective batch: {sizes}; --lr-scaling {rule_name} (× {f:.4}): lr {:e} -> {:e}, \
                 min_lr {:e} -> {:e}",
                e.lr, out.optimizer.lr, e.min_lr, out.optimizer.min_lr
            )
        }
    };
    Ok((out, Some(note)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn earlier(batch_size: usize, seq_len: usize) -> EarlierRun {
        EarlierRun {
            origin: "run a".into(),
            batch_size,
            seq_len,
            lr: 4e-3,
            min_lr: 4e-4,
            layout: LayoutSpec::default(),
        }
    }

    fn run(batch_size: usize, seq_len: usize, lr_scaling: Option<&str>) -> TrainConfig {
        {
            let mut c = TrainConfig::default();
            c.optimizer.batch_size = batch_size;
            c.input.seq_len = seq_len;
            c.optimizer.lr = 1e-3;
            c.optimizer.min_lr = 1e-4;
            c.optimizer.lr_scaling = lr_scaling.map(|r| r.parse().unwrap());
            c
        }
    }

    #[test]
    fn the_same_tokens_per_step_pass_unchanged_whatever_the_layout() {
        let mut cfg = run(16, 128, None);
        for layout in ["", "dp=2", "tp=2,pp=2", "dp=2,zero=3,mbs=4"] {
            cfg.parallelism.layout = layout.parse().unwrap();
            let (out, note) = guard(&cfg, Some(&earlier(16, 128))).unwrap();
            assert_eq!((out.optimizer.lr, note), (1e-3, None));
        }
        // Nothing earlier known: nothing to guard.
        assert!(guard(&run(8, 64, None), None).unwrap().1.is_none());
    }

    #[test]
    fn a_changed_batch_is_refused_without_a_rule_and_scaled_with_one() {
        let e = earlier(16, 128);
        let err = guard(&run(8, 128, None), Some(&e)).unwrap_err().to_string();
        assert!(
            err.contains("2048 tokens per optimizer step")
                && err.contains("1024 in this run")
                && err.contains("--lr-scaling"),
            "{err}"
        );
        let (out, note) = guard(&run(8, 128, Some("linear")), Some(&e)).unwrap();
        assert_eq!((out.optimizer.lr, out.optimizer.min_lr), (2e-3, 2e-4));
        assert!(note.unwrap().contains("lr 4e-3 -> 2e-3"));
        let (out, _) = guard(&run(64, 128, Some("sqrt")), Some(&e)).unwrap();
        assert!((out.optimizer.lr - 8e-3).abs() < 1e-15);
        let (out, note) = guard(&run(8, 128, Some("none")), Some(&e)).unwrap();
        assert_eq!(out.optimizer.lr, 1e-3);
        assert!(note.unwrap().contains("keeps lr 1e-3"));
        // Tokens per step count, not sequences: a longer sequence is a bigger batch.
        assert!(guard(&run(16, 256, None), Some(&e)).is_err());
        // An unknown rule is refused where it is parsed, naming it.
        let bad = "cubic".parse::<crate::optim::LrScaling>().unwrap_err();
        assert!(bad.contains("cubic") && bad.contains("sqrt"), "{bad}");
    }

    #[test]
    fn pipedream_updates_per_micro_batch_so_its_layout_is_its_batch() {
        let e = earlier(16, 128);
        let mut cfg = run(16, 128, None);
        cfg.parallelism.layout = "pp=4,mbs=2,schedule=pipedream".parse().unwrap();
        let err = guard(&cfg, Some(&e)).unwrap_err().to_string();
        assert!(err.contains("256 in this run"), "{err}");
        assert!(describe(&cfg).contains("dp × mbs = 2 sequences"));
        // 2BW updates once per step: the batch is the step's.
        cfg.parallelism.layout = "pp=4,mbs=2,schedule=2bw".parse().unwrap();
        assert!(guard(&cfg, Some(&e)).unwrap().1.is_none());
    }
}

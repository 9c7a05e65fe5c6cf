//! A training run's checkpoints: when to save, what the manifest records, what each device saves,
//! and how a resumed device restores its optimizer state.

use super::config::TrainConfig;
use crate::checkpoint::{
    begin_save, finish_save, rank_holdings, save_distributed, write_own, Checkpoint, Kind,
    LossScalerState, Manifest, OptimizerState, RankArrays, RankFile, FORMAT, VERSION,
};
use crate::comm::{Comm, Group, ReduceOp};
use crate::error::{EngineError, Result};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::Device;
use crate::storage::Location;
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig};
use ferrotron_core::precision::BaseQuantization;

/// When and where a run saves, and the manifest fields every save shares.
pub struct CheckpointPlan {
    /// A local directory or an `s3://` prefix.
    pub root: Location,
    pub every: usize,
    pub keep: usize,
    pub total_steps: usize,
    template: Manifest,
}

impl CheckpointPlan {
    pub fn new(
        cfg: &TrainConfig,
        model: &ModelConfig,
        layout: &Layout,
        adam: AdamWConfig,
        schedule: LrSchedule,
        tokenizer: &std::path::Path,
    ) -> Result<Self> {
        Ok(Self {
            root: cfg.checkpoint_location()?,
            every: cfg.checkpointing.checkpoint_every,
            keep: cfg.checkpointing.keep_checkpoints,
            total_steps: cfg.optimizer.steps,
            template: Manifest {
                format: FORMAT.into(),
                version: VERSION,
                step: 0,
                model: model.clone(),
                layout: layout.to_string(),
                world_size: layout.world_size(),
                precision: cfg.numerics.precision,
                optimizer: OptimizerState {
                    step: 0,
                    adamw: adam,
                },
                lr_schedule: Some(schedule),
                loss_scaler: None,
                data_loader: None,
                run: serde_json::to_value(cfg).ok(),
                source: None,
                files: Vec::new(),
                tensors: Vec::new(),
                tokenizer: None,
                tokenizer_source: Some(tokenizer.to_path_buf()),
                lora: None,
                base_model: None,
                quantize_base: None,
                checksum: None,
            },
        })
    }

    /// LoRA: the checkpoints hold the adapters of `lora`, trained on `base_model` (quantized as
    /// `quantized` says).
    pub fn with_lora(
        mut self,
        lora: Option<&LoraConfig>,
        base_model: String,
        quantized: Option<BaseQuantization>,
    ) -> Self {
        if let Some(l) = lora {
            self.template.lora = Some(l.clone());
            self.template.base_model = Some(base_model);
            self.template.quantize_base = quantized;
        }
        self
    }

    /// Whether to save after `steps_done` steps: every `every` steps, and at the end.
    pub fn due(&self, steps_done: usize) -> bool {
        steps_done == self.total_steps || self.every > 0 && steps_done.is_multiple_of(self.every)
    }

    /// The manifest of the checkpoint after `steps_done` steps, the data loader then at
    /// `data_loader` (files and tensors are filled in when it is committed).
    pub fn manifest(
        &self,
        steps_done: usize,
        optimizer_step: u64,
        loss_scaler: Option<(f64, usize)>,
        data_loader: serde_json::Value,
    ) -> Manifest {
        let mut m = self.template.clone();
        m.step = steps_done;
        m.optimizer.step = optimizer_step;
        m.loss_scaler =
            loss_scaler.map(|(scale, clean_steps)| LossScalerState { scale, clean_steps });
        m.data_loader = Some(data_loader);
        m
    }
}

/// What device `dev` (rank `rank` of `layout`) saves: its holdings, each with its master values
/// and moments.
pub fn device_arrays(
    cfg: &ModelConfig,
    lora: Option<&LoraConfig>,
    layout: &Layout,
    dev: &Device,
) -> Result<Vec<RankArrays>> {
    let holdings = rank_holdings(cfg, lora, layout, dev.rank)?;
    if holdings.is_empty() {
        return Ok(Vec::new());
    }
    let specs = dev.zero.specs();
    let with_moments = dev.zero.optimizer_step() > 0;
    // The device's tensors it keeps (a replica keeps nothing of what an earlier one keeps whole).
    let kept: Vec<_> = dev
        .zero
        .owned_state()
        .into_iter()
        .zip(specs)
        .filter(|(_, spec)| holdings.iter().any(|h| h.name == spec.name))
        .collect();
    if kept.len() != holdings.len() {
        return Err(EngineError::Invalid(format!(
            "checkpoint: device {} keeps {} tensors, the layout says {}",
            dev.rank,
            kept.len(),
            holdings.len()
        )));
    }
    holdings
        .into_iter()
        .zip(kept)
        .map(|(h, (s, spec))| {
            if h.name != spec.name || h.flat != s.flat {
                return Err(EngineError::Invalid(format!(
                    "checkpoint: device {} holds `{}` {:?}, the layout says `{}` {:?}",
                    dev.rank, spec.name, s.flat, h.name, h.flat
                )));
            }
            Ok(RankArrays {
                holding: h,
                param: s.master,
                moments: with_moments.then_some((s.exp_avg, s.exp_avg_sq)),
            })
        })
        .collect()
}

/// Restores device `dev`'s optimizer state from `ck`: each tensor's moments over the range it owns.
pub fn restore_device(ck: &Checkpoint, cfg: &ModelConfig, dev: &mut Device) -> Result<()> {
    let specs = dev.zero.specs();
    let ranges = dev.zero.owned_ranges();
    let moments = specs
        .iter()
        .zip(ranges)
        .map(|(spec, flat)| {
            let slice = dev.shard.slice(cfg, &spec.name)?;
            Ok((
                ck.read(&spec.name, Kind::ExpAvg, &slice, flat.clone())?,
                ck.read(&spec.name, Kind::ExpAvgSq, &slice, flat)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    dev.zero
        .restore_optimizer(ck.manifest.optimizer.step, moments);
    Ok(())
}

/// A device's saves: each in the step that is due (synchronous), or (`checkpoint_async`) started
/// there — the state already copied — and written by a thread while training goes on. At most
/// one save is in flight; it is committed (`latest` moved) once every rank's file is written.
pub(super) struct Saver {
    asynchronous: bool,
    pending: Option<PendingSave>,
}

/// A save in flight: this device's file being written by `writer`.
struct PendingSave {
    step: usize,
    written_in: std::path::PathBuf,
    writer: std::thread::JoinHandle<Result<RankFile>>,
    /// Rank 0's manifest, committed when every file is written.
    manifest: Option<Manifest>,
}

impl Saver {
    pub(super) fn new(asynchronous: bool) -> Self {
        Self {
            asynchronous,
            pending: None,
        }
    }

    /// Saves the checkpoint after `done` steps: `arrays` are this device's state (copies),
    /// `manifest` rank 0's. `now` makes it synchronous (a run that stops after this step).
    pub(super) fn save<C: Comm>(
        &mut self,
        c: &mut C,
        plan: &CheckpointPlan,
        done: usize,
        arrays: Vec<RankArrays>,
        manifest: Option<Manifest>,
        now: bool,
    ) -> Result<()> {
        self.finish(c, plan)?;
        if !self.asynchronous || now {
            return save_distributed(c, &plan.root, done, &arrays, manifest, plan.keep);
        }
        let written_in = begin_save(c, &plan.root, done)?;
        let (root, dir, rank) = (plan.root.clone(), written_in.clone(), c.rank());
        let writer = std::thread::spawn(move || write_own(&root, &dir, rank, done, &arrays));
        self.pending = Some(PendingSave {
            step: done,
            written_in,
            writer,
            manifest,
        });
        Ok(())
    }

    /// After a step with a save in flight: every rank says whether its file is written (one
    /// all-reduce); when all are, the save is committed.
    pub(super) fn poll<C: Comm>(&mut self, c: &mut C, plan: &CheckpointPlan) -> Result<()> {
        let Some(p) = &self.pending else {
            return Ok(());
        };
        let mut writing = [f64::from(!p.writer.is_finished())];
        let world = Group::new("world", (0..c.world_size()).collect());
        c.all_reduce(&world, &mut writing, ReduceOp::Sum)?;
        if writing[0] == 0.0 {
            self.finish(c, plan)?;
        }
        Ok(())
    }

    /// Waits for the save in flight (if any) and commits it.
    pub(super) fn finish<C: Comm>(&mut self, c: &mut C, plan: &CheckpointPlan) -> Result<()> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let written = p.writer.join().unwrap_or_else(|_| {
            Err(EngineError::Invalid(format!(
                "checkpoint of step {}: the thread writing it panicked",
                p.step
            )))
        });
        finish_save(
            c,
            &plan.root,
            p.step,
            &p.written_in,
            written,
            p.manifest,
            plan.keep,
        )
    }
}

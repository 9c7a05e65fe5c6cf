//! A training run on one layout: everything its devices share (settings, model, what trains, the
//! batches, the checkpoint plan, the resume point), and the mesh step it builds from them.

use super::checkpointing::CheckpointPlan;
use super::config::TrainConfig;
use super::lora_run::BaseWeights;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::WeightSource;
use crate::parallel::{LossScaling, MeshStep, Resume};
use crate::transformer::{ParamStore, TokenBatch, Trained};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig, ParamSpec};
use ferrotron_core::plan::{Plan, PlanInput};
use ferrotron_core::schedule::StagePartition;

/// Everything a run on one layout needs.
pub(super) struct TrainingRun<'a> {
    pub cfg: &'a TrainConfig,
    pub model_cfg: &'a ModelConfig,
    /// What trains, where each device reads its shard from: the model's parameters (in memory, or
    /// where the model is stored), or LoRA adapters.
    pub weights: &'a dyn WeightSource,
    /// LoRA: the frozen base and the adapters' configuration.
    pub lora: Option<(&'a BaseWeights, &'a LoraConfig)>,
    pub layout: Layout,
    pub input: &'a PlanInput,
    /// The planner's evaluation of `layout` (made once, when the layout was resolved): its
    /// per-stage memory is what every device's measurement is put beside.
    pub plan: &'a Plan,
    /// Every step's global batch from `start` on (the same for every device).
    pub batches: &'a [TokenBatch],
    pub val_batches: &'a [TokenBatch],
    pub adam: AdamWConfig,
    pub schedule: LrSchedule,
    /// The first step to run (0, or where the run resumes); `batches` starts there.
    pub start: usize,
    /// The data loader's position after each step's batch, from `start` on.
    pub loader_after: &'a [serde_json::Value],
    pub checkpoints: &'a CheckpointPlan,
    /// The checkpoint the run resumes from (the devices' optimizer state comes from it).
    pub resume: Option<&'a Checkpoint>,
    /// Kernel threads per device (more than one only for a device with the process to itself).
    pub kernel_threads: usize,
}

impl TrainingRun<'_> {
    /// The parameters that train: the model's, or the adapters'.
    pub fn trained_parameters(&self) -> usize {
        self.weights.specs().iter().map(ParamSpec::numel).sum()
    }

    /// What trains, once the devices' shards are gathered into `params` (with LoRA, on the whole
    /// base).
    pub fn trained<'p>(&'p self, params: &'p ParamStore) -> Result<Trained<'p>> {
        let lora = match self.lora {
            Some((base, lora)) => Some((base.whole()?, lora)),
            None => None,
        };
        Ok(Trained { params, lora })
    }

    /// The batch of (0-based) step `k`.
    pub fn batch(&self, k: usize) -> &TokenBatch {
        &self.batches[k - self.start]
    }

    pub(super) fn is_eval(&self, step: usize) -> bool {
        let cfg = self.cfg;
        cfg.logging.eval_every > 0 && (step + 1).is_multiple_of(cfg.logging.eval_every)
            || step + 1 == cfg.optimizer.steps
    }

    /// The mesh step of this run, with its precision, resume point, drills and threads.
    pub(super) fn mesh_step<'s>(
        &'s self,
        partition: &'s StagePartition,
        restore: &'s (dyn Fn(&mut crate::parallel::Device) -> Result<()> + Sync),
    ) -> Result<MeshStep<'s>> {
        let cfg = self.cfg;
        let step = MeshStep::new(
            self.model_cfg,
            self.weights,
            self.batch(self.start),
            &self.layout,
            partition,
        )?;
        let step = match self.lora {
            Some((base, lora)) => step.with_lora(base.shards(), lora),
            None => step,
        };
        Ok(step
            .with_resume(self.resume.map(|ck| Resume {
                step: self.start,
                loss_scaler: ck.manifest.loss_scaler.map(|s| (s.scale, s.clean_steps)),
                restore,
            }))
            .with_slow_device(
                cfg.logging
                    .slow_device
                    .map(|d| (d, cfg.logging.slow_device_ms / 1e3)),
            )
            .with_kernel_threads(self.kernel_threads)
            .with_precision(cfg.numerics.precision)
            .with_loss_scaling(LossScaling {
                initial: cfg.numerics.loss_scale,
                growth_interval: cfg.numerics.loss_scale_window,
                inject_nonfinite_at: cfg.numerics.inject_nonfinite_step,
            }))
    }
}

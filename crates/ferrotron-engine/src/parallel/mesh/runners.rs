//! One step of a whole mesh on the threads backend, run and gathered: what `grads`, `verify`,
//! `profile` and the tests compare with the unsplit model.

use super::MeshStep;
use crate::comm::ThreadWorld;
use crate::error::{EngineError, Result};
use crate::parallel::PipelineRun;
use crate::transformer::{ParamStore, TokenBatch, Trained};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::StagePartition;
use std::time::Duration;

/// One forward and backward of `batch` through a pipeline of `partition.stages()` stages (each a
/// tensor-parallel group of `layout.tp` devices), in micro-batches of `layout.micro_batch_size`
/// sequences, on the threads backend.
pub fn pipeline_step(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    partition: &StagePartition,
    timeout: Duration,
) -> Result<PipelineRun> {
    pipeline_steps(cfg, params, batch, layout, partition, timeout, 0)
}

/// As [`pipeline_step`], after running the same step `warmup` times on the same stages (discarded):
/// what a profile measures, with first-touch allocation out of the way.
#[allow(clippy::too_many_arguments)]
pub fn pipeline_steps(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    partition: &StagePartition,
    timeout: Duration,
    warmup: usize,
) -> Result<PipelineRun> {
    let trained = Trained::full(params);
    pipeline_steps_of(cfg, trained, batch, layout, partition, timeout, warmup)
}

/// [`pipeline_steps`] of what `trained` says trains (the whole model, or LoRA adapters on its
/// frozen base).
#[allow(clippy::too_many_arguments)]
pub fn pipeline_steps_of(
    cfg: &ModelConfig,
    trained: Trained,
    batch: &TokenBatch,
    layout: &Layout,
    partition: &StagePartition,
    timeout: Duration,
    warmup: usize,
) -> Result<PipelineRun> {
    let accounts = crate::memory::Accounts::claim(layout.world_size());
    let step = MeshStep::new(cfg, trained.params, batch, layout, partition)?
        .with_account_base(accounts.base);
    let step = match trained.lora {
        Some((base, lora)) => step.with_lora(base, lora),
        None => step,
    };
    let wall = std::time::Instant::now();
    let results = ThreadWorld::new(step.world())
        .timeout(timeout)
        .run(|c| step.run_device(c, warmup));
    let wall_time_s = wall.elapsed().as_secs_f64();
    let results = results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            res.map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?
                .map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    step.combine(results, wall_time_s)
}

use crate::comm::Comm;
use crate::comm::ThreadWorld;
use crate::error::{EngineError, Result};
use crate::kernels::Backend;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::{pipeline_steps_of, MeshStep, PipelineRun, Training};
use crate::transformer::{ParamStore, TokenBatch, Trained, Transformer};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_core::schedule::StagePartition;
use std::time::Duration;

#[derive(Debug)]
pub struct StepOutput {
    /// Mean loss over every predicted token of the batch.
    pub loss: f64,
    /// Largest activation stash of any micro-batch, in bytes.
    pub peak_activation_bytes: usize,
}

/// Forward and backward of `batch` in micro-batches of `micro_batch_size` sequences, gradients
/// accumulated into `grads` so the result equals one pass over the whole batch.
pub fn run_step(
    tf: &Transformer,
    be: &dyn Backend,
    params: &ParamStore,
    grads: &mut ParamStore,
    batch: &TokenBatch,
    micro_batch_size: usize,
) -> Result<StepOutput> {
    let mbs = micro_batch_size.max(1);
    if !batch.batch.is_multiple_of(mbs) {
        return Err(EngineError::Invalid(format!(
            "batch size {} is not divisible by the micro-batch size {mbs}",
            batch.batch
        )));
    }
    let total = batch.predicted_tokens().max(1);
    let scale = 1.0 / total as f32;
    let (mut loss_sum, mut peak) = (0.0, 0);
    for mb in batch.ids.chunks(mbs * batch.seq) {
        let micro = TokenBatch {
            ids: mb.to_vec(),
            batch: mbs,
            seq: batch.seq,
        };
        let state = tf.forward(be, params, &micro);
        peak = peak.max(state.stashed_bytes());
        loss_sum += tf.backward(be, params, grads, state, &micro.targets(), scale);
    }
    Ok(StepOutput {
        loss: loss_sum / total as f64,
        peak_activation_bytes: peak,
    })
}

/// Loss and gathered gradients of one step of `batch` under `layout`: through the mesh runtime when
/// `pp > 1` or `tp > 1` (its run returned too), else on this device in micro-batches, with the
/// layout's recompute.
pub fn layout_step(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    be: &dyn Backend,
) -> Result<(f64, ParamStore, Option<PipelineRun>)> {
    layout_step_of(cfg, Trained::full(params), batch, layout, be)
}

/// [`layout_step`] of what `trained` says trains (the whole model, or LoRA adapters on its frozen
/// base); the gradients are of `trained.params`.
pub fn layout_step_of(
    cfg: &ModelConfig,
    trained: Trained,
    batch: &TokenBatch,
    layout: &Layout,
    be: &dyn Backend,
) -> Result<(f64, ParamStore, Option<PipelineRun>)> {
    batch.check(cfg).map_err(EngineError::Invalid)?;
    if !layout.is_single_device() || layout.zero > 0 {
        // Every device a thread, each stage's layers as the layout names them or chosen by compute.
        let partition = StagePartition::for_layout(cfg, layout)?;
        let mut run = pipeline_steps_of(
            cfg,
            trained,
            batch,
            layout,
            &partition,
            Duration::from_secs(600),
            0,
        )?;
        let grads = std::mem::replace(&mut run.grads, ParamStore::zeros(Vec::new()));
        return Ok((run.loss, grads, Some(run)));
    }
    let tf = trained.unsplit(cfg).with_recompute(layout.recompute);
    let mut grads = trained.params.zeros_like();
    let out = run_step(
        &tf,
        be,
        trained.params,
        &mut grads,
        batch,
        layout.micro_batch_size.min(batch.batch),
    )?;
    Ok((out.loss, grads, None))
}

/// [`layout_step_of`] with one device per process (MPI): this process runs device `c.rank()` of the
/// mesh; rank 0 returns the loss and gathered gradients, every other rank `None`.
pub fn layout_step_on<C: Comm>(
    c: &mut C,
    cfg: &ModelConfig,
    trained: Trained,
    batch: &TokenBatch,
    layout: &Layout,
) -> Result<Option<(f64, ParamStore, PipelineRun)>> {
    let partition = StagePartition::for_layout(cfg, layout)?;
    let step = MeshStep::new(cfg, trained.params, batch, layout, &partition)?;
    let step = match trained.lora {
        Some((base, lora)) => step.with_lora(base, lora),
        None => step,
    };
    Ok(step.run_collected(c)?.map(|mut run| {
        let grads = std::mem::replace(&mut run.grads, ParamStore::zeros(Vec::new()));
        (run.loss, grads, run)
    }))
}

/// The parameters after `batches.len()` optimizer steps of `params` under `layout` on the threads
/// backend (one batch per step; the pipeline drained after each step `drain_after` names, for an
/// asynchronous schedule), gathered whole, under the precision policy `precision` (the master
/// weights are returned).
#[allow(clippy::too_many_arguments)]
pub fn train_steps(
    cfg: &ModelConfig,
    params: &ParamStore,
    layout: &Layout,
    batches: &[TokenBatch],
    adam: AdamWConfig,
    lr: &LrSchedule,
    clip: f64,
    drain_after: &(dyn Fn(usize) -> bool + Sync),
    precision: MixedPrecision,
) -> Result<ParamStore> {
    let partition = StagePartition::for_layout(cfg, layout)?;
    let first = batches
        .first()
        .ok_or_else(|| EngineError::Invalid("no steps to train".into()))?;
    let accounts = crate::memory::Accounts::claim(layout.world_size());
    let results = ThreadWorld::new(layout.world_size())
        .timeout(Duration::from_secs(600))
        .run(|c| {
            let mut step = MeshStep::new(cfg, params, first, layout, &partition)?
                .with_account_base(accounts.base)
                .with_drain_after(drain_after)
                .with_precision(precision);
            let mut dev = step.train_device(
                c,
                &Training {
                    steps: batches.len(),
                    batch_of: &|k| batches[k].clone(),
                    adam,
                    lr,
                    clip,
                    stop: &|| false,
                },
                &mut |_, _, _, _| Ok(()),
            )?;
            step.gather_params(c, &mut dev)
        });
    let mut whole = None;
    for (r, res) in results.into_iter().enumerate() {
        let out = res
            .map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?
            .map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?;
        whole = whole.or(out);
    }
    whole.ok_or_else(|| EngineError::Invalid("device 0 gathered no parameters".into()))
}

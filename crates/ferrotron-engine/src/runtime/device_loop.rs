//! What every device of a training run does, whatever runs it (a thread, or an MPI rank): build its
//! shard, train through the steps, send its figures to device 0, evaluate and checkpoint when due,
//! and finally gather the trained model onto device 0. The unsplit model is the 1×1×1 mesh and runs
//! here too.

use super::checkpointing::{device_arrays, restore_device, Saver};
use super::config::TrainConfig;
use super::metrics::{collect_figures, Figures, StepFigures};
use super::training_run::TrainingRun;
use crate::comm::{Comm, Group};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::memory::{self, format_terms, MemoryTerms};
use crate::parallel::{MeshStep, Training};
use crate::transformer::{ParamStore, TokenBatch, Trained};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::StagePartition;

/// The validation loss of the whole model `params`: the host's work, not a device's, so it is kept
/// off the device's memory account.
pub(super) fn validation_loss(
    model: &ModelConfig,
    trained: Trained,
    batches: &[TokenBatch],
    threads: usize,
) -> Option<f64> {
    if batches.is_empty() {
        return None; // nothing held out: no figure, rather than a loss of 0 over nothing
    }
    let tf = trained.unsplit(model);
    let be = CpuBackend::with_threads(threads);
    let (mut sum, mut n) = (0.0, 0usize);
    for b in batches {
        sum += tf.loss(&be, trained.params, b) * b.predicted_tokens() as f64;
        n += b.predicted_tokens();
    }
    Some(sum / n.max(1) as f64)
}

/// Runs one device of the mesh through the whole training (every device calls it). Device 0
/// receives every step's figures and hands them to `sink`; it returns the trained model, gathered.
pub(super) fn run_device<C: Comm>(
    run: &TrainingRun,
    partition: &StagePartition,
    c: &mut C,
    account_base: usize,
    sink: &mut dyn FnMut(StepFigures) -> Result<()>,
) -> Result<Option<ParamStore>> {
    let cfg = run.cfg;
    let account = account_base + c.rank();
    memory::set_capacity(account, capacity(cfg)?);
    let restore = |dev: &mut crate::parallel::Device| match run.resume {
        Some(ck) => restore_device(ck, run.model_cfg, dev),
        None => Ok(()),
    };
    // Asynchronous schedules drain before each evaluation and checkpoint.
    let drain = |k: usize| run.is_eval(k) || run.checkpoints.due(k + 1);
    let mut step = run
        .mesh_step(partition, &restore)?
        .with_account_base(account_base)
        .with_drain_after(&drain);
    let world = step.world();
    let mut dev = step.build_device(c, run.adam)?;
    let model_bytes_read = dev.model_bytes_read;
    // The validation loss before the first step, of the devices' shards gathered (no process
    // holds the whole model before this, wherever it was read from).
    let mut initial_val_loss = evaluate(run, &step, c, &mut dev, account)?;
    let training = Training {
        steps: cfg.optimizer.steps,
        batch_of: &|k| run.batch(k).clone(),
        adam: run.adam,
        lr: &run.schedule,
        clip: cfg.optimizer.grad_clip,
        stop: &|| super::preemption::received().is_some(),
    };
    let hang = cfg.inject_hang()?.filter(|&(rank, _)| rank == c.rank());
    let mut saver = Saver::new(cfg.checkpointing.checkpoint_async);
    let trained = step.train_built(c, &training, dev, &mut |mesh, c, dev, report| {
        let mut mine = Figures::of(report);
        mine.model_bytes_read = model_bytes_read;
        mine.expert_weight_bytes = mesh.expert_weight_bytes(dev);
        let eval_started = std::time::Instant::now();
        let val_loss = if run.is_eval(report.step) {
            evaluate(run, mesh, c, dev, account)?
        } else {
            None
        };
        let eval_s = eval_started.elapsed().as_secs_f64();
        let done = report.step + 1;
        // Asked to stop: this step's checkpoint is saved (if it was not due anyway, and at once),
        // then every device ends the run here. The time the save holds this device is its stall.
        if run.checkpoints.due(done) || report.stop {
            // Every device at the save together: the stall is the save's, not a peer's step.
            c.barrier(&Group::new("world", (0..world).collect()))?;
            let save_started = std::time::Instant::now();
            // The copies a save makes are the host's, not the device's.
            memory::clear_device();
            let saved = save_checkpoint(run, mesh, c, dev, done, &mut saver, report.stop);
            memory::set_device(account);
            mine.checkpoint_snapshot_bytes = saved?;
            mine.checkpoint_stall_s = save_started.elapsed().as_secs_f64();
        } else {
            saver.poll(c, run.checkpoints)?;
        }
        if let Some(devices) = collect_figures(c, world, mine)? {
            sink(StepFigures {
                devices,
                step: report.step,
                loss: report.loss,
                grad_norm: report.grad_norm,
                lr: report.lr,
                val_loss,
                eval_s,
                loss_scale: report.loss_scale,
                skipped: report.skipped,
                initial_val_loss: initial_val_loss.take(),
                expert_tokens: report.expert_tokens.clone(),
            })?;
        }
        if let Some((rank, at)) = hang.filter(|&(_, at)| at == done) {
            // The drill: stop answering for twice the time the others wait, then give up too.
            let timeout = cfg.parallelism.peer_timeout.unwrap_or(60.0);
            std::thread::sleep(std::time::Duration::from_secs_f64(2.0 * timeout));
            return Err(EngineError::Invalid(format!(
                "device {rank} stopped answering after step {at} (the --inject-hang drill)"
            )));
        }
        if report.stop {
            let dir = run
                .checkpoints
                .root
                .join(&crate::checkpoint::step_dir_name(done));
            return Err(EngineError::Preempted {
                signal: super::preemption::received().unwrap_or(libc::SIGTERM),
                step: done,
                saved: format!(
                    "its checkpoint is {dir}; continue the run with --resume {}",
                    run.checkpoints.root
                ),
            });
        }
        Ok(())
    });
    // The last save, when it is still being written.
    let trained = trained.and_then(|dev| saver.finish(c, run.checkpoints).map(|_| dev));
    let mut dev = match trained {
        Ok(dev) => dev,
        Err(e) => {
            // A device that gave up on a peer (or the drill's): its flight records, for the
            // reporting process to say who was behind.
            if matches!(e, EngineError::Comm(_)) || hang.is_some() {
                let records = c.flight_records();
                super::hang::write(&cfg.checkpointing.out_dir, c.rank(), &e, records);
            }
            return Err(e);
        }
    };
    let full = step.gather_params(c, &mut dev)?;
    memory::set_capacity(account, None);
    memory::clear_device();
    Ok(full)
}

/// The validation loss of the model as the devices hold it now (on device 0; `None` elsewhere and
/// when nothing is held out): their shards gathered, evaluated off the device's memory account.
fn evaluate<C: Comm>(
    run: &TrainingRun,
    mesh: &MeshStep,
    c: &mut C,
    dev: &mut crate::parallel::Device,
    account: usize,
) -> Result<Option<f64>> {
    if run.val_batches.is_empty() {
        return Ok(None);
    }
    // The gathered model is the host's, not the device's: it is not counted against the device's
    // capacity (device 0 would otherwise hold the whole model beside its shard).
    memory::clear_device();
    let v = match mesh.gather_params(c, dev) {
        Ok(Some(p)) => run.trained(&p).map(|trained| {
            validation_loss(run.model_cfg, trained, run.val_batches, run.kernel_threads)
        }),
        other => other.map(|_| None),
    };
    memory::set_device(account);
    v
}

/// Every device writes its part of the checkpoint after `done` steps; device 0 the manifest
/// (`now`: at once, whether or not saves are asynchronous). Returns the bytes of the copy of this
/// device's state the save took.
fn save_checkpoint<C: Comm>(
    run: &TrainingRun,
    mesh: &MeshStep,
    c: &mut C,
    dev: &crate::parallel::Device,
    done: usize,
    saver: &mut Saver,
    now: bool,
) -> Result<u64> {
    let arrays = device_arrays(run.model_cfg, mesh.lora(), &run.layout, dev)?;
    let copied = arrays
        .iter()
        .map(|a| a.param.len() + a.moments.as_ref().map_or(0, |(m, v)| m.len() + v.len()))
        .sum::<usize>() as u64
        * 4;
    let manifest = (c.rank() == 0).then(|| {
        run.checkpoints.manifest(
            done,
            dev.zero.optimizer_step(),
            mesh.loss_scaler(),
            run.loader_after[done - 1 - run.start].clone(),
        )
    });
    saver.save(c, run.checkpoints, done, arrays, manifest, now)?;
    Ok(copied)
}

/// Each device's coordinates.
pub(super) type Coords = Vec<ferrotron_core::rank::Coords>;

/// The partition, the device coordinates and the planner's per-stage prediction of a run.
pub(super) fn layout_facts(
    run: &TrainingRun,
) -> Result<(StagePartition, Coords, Vec<MemoryTerms>)> {
    let layout = run.layout;
    let partition = StagePartition::for_layout(run.model_cfg, &layout)?;
    let grid = layout.rank_grid(run.input.cluster.devices_per_node);
    let coords = (0..layout.world_size()).map(|r| grid.coords(r)).collect();
    Ok((partition, coords, run.plan.memory_bytes_per_stage.clone()))
}

fn capacity(cfg: &TrainConfig) -> Result<Option<u64>> {
    cfg.parallelism
        .device_memory
        .as_deref()
        .map(super::config::parse_bytes)
        .transpose()
}

/// An out-of-memory error beside the planner's prediction for the same device's stage.
pub(super) fn with_prediction(
    e: EngineError,
    layout: &Layout,
    coords: &[ferrotron_core::rank::Coords],
    predicted: &[MemoryTerms],
) -> EngineError {
    match e {
        EngineError::OutOfMemory {
            device,
            capacity,
            at,
        } => {
            let s = coords.get(device).map_or(0, |c| c.pp);
            EngineError::RunOutOfMemory(format!(
                "{}\nthe planner predicted for this layout (`{layout}`), stage {s}:\n{}",
                EngineError::OutOfMemory {
                    device,
                    capacity,
                    at
                },
                format_terms(&predicted[s])
            ))
        }
        other => other,
    }
}

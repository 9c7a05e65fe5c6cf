//! Training on a device mesh (threads backend): every device a thread that keeps its shard, its
//! gradients and its optimizer state across steps. Device 0 gathers each step's per-device figures
//! and the main thread writes them to `metrics.jsonl` beside the planner's predictions.

use super::train::{mean_loss, DeviceSummary, StepReport, TrainConfig};
use crate::comm::{Comm, ThreadWorld};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::memory::{self, format_terms, MemoryTerms};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::{MeshStep, StepReport as DeviceStep};
use crate::transformer::{ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{evaluate, PlanInput};
use ferrotron_core::schedule::StagePartition;
use std::io::Write;
use std::path::Path;
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// Everything a mesh run needs.
pub(super) struct MeshTraining<'a> {
    pub cfg: &'a TrainConfig,
    pub model_cfg: &'a ModelConfig,
    pub params: &'a ParamStore,
    pub layout: Layout,
    pub input: &'a PlanInput,
    /// Every step's global batch (the same for every device).
    pub batches: &'a [TokenBatch],
    pub val_batches: &'a [TokenBatch],
    pub adam: AdamWConfig,
    pub schedule: LrSchedule,
    pub initial_val_loss: f64,
}

pub(super) struct MeshOutcome {
    pub params: ParamStore,
    pub last_loss: f64,
    pub last_val: f64,
    pub tokens_per_s: f64,
    pub devices: Vec<DeviceSummary>,
}

/// What device 0 hands the main thread after each step.
enum Event {
    Step {
        reports: Vec<DeviceStep>,
        val_loss: Option<f64>,
    },
    Finished(Vec<crate::comm::CommResult<Result<Option<ParamStore>>>>),
}

pub(super) fn train_mesh(
    run: &MeshTraining,
    metrics: &mut std::fs::File,
    metrics_path: &Path,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<MeshOutcome> {
    let (cfg, layout) = (run.cfg, run.layout);
    let partition = StagePartition::for_model(run.model_cfg, layout.pp * layout.vpp)?;
    let world = layout.world_size();
    if world > memory::MAX_DEVICES {
        return Err(EngineError::Invalid(format!(
            "layout `{layout}` has {world} devices; one process accounts for at most {}",
            memory::MAX_DEVICES
        )));
    }
    // The planner's prediction for every stage, beside which the measurements are reported.
    let plan = evaluate(run.input, &layout)?;
    let predicted = plan.memory_bytes_per_stage.clone();
    let capacity = cfg
        .device_memory
        .as_deref()
        .map(super::train::parse_bytes)
        .transpose()?;
    let mesh = MeshStep::new(
        run.model_cfg,
        run.params,
        &run.batches[0],
        &layout,
        &partition,
    )?;
    let coords: Vec<(usize, usize, usize)> = (0..world).map(|r| mesh.mesh().coords(r)).collect();
    drop(mesh);

    let (tx, rx) = mpsc::channel::<Event>();
    let tx = Mutex::new(tx);
    let slots: Mutex<Vec<Option<DeviceStep>>> = Mutex::new(vec![None; world]);
    let is_eval = |step: usize| {
        cfg.eval_every > 0 && (step + 1).is_multiple_of(cfg.eval_every) || step + 1 == cfg.steps
    };
    let accounts = memory::Accounts::claim(world);
    let device_body = |c: &mut crate::comm::ThreadComm| -> Result<Option<ParamStore>> {
        let account = accounts.base + c.rank();
        memory::set_capacity(account, capacity);
        let mut step = MeshStep::new(
            run.model_cfg,
            run.params,
            &run.batches[0],
            &layout,
            &partition,
        )?
        .with_account_base(accounts.base);
        let everyone = step.mesh().world();
        let dev = step.train_device(
            c,
            cfg.steps,
            &|k| run.batches[k].clone(),
            run.adam,
            &run.schedule,
            cfg.grad_clip,
            &mut |mesh, c, dev, report| {
                slots.lock().expect("no panics")[c.rank()] = Some(report.clone());
                c.barrier(&everyone)?;
                let val_loss = if is_eval(report.step) {
                    let full = mesh.gather_params(c, dev)?;
                    full.map(|p| {
                        // Validation is the host's work, not a device's: keep it off the accounts.
                        memory::clear_device();
                        let tf = Transformer::new(run.model_cfg, &p);
                        let v = mean_loss(&tf, &CpuBackend::single_threaded(), &p, run.val_batches);
                        memory::set_device(account);
                        v
                    })
                } else {
                    None
                };
                if c.rank() == 0 {
                    let reports = slots
                        .lock()
                        .expect("no panics")
                        .iter_mut()
                        .map(|s| s.take().expect("every device reported"))
                        .collect();
                    let _ = tx
                        .lock()
                        .expect("no panics")
                        .send(Event::Step { reports, val_loss });
                }
                c.barrier(&everyone)?;
                Ok(())
            },
        )?;
        let full = step.gather_params(c, &dev)?;
        memory::set_capacity(account, None);
        memory::clear_device();
        Ok(full)
    };

    let mut outcome = None;
    let (mut last_loss, mut last_val) = (f64::NAN, run.initial_val_loss);
    let (mut tokens, mut seconds) = (0usize, 0.0);
    let mut summaries: Vec<DeviceSummary> = coords
        .iter()
        .enumerate()
        .map(|(r, &(t, d, s))| DeviceSummary {
            device: r,
            stage: s,
            dp_rank: d,
            tp_rank: t,
            peak_memory_bytes: MemoryTerms::default(),
            predicted_memory_bytes: predicted[s],
            idle_fraction: 0.0,
            bytes_sent_per_step: 0,
            step_time_s: 0.0,
            wall_step_time_s: 0.0,
        })
        .collect();
    std::thread::scope(|scope| -> Result<()> {
        let tx_ref = &tx;
        scope.spawn(move || {
            let results = ThreadWorld::new(world)
                .timeout(Duration::from_secs(600))
                .run(device_body);
            let _ = tx_ref
                .lock()
                .expect("no panics")
                .send(Event::Finished(results));
        });
        let mut last_wall = Instant::now();
        for event in rx.iter() {
            match event {
                Event::Step { reports, val_loss } => {
                    let r0 = &reports[0];
                    let dt = last_wall.elapsed().as_secs_f64();
                    last_wall = Instant::now();
                    let batch_tokens = run.batches[r0.step].batch * run.batches[r0.step].seq;
                    tokens += batch_tokens;
                    seconds += dt;
                    last_loss = r0.loss;
                    if let Some(v) = val_loss {
                        last_val = v;
                    }
                    let devices: Vec<serde_json::Value> = reports
                        .iter()
                        .zip(summaries.iter_mut())
                        .map(|(r, sum)| device_json(r, sum, dt))
                        .collect();
                    let memory = reports
                        .iter()
                        .map(|r| r.memory.peak_terms())
                        .max_by_key(|m| m.total)
                        .expect("a device");
                    let report = StepReport {
                        step: r0.step + 1,
                        total_steps: cfg.steps,
                        loss: r0.loss,
                        lr: r0.lr,
                        grad_norm: r0.grad_norm,
                        tokens_per_s: batch_tokens as f64 / dt,
                        step_time_s: dt,
                        val_loss,
                        memory,
                    };
                    let line = serde_json::json!({
                        "step": report.step,
                        "loss": report.loss,
                        "lr": report.lr,
                        "grad_norm": report.grad_norm,
                        "tokens_per_s": report.tokens_per_s,
                        "step_time_s": report.step_time_s,
                        "val_loss": report.val_loss,
                        "layout": layout.to_string(),
                        "devices": devices,
                    });
                    writeln!(metrics, "{line}").map_err(|e| EngineError::io(metrics_path, e))?;
                    on_step(&report);
                }
                Event::Finished(results) => {
                    outcome = Some(results);
                    break;
                }
            }
        }
        Ok(())
    })?;
    let results = outcome.expect("the device threads report when they finish");
    let mut params = None;
    for (r, res) in results.into_iter().enumerate() {
        let res = res.map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?;
        match res {
            Ok(Some(p)) => params = Some(p),
            Ok(None) => {}
            Err(EngineError::OutOfMemory {
                device,
                capacity,
                at,
            }) => {
                let (_, _, s) = coords[device];
                return Err(EngineError::RunOutOfMemory(format!(
                    "{}\nthe planner predicted for this layout (`{layout}`), stage {s}:\n{}",
                    EngineError::OutOfMemory {
                        device,
                        capacity,
                        at
                    },
                    format_terms(&predicted[s])
                )));
            }
            Err(e) => return Err(EngineError::Invalid(format!("device {r}: {e}"))),
        }
    }
    let steps = cfg.steps.max(1) as f64;
    for s in summaries.iter_mut() {
        s.idle_fraction /= steps;
        s.step_time_s /= steps;
        s.wall_step_time_s /= steps;
    }
    Ok(MeshOutcome {
        params: params.expect("device 0 gathers the model"),
        last_loss,
        last_val,
        tokens_per_s: tokens as f64 / seconds.max(1e-9),
        devices: summaries,
    })
}

/// One device's figures for one step (and its running summary).
fn device_json(r: &DeviceStep, sum: &mut DeviceSummary, wall: f64) -> serde_json::Value {
    let peak = r.memory.peak_terms();
    let idle = if r.span_s > 0.0 {
        1.0 - r.busy_s / r.span_s
    } else {
        0.0
    };
    let by_group = |g: &str| r.stats.bytes_sent_by_group(g);
    let sent = r.stats.total().bytes_sent;
    let p = &mut sum.peak_memory_bytes;
    *p = MemoryTerms {
        weights: p.weights.max(peak.weights),
        gradients: p.gradients.max(peak.gradients),
        master_weights: p.master_weights.max(peak.master_weights),
        optimizer_states: p.optimizer_states.max(peak.optimizer_states),
        activations: p.activations.max(peak.activations),
        comm_buffers: p.comm_buffers.max(peak.comm_buffers),
        total: p.total.max(peak.total),
    };
    sum.idle_fraction += idle;
    sum.bytes_sent_per_step = sent;
    sum.step_time_s += r.span_s;
    sum.wall_step_time_s += wall;
    serde_json::json!({
        "device": sum.device,
        "stage": sum.stage,
        "dp_rank": sum.dp_rank,
        "tp_rank": sum.tp_rank,
        "peak_memory_bytes": peak,
        "predicted_memory_bytes": sum.predicted_memory_bytes,
        "other_memory_bytes": r.memory.peak_other(),
        "idle_fraction": idle,
        "bytes_sent": sent,
        // Pipeline traffic: the stage-to-stage transfers and the tied embedding's reduction.
        "bytes_sent_by_group": {
            "tp": by_group("tp"),
            "dp": by_group("dp"),
            "pp": by_group("p2p") + by_group("pp"),
        },
        "step_time_s": r.span_s,
        "wall_step_time_s": wall,
    })
}

//! Training on a device mesh: every device keeps its shard, its gradients and its optimizer state
//! across steps, on a thread of this process (threads backend) or in a process of its own (MPI).
//! After each step every device sends its figures to device 0, which writes them to `metrics.jsonl`
//! beside the planner's predictions.

use super::checkpointing::{device_arrays, restore_device, CheckpointPlan};
use super::train::{mean_loss, DeviceSummary, StepReport, TrainConfig};
use crate::checkpoint::{save_distributed, Checkpoint};
use crate::comm::{Comm, ThreadWorld};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::memory::{self, format_terms, DeviceMemory, MemoryTerms};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::{LossScaling, MeshStep, Resume, StepReport as DeviceStep};
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
    /// Every step's global batch from `start` on (the same for every device).
    pub batches: &'a [TokenBatch],
    pub val_batches: &'a [TokenBatch],
    pub adam: AdamWConfig,
    pub schedule: LrSchedule,
    pub initial_val_loss: f64,
    /// The first step to run (0, or where the run resumes); `batches` starts there.
    pub start: usize,
    /// The data loader's position after each step's batch, from `start` on.
    pub loader_after: &'a [serde_json::Value],
    pub checkpoints: &'a CheckpointPlan,
    /// The checkpoint the run resumes from (the devices' optimizer state comes from it).
    pub resume: Option<&'a Checkpoint>,
}

impl MeshTraining<'_> {
    /// The batch of (0-based) step `k`.
    fn batch(&self, k: usize) -> &TokenBatch {
        &self.batches[k - self.start]
    }
}

pub(super) struct MeshOutcome {
    pub params: ParamStore,
    pub last_loss: f64,
    pub last_val: f64,
    pub tokens_per_s: f64,
    pub devices: Vec<DeviceSummary>,
}

/// One device's figures for one step, as device 0 receives them.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    memory: DeviceMemory,
    busy_s: f64,
    span_s: f64,
    wall_s: f64,
    bytes_sent: u64,
    bytes_tp: u64,
    bytes_dp: u64,
    bytes_pp: u64,
}

const FIGURES: usize = 7 + 7 + 1 + 3 + 4;
/// Tag of the figures message (above any pipeline or gathering tag).
const FIGURES_TAG: u64 = 1 << 59;

impl Figures {
    fn of(r: &DeviceStep) -> Self {
        let by = |g: &str| r.stats.bytes_sent_by_group(g);
        Self {
            memory: r.memory,
            busy_s: r.busy_s,
            span_s: r.span_s,
            wall_s: r.wall_s,
            bytes_sent: r.stats.total().bytes_sent,
            bytes_tp: by("tp"),
            bytes_dp: by("dp"),
            // Pipeline traffic: the stage-to-stage transfers and the tied embedding's reduction.
            bytes_pp: by("p2p") + by("pp"),
        }
    }
    fn pack(&self) -> [f64; FIGURES] {
        let mut out = [0f64; FIGURES];
        for t in 0..7 {
            out[t] = self.memory.live[t] as f64;
            out[7 + t] = self.memory.peak[t] as f64;
        }
        out[14] = self.memory.peak_total as f64;
        out[15] = self.busy_s;
        out[16] = self.span_s;
        out[17] = self.wall_s;
        out[18] = self.bytes_sent as f64;
        out[19] = self.bytes_tp as f64;
        out[20] = self.bytes_dp as f64;
        out[21] = self.bytes_pp as f64;
        out
    }
    fn unpack(v: &[f64; FIGURES]) -> Self {
        let mut f = Self::default();
        for t in 0..7 {
            f.memory.live[t] = v[t] as u64;
            f.memory.peak[t] = v[7 + t] as u64;
        }
        f.memory.peak_total = v[14] as u64;
        (f.busy_s, f.span_s, f.wall_s) = (v[15], v[16], v[17]);
        (f.bytes_sent, f.bytes_tp, f.bytes_dp, f.bytes_pp) =
            (v[18] as u64, v[19] as u64, v[20] as u64, v[21] as u64);
        f
    }
}

/// What device 0 knows after a step: every device's figures, the step's numbers, the validation loss.
struct StepFigures {
    devices: Vec<Figures>,
    step: usize,
    loss: f64,
    grad_norm: f64,
    lr: f64,
    val_loss: Option<f64>,
    loss_scale: f64,
    skipped: bool,
}

/// Runs one device of the mesh through the whole training (every device calls it). Device 0
/// receives every step's figures and hands them to `sink`; it returns the trained model, gathered.
fn run_device<C: Comm>(
    run: &MeshTraining,
    partition: &StagePartition,
    c: &mut C,
    account_base: usize,
    capacity: Option<u64>,
    sink: &mut dyn FnMut(StepFigures) -> Result<()>,
) -> Result<Option<ParamStore>> {
    let cfg = run.cfg;
    let account = account_base + c.rank();
    memory::set_capacity(account, capacity);
    let restore = |dev: &mut crate::parallel::Device| match run.resume {
        Some(ck) => restore_device(ck, run.model_cfg, dev),
        None => Ok(()),
    };
    let mut step = MeshStep::new(
        run.model_cfg,
        run.params,
        run.batch(run.start),
        &run.layout,
        partition,
    )?
    .with_resume(run.resume.map(|ck| Resume {
        step: run.start,
        loss_scaler: ck.manifest.loss_scaler.map(|s| (s.scale, s.clean_steps)),
        restore: &restore,
    }))
    .with_account_base(account_base)
    .with_slow_device(cfg.slow_device.map(|d| (d, cfg.slow_device_ms / 1e3)))
    .with_precision(
        cfg.storage()?,
        (cfg.storage()? == Some(crate::transformer::Half::F16)).then_some(LossScaling {
            initial: cfg.loss_scale,
            growth_interval: cfg.loss_scale_window,
            inject_nonfinite_at: cfg.inject_nonfinite_step,
        }),
    );
    let world = step.world();
    let is_eval = |step: usize| {
        cfg.eval_every > 0 && (step + 1).is_multiple_of(cfg.eval_every) || step + 1 == cfg.steps
    };
    let dev = step.train_device(
        c,
        cfg.steps,
        &|k| run.batch(k).clone(),
        run.adam,
        &run.schedule,
        cfg.grad_clip,
        &mut |mesh, c, dev, report| {
            let mine = Figures::of(report);
            let val_loss = if is_eval(report.step) {
                mesh.gather_params(c, dev)?.map(|p| {
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
            if c.rank() != 0 {
                c.send(0, &mine.pack(), FIGURES_TAG)?;
            } else {
                let mut devices = vec![mine];
                for r in 1..world {
                    let mut v = [0f64; FIGURES];
                    c.recv(r, &mut v, FIGURES_TAG)?;
                    devices.push(Figures::unpack(&v));
                }
                sink(StepFigures {
                    devices,
                    step: report.step,
                    loss: report.loss,
                    grad_norm: report.grad_norm,
                    lr: report.lr,
                    val_loss,
                    loss_scale: report.loss_scale,
                    skipped: report.skipped,
                })?;
            }
            let done = report.step + 1;
            if run.checkpoints.due(done) {
                // The copies a save makes are the host's, not the device's.
                memory::clear_device();
                let saved = device_arrays(run.model_cfg, &run.layout, dev).and_then(|arrays| {
                    let manifest = (c.rank() == 0).then(|| {
                        run.checkpoints.manifest(
                            done,
                            dev.zero.optimizer_step(),
                            mesh.loss_scaler(),
                            run.loader_after[done - 1 - run.start].clone(),
                        )
                    });
                    let ck = run.checkpoints;
                    save_distributed(c, &ck.root, done, &arrays, manifest, ck.keep)
                });
                memory::set_device(account);
                saved?;
            }
            Ok(())
        },
    )?;
    let full = step.gather_params(c, &dev)?;
    memory::set_capacity(account, None);
    memory::clear_device();
    Ok(full)
}

/// Writes `metrics.jsonl` and keeps each device's running summary (device 0's side).
struct MetricsWriter<'a> {
    run: &'a MeshTraining<'a>,
    file: &'a mut std::fs::File,
    path: &'a Path,
    summaries: Vec<DeviceSummary>,
    last_wall: Instant,
    tokens: usize,
    seconds: f64,
    last_loss: f64,
    last_val: f64,
    /// Per device: steps in a row it computed above the straggler threshold.
    slow_steps: Vec<usize>,
}

/// Warnings for devices whose compute time has been `threshold` above the devices' median for
/// `steps` steps in a row (`slow_steps` carries the counts from step to step).
fn straggler_warnings(
    busy: &[f64],
    slow_steps: &mut [usize],
    threshold: f64,
    steps: usize,
    summaries: &[DeviceSummary],
) -> Vec<String> {
    let mut sorted = busy.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let mut out = Vec::new();
    for (d, (&b, n)) in busy.iter().zip(slow_steps.iter_mut()).enumerate() {
        if median > 0.0 && b > median * (1.0 + threshold) {
            *n += 1;
            if *n >= steps.max(1) {
                let s = &summaries[d];
                out.push(format!(
                    "straggler: device {d} (stage {}, dp rank {}, tp rank {}) computed {:.2}× the \
                     devices' median ({:.4} s vs {:.4} s) for {} steps in a row",
                    s.stage,
                    s.dp_rank,
                    s.tp_rank,
                    b / median,
                    b,
                    median,
                    n
                ));
            }
        } else {
            *n = 0;
        }
    }
    out
}

impl<'a> MetricsWriter<'a> {
    fn new(
        run: &'a MeshTraining<'a>,
        file: &'a mut std::fs::File,
        path: &'a Path,
        coords: &[(usize, usize, usize)],
        predicted: &[MemoryTerms],
    ) -> Self {
        let summaries = coords
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
        Self {
            run,
            file,
            path,
            summaries,
            last_wall: Instant::now(),
            tokens: 0,
            seconds: 0.0,
            last_loss: f64::NAN,
            last_val: run.initial_val_loss,
            slow_steps: vec![0; coords.len()],
        }
    }

    fn step(&mut self, f: StepFigures, on_step: &mut dyn FnMut(&StepReport)) -> Result<()> {
        let dt = self.last_wall.elapsed().as_secs_f64();
        self.last_wall = Instant::now();
        let batch = self.run.batch(f.step);
        let batch_tokens = batch.batch * batch.seq;
        self.tokens += batch_tokens;
        self.seconds += dt;
        self.last_loss = f.loss;
        if let Some(v) = f.val_loss {
            self.last_val = v;
        }
        let devices: Vec<serde_json::Value> = f
            .devices
            .iter()
            .zip(self.summaries.iter_mut())
            .map(|(fig, sum)| device_json(fig, sum, dt))
            .collect();
        let memory = f
            .devices
            .iter()
            .map(|d| d.memory.peak_terms())
            .max_by_key(|m| m.total)
            .expect("a device");
        let busy: Vec<f64> = f.devices.iter().map(|d| d.busy_s).collect();
        let warnings = straggler_warnings(
            &busy,
            &mut self.slow_steps,
            self.run.cfg.straggler_threshold,
            self.run.cfg.straggler_steps,
            &self.summaries,
        );
        let report = StepReport {
            step: f.step + 1,
            total_steps: self.run.cfg.steps,
            loss: f.loss,
            lr: f.lr,
            grad_norm: f.grad_norm,
            tokens_per_s: batch_tokens as f64 / dt,
            step_time_s: dt,
            val_loss: f.val_loss,
            memory,
            warnings,
        };
        let mut extra = serde_json::Map::new();
        extra.insert("layout".into(), self.run.layout.to_string().into());
        if self.run.cfg.storage().ok().flatten().is_some() {
            extra.insert("precision".into(), self.run.cfg.precision.clone().into());
            extra.insert("loss_scale".into(), f.loss_scale.into());
            extra.insert("skipped".into(), f.skipped.into());
        }
        let line = report.metrics_line(extra, devices);
        writeln!(self.file, "{line}").map_err(|e| EngineError::io(self.path, e))?;
        on_step(&report);
        Ok(())
    }

    fn finish(mut self, params: ParamStore) -> MeshOutcome {
        let steps = (self.run.cfg.steps - self.run.start).max(1) as f64;
        for s in self.summaries.iter_mut() {
            s.idle_fraction /= steps;
            s.step_time_s /= steps;
            s.wall_step_time_s /= steps;
        }
        MeshOutcome {
            params,
            last_loss: self.last_loss,
            last_val: self.last_val,
            tokens_per_s: self.tokens as f64 / self.seconds.max(1e-9),
            devices: self.summaries,
        }
    }
}

/// Each device's (tp, dp, stage) coordinates.
type Coords = Vec<(usize, usize, usize)>;

/// The partition, the device coordinates and the planner's per-stage prediction of a run.
fn layout_facts(run: &MeshTraining) -> Result<(StagePartition, Coords, Vec<MemoryTerms>)> {
    let layout = run.layout;
    let partition = StagePartition::for_model(run.model_cfg, layout.pp * layout.vpp)?;
    let plan = evaluate(run.input, &layout)?;
    let mesh = MeshStep::new(
        run.model_cfg,
        run.params,
        run.batch(run.start),
        &layout,
        &partition,
    )?;
    let coords = (0..layout.world_size())
        .map(|r| mesh.mesh().coords(r))
        .collect();
    Ok((partition, coords, plan.memory_bytes_per_stage))
}

fn capacity(cfg: &TrainConfig) -> Result<Option<u64>> {
    cfg.device_memory
        .as_deref()
        .map(super::train::parse_bytes)
        .transpose()
}

/// An out-of-memory error beside the planner's prediction for the same device's stage.
fn with_prediction(
    e: EngineError,
    layout: &Layout,
    coords: &[(usize, usize, usize)],
    predicted: &[MemoryTerms],
) -> EngineError {
    match e {
        EngineError::OutOfMemory {
            device,
            capacity,
            at,
        } => {
            let s = coords.get(device).map_or(0, |c| c.2);
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

/// Trains on the threads backend: one thread per device; this thread writes the metrics.
pub(super) fn train_mesh(
    run: &MeshTraining,
    metrics: &mut std::fs::File,
    metrics_path: &Path,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<MeshOutcome> {
    let layout = run.layout;
    let world = layout.world_size();
    if world > memory::MAX_DEVICES {
        return Err(EngineError::Invalid(format!(
            "layout `{layout}` has {world} devices; one process accounts for at most {}",
            memory::MAX_DEVICES
        )));
    }
    let (partition, coords, predicted) = layout_facts(run)?;
    let capacity = capacity(run.cfg)?;
    let accounts = memory::Accounts::claim(world);
    // Device 0's figures travel to this thread, which owns the metrics file and the callback.
    let (tx, rx) = mpsc::channel::<Option<StepFigures>>();
    let tx = Mutex::new(tx);
    let mut writer = MetricsWriter::new(run, metrics, metrics_path, &coords, &predicted);
    let results = std::thread::scope(|scope| -> Result<_> {
        let tx = &tx;
        let (partition, accounts) = (&partition, &accounts);
        let devices = scope.spawn(move || {
            let results = ThreadWorld::new(world)
                .timeout(Duration::from_secs(600))
                .run(|c| {
                    let mut sink = |f: StepFigures| {
                        let _ = tx.lock().expect("no panics").send(Some(f));
                        Ok(())
                    };
                    run_device(run, partition, c, accounts.base, capacity, &mut sink)
                });
            let _ = tx.lock().expect("no panics").send(None);
            results
        });
        while let Ok(Some(f)) = rx.recv() {
            writer.step(f, on_step)?;
        }
        Ok(devices.join().expect("the device threads are joined"))
    })?;
    let mut params = None;
    for (r, res) in results.into_iter().enumerate() {
        let res = res.map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?;
        match res {
            Ok(Some(p)) => params = Some(p),
            Ok(None) => {}
            Err(e @ EngineError::OutOfMemory { .. }) => {
                return Err(with_prediction(e, &layout, &coords, &predicted))
            }
            Err(e) => return Err(EngineError::Invalid(format!("device {r}: {e}"))),
        }
    }
    Ok(writer.finish(params.expect("device 0 gathers the model")))
}

/// Trains with this process as device `c.rank()` of an MPI job. Rank 0 writes the metrics and
/// returns the outcome; every other rank returns `None`. A failure ends the whole job.
#[cfg(feature = "mpi")]
pub(super) fn train_mesh_mpi(
    run: &MeshTraining,
    c: &mut crate::comm::MpiComm,
    metrics: &mut std::fs::File,
    metrics_path: &Path,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<Option<MeshOutcome>> {
    let layout = run.layout;
    if c.world_size() != layout.world_size() {
        return Err(EngineError::Invalid(format!(
            "layout `{layout}` needs {} devices, the job has {} ranks",
            layout.world_size(),
            c.world_size()
        )));
    }
    let (partition, coords, predicted) = layout_facts(run)?;
    let capacity = capacity(run.cfg)?;
    let mut writer = MetricsWriter::new(run, metrics, metrics_path, &coords, &predicted);
    let rank = c.rank();
    // One device per process: its counters are its own (account = its rank).
    let result = {
        let mut sink = |f: StepFigures| writer.step(f, on_step);
        run_device(run, &partition, c, 0, capacity, &mut sink)
    };
    match result {
        Ok(Some(p)) => Ok(Some(writer.finish(p))),
        Ok(None) => Ok(None),
        Err(e) => {
            let e = with_prediction(e, &layout, &coords, &predicted);
            c.abort(&format!("rank {rank}: {e}"), 1)
        }
    }
}

/// One device's figures for one step as a JSON object (and into its running summary).
fn device_json(f: &Figures, sum: &mut DeviceSummary, wall: f64) -> serde_json::Value {
    let peak = f.memory.peak_terms();
    let idle = if f.span_s > 0.0 {
        1.0 - f.busy_s / f.span_s
    } else {
        0.0
    };
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
    sum.bytes_sent_per_step = f.bytes_sent;
    sum.step_time_s += f.span_s;
    sum.wall_step_time_s += wall;
    serde_json::json!({
        "device": sum.device,
        "stage": sum.stage,
        "dp_rank": sum.dp_rank,
        "tp_rank": sum.tp_rank,
        "peak_memory_bytes": peak,
        "predicted_memory_bytes": sum.predicted_memory_bytes,
        "other_memory_bytes": f.memory.peak_other(),
        "idle_fraction": idle,
        "bytes_sent": f.bytes_sent,
        "bytes_sent_by_group": {"tp": f.bytes_tp, "dp": f.bytes_dp, "pp": f.bytes_pp},
        "step_time_s": f.span_s,
        "wall_step_time_s": wall,
    })
}

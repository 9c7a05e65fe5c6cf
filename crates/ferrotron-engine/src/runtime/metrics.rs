//! What a run reports: every step's figures from every device, gathered on device 0, written to
//! `metrics.jsonl` beside the planner's prediction, with straggler warnings; and each device's
//! summary over the run.

use super::training_run::TrainingRun;
use crate::error::{EngineError, Result};
use crate::memory::{DeviceMemory, MemoryTerms};
use crate::parallel::StepReport as DeviceStep;
use crate::transformer::ParamStore;
use ferrotron_core::precision::MixedPrecision;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// What one optimizer step did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepReport {
    pub step: usize,
    pub total_steps: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub step_time_s: f64,
    /// Model FLOPs utilisation of the step (the planner's FLOPs and peak over this step's time).
    pub mfu: f64,
    pub val_loss: Option<f64>,
    pub memory: MemoryTerms,
    /// Warnings raised at this step (a straggler forming).
    pub warnings: Vec<String>,
}

impl StepReport {
    /// The step's line in `metrics.jsonl`: its figures, then `extra` (the layout, warnings) and the
    /// per-device objects.
    pub fn metrics_line(
        &self,
        extra: serde_json::Map<String, serde_json::Value>,
        devices: Vec<serde_json::Value>,
    ) -> String {
        let mut line = serde_json::json!({
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "val_loss": self.val_loss,
            "warnings": self.warnings,
        });
        let obj = line.as_object_mut().expect("an object");
        obj.extend(extra);
        obj.insert("devices".into(), serde_json::Value::Array(devices));
        line.to_string()
    }
}

/// One device over the whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceSummary {
    pub device: usize,
    pub stage: usize,
    pub dp_rank: usize,
    pub cp_rank: usize,
    pub tp_rank: usize,
    /// The highest peak of each term over all steps, measured by the tracking allocator.
    pub peak_memory_bytes: MemoryTerms,
    pub predicted_memory_bytes: MemoryTerms,
    pub idle_fraction: f64,
    pub bytes_sent_per_step: u64,
    /// Mean step time in device time and in wall time.
    pub step_time_s: f64,
    pub wall_step_time_s: f64,
    /// Bytes read from where the model is stored to build this device's shard.
    pub model_bytes_read: u64,
    /// A mixture of experts: the routed experts' part of the weights term, measured (what the
    /// device holds between steps) and predicted (0 for a dense model).
    pub expert_weight_bytes: u64,
    pub predicted_expert_weight_bytes: u64,
}

/// One device's figures for one step, as device 0 receives them.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Figures {
    memory: DeviceMemory,
    busy_s: f64,
    span_s: f64,
    wall_s: f64,
    bytes_sent: u64,
    bytes_tp: u64,
    bytes_dp: u64,
    bytes_pp: u64,
    /// Context parallelism's K/V blocks or all-to-alls, and expert parallelism's all-to-alls.
    bytes_cp: u64,
    bytes_ep: u64,
    /// Bytes the device read from where the model is stored to build its shard.
    pub model_bytes_read: u64,
    /// Seconds a checkpoint save held the device at the end of this step (0: none started).
    pub checkpoint_stall_s: f64,
    /// Bytes of the copy of the device's state that save took.
    pub checkpoint_snapshot_bytes: u64,
    /// A mixture of experts: the routed experts' part of the device's weights between steps.
    pub expert_weight_bytes: u64,
}

const FIGURES: usize = 7 + 7 + 1 + 3 + 4 + 7 + 3 + 2 + 1;
/// Tag of the figures message (above any pipeline or gathering tag).
const FIGURES_TAG: u64 = 1 << 59;

impl Figures {
    pub(super) fn of(r: &DeviceStep) -> Self {
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
            bytes_cp: by("cp"),
            bytes_ep: by("ep"),
            model_bytes_read: 0,
            checkpoint_stall_s: 0.0,
            checkpoint_snapshot_bytes: 0,
            expert_weight_bytes: 0,
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
        for t in 0..7 {
            out[22 + t] = self.memory.at_peak[t] as f64;
        }
        out[29] = self.model_bytes_read as f64;
        out[30] = self.checkpoint_stall_s;
        out[31] = self.checkpoint_snapshot_bytes as f64;
        out[32] = self.bytes_cp as f64;
        out[33] = self.bytes_ep as f64;
        out[34] = self.expert_weight_bytes as f64;
        out
    }
    fn unpack(v: &[f64; FIGURES]) -> Self {
        let mut f = Self::default();
        for t in 0..7 {
            f.memory.live[t] = v[t] as u64;
            f.memory.peak[t] = v[7 + t] as u64;
        }
        f.memory.peak_total = v[14] as u64;
        for t in 0..7 {
            f.memory.at_peak[t] = v[22 + t] as u64;
        }
        (f.busy_s, f.span_s, f.wall_s) = (v[15], v[16], v[17]);
        (f.bytes_sent, f.bytes_tp, f.bytes_dp, f.bytes_pp) =
            (v[18] as u64, v[19] as u64, v[20] as u64, v[21] as u64);
        f.model_bytes_read = v[29] as u64;
        f.checkpoint_stall_s = v[30];
        f.checkpoint_snapshot_bytes = v[31] as u64;
        (f.bytes_cp, f.bytes_ep) = (v[32] as u64, v[33] as u64);
        f.expert_weight_bytes = v[34] as u64;
        f
    }
}

/// Every device sends its figures to device 0, which returns them all in rank order (the other
/// devices return `None`).
pub(super) fn collect_figures<C: crate::comm::Comm>(
    c: &mut C,
    world: usize,
    mine: Figures,
) -> Result<Option<Vec<Figures>>> {
    if c.rank() != 0 {
        c.send(0, &mine.pack(), FIGURES_TAG)?;
        return Ok(None);
    }
    let mut devices = vec![mine];
    for r in 1..world {
        let mut v = [0f64; FIGURES];
        c.recv(r, &mut v, FIGURES_TAG)?;
        devices.push(Figures::unpack(&v));
    }
    Ok(Some(devices))
}

/// What device 0 knows after a step: every device's figures, the step's numbers, the validation loss.
pub(super) struct StepFigures {
    pub devices: Vec<Figures>,
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub val_loss: Option<f64>,
    /// Wall seconds the evaluation took (not training: kept out of tokens/s).
    pub eval_s: f64,
    pub loss_scale: f64,
    pub skipped: bool,
    /// The validation loss before the first step (with the first step's figures).
    pub initial_val_loss: Option<f64>,
    /// A mixture of experts: per layer, the top-k places each expert took over the step.
    pub expert_tokens: Vec<Vec<f64>>,
}

/// What the run produced, on the device that reports it.
pub(super) struct RunOutcome {
    pub params: ParamStore,
    pub initial_val_loss: Option<f64>,
    pub last_loss: f64,
    pub last_val: Option<f64>,
    pub tokens_per_s: f64,
    pub devices: Vec<DeviceSummary>,
}

/// Writes `metrics.jsonl` and keeps each device's running summary (device 0's side).
pub(super) struct MetricsWriter<'a> {
    run: &'a TrainingRun<'a>,
    /// `metrics.jsonl`, open on the process that reports the run.
    file: std::fs::File,
    path: &'a Path,
    summaries: Vec<DeviceSummary>,
    last_wall: Instant,
    tokens: usize,
    seconds: f64,
    last_loss: f64,
    last_val: Option<f64>,
    /// The validation loss before the first step (device 0 sends it with the first figures).
    initial_val_loss: Option<f64>,
    /// Whether the run's first record (of this process) is written.
    wrote_first: bool,
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
                    "straggler: device {d} (stage {}, dp rank {}, cp rank {}, tp rank {}) computed \
                     {:.2}× the devices' median ({:.4} s vs {:.4} s) for {} steps in a row",
                    s.stage,
                    s.dp_rank,
                    s.cp_rank,
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
    pub(super) fn new(
        run: &'a TrainingRun<'a>,
        file: std::fs::File,
        path: &'a Path,
        coords: &[ferrotron_core::rank::Coords],
        predicted: &[MemoryTerms],
    ) -> Self {
        let summaries = coords
            .iter()
            .enumerate()
            .map(|(r, at)| DeviceSummary {
                device: r,
                stage: at.pp,
                dp_rank: at.dp,
                cp_rank: at.cp,
                tp_rank: at.tp,
                peak_memory_bytes: MemoryTerms::default(),
                predicted_memory_bytes: predicted[at.pp],
                expert_weight_bytes: 0,
                predicted_expert_weight_bytes: run.plan.expert_weight_bytes_per_stage[at.pp],
                idle_fraction: 0.0,
                bytes_sent_per_step: 0,
                step_time_s: 0.0,
                wall_step_time_s: 0.0,
                model_bytes_read: 0,
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
            last_val: None,
            initial_val_loss: None,
            wrote_first: false,
            slow_steps: vec![0; coords.len()],
        }
    }

    pub(super) fn step(
        &mut self,
        f: StepFigures,
        on_step: &mut dyn FnMut(&StepReport),
    ) -> Result<()> {
        // Evaluations and checkpoint saves are not training: kept out of the step's time.
        let stall = f
            .devices
            .iter()
            .map(|d| d.checkpoint_stall_s)
            .fold(0.0, f64::max);
        let elapsed = (self.last_wall.elapsed().as_secs_f64() - f.eval_s - stall).max(1e-9);
        self.last_wall = Instant::now();
        // An asynchronous schedule's steps are reported together when their segment ends: each
        // takes its share of the segment's wall time (what device 0 measured), not the moments
        // between reports.
        let dt = if self.run.layout.schedule.is_async() {
            f.devices[0].wall_s.max(1e-9)
        } else {
            elapsed
        };
        let batch = self.run.batch(f.step);
        let batch_tokens = batch.batch * batch.seq;
        self.tokens += batch_tokens;
        self.seconds += dt;
        self.last_loss = f.loss;
        if let Some(v) = f.initial_val_loss {
            self.initial_val_loss = Some(v);
            self.last_val = self.last_val.or(Some(v));
        }
        if let Some(v) = f.val_loss {
            self.last_val = Some(v);
        }
        let mut devices: Vec<serde_json::Value> = f
            .devices
            .iter()
            .zip(self.summaries.iter_mut())
            .map(|(fig, sum)| device_json(fig, sum, dt))
            .collect();
        if !self.wrote_first {
            // What each device read of the stored model to build its shard (this process's first
            // record: a resumed run reads its model again).
            for (v, fig) in devices.iter_mut().zip(&f.devices) {
                v["model_bytes_read"] = fig.model_bytes_read.into();
            }
            self.wrote_first = true;
        }
        if stall > 0.0 && self.run.cfg.checkpointing.checkpoint_async {
            // The host memory the save's copy holds while it is written, beside the planner's.
            for ((v, fig), sum) in devices.iter_mut().zip(&f.devices).zip(&self.summaries) {
                v["checkpoint_snapshot_bytes"] = fig.checkpoint_snapshot_bytes.into();
                v["predicted_checkpoint_snapshot_bytes"] =
                    self.run.plan.checkpoint_snapshot_bytes[sum.stage].into();
            }
        }
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
            self.run.cfg.logging.straggler_threshold,
            self.run.cfg.logging.straggler_steps,
            &self.summaries,
        );
        let report = StepReport {
            step: f.step + 1,
            total_steps: self.run.cfg.optimizer.steps,
            loss: f.loss,
            lr: f.lr,
            grad_norm: f.grad_norm,
            tokens_per_s: batch_tokens as f64 / dt,
            step_time_s: dt,
            mfu: self.run.plan.mfu_at(dt),
            val_loss: f.val_loss,
            memory,
            warnings,
        };
        let mut extra = serde_json::Map::new();
        extra.insert("layout".into(), self.run.layout.to_string().into());
        // Beside each device's `bytes_sent_by_group`: the planner's bytes per step per device along
        // each dimension (expert parallelism's at the balanced load).
        extra.insert(
            "predicted_bytes_sent_by_group".into(),
            serde_json::json!(self.run.plan.comm_bytes_per_step),
        );
        let cfg = self.run.cfg;
        extra.insert(
            "tokens_per_step".into(),
            (cfg.optimizer.batch_size * cfg.input.seq_len).into(),
        );
        if self.run.cfg.numerics.precision != MixedPrecision::F32 {
            extra.insert(
                "precision".into(),
                self.run.cfg.numerics.precision.name().into(),
            );
            extra.insert("loss_scale".into(), f.loss_scale.into());
            extra.insert("skipped".into(), f.skipped.into());
        }
        if !f.expert_tokens.is_empty() {
            // Per layer, the tokens the router gave each expert (a token counts once for each of
            // its top-k experts), then those it dropped over its capacity; the load is the busiest
            // expert's over the mean, in the worst layer.
            let half = |row: &Vec<f64>, second: bool| -> Vec<f64> {
                let (taken, dropped) = row.split_at(row.len() / 2);
                if second { dropped } else { taken }.to_vec()
            };
            let load = f
                .expert_tokens
                .iter()
                .filter(|row| !row.is_empty())
                .map(|row| {
                    let row = half(row, false);
                    let mean = row.iter().sum::<f64>() / row.len() as f64;
                    row.iter().copied().fold(0.0, f64::max) / mean.max(f64::MIN_POSITIVE)
                })
                .fold(0.0, f64::max);
            let counts = |second: bool| -> Vec<Vec<u64>> {
                f.expert_tokens
                    .iter()
                    .map(|row| {
                        half(row, second)
                            .iter()
                            .map(|&v| v.round() as u64)
                            .collect()
                    })
                    .collect()
            };
            extra.insert("expert_tokens".into(), serde_json::json!(counts(false)));
            extra.insert("expert_load_max_over_mean".into(), load.into());
            let dropped = counts(true);
            let total: u64 = dropped.iter().flatten().sum();
            if total > 0 || self.run.cfg.input.capacity_factor.is_some() {
                extra.insert("expert_dropped".into(), serde_json::json!(dropped));
                extra.insert("expert_dropped_total".into(), total.into());
            }
        }
        if stall > 0.0 {
            // A save started after this step: how long it held the devices (the longest).
            extra.insert("checkpoint_stall_s".into(), stall.into());
        }
        // The run's first line says what was run, for a report made from the file alone.
        if f.step == 0 {
            extra.insert("run".into(), self.run_record());
        }
        let line = report.metrics_line(extra, devices);
        writeln!(self.file, "{line}").map_err(|e| EngineError::io(self.path, e))?;
        on_step(&report);
        Ok(())
    }

    /// When the run started (Unix seconds), the model's parameters and those trained, and the
    /// validation loss before the first step.
    fn run_record(&self) -> serde_json::Value {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        serde_json::json!({
            "started_unix_s": started,
            "parameters": self.run.model_cfg.num_params(),
            "trained_parameters": self.run.trained_parameters(),
            "initial_val_loss": self.initial_val_loss,
        })
    }

    pub(super) fn finish(mut self, params: ParamStore) -> RunOutcome {
        let steps = (self.run.cfg.optimizer.steps - self.run.start).max(1) as f64;
        for s in self.summaries.iter_mut() {
            s.idle_fraction /= steps;
            s.step_time_s /= steps;
            s.wall_step_time_s /= steps;
        }
        RunOutcome {
            params,
            initial_val_loss: self.initial_val_loss,
            last_loss: self.last_loss,
            last_val: self.last_val,
            tokens_per_s: self.tokens as f64 / self.seconds.max(1e-9),
            devices: self.summaries,
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
    sum.peak_memory_bytes = sum.peak_memory_bytes.max_each(&peak);
    sum.idle_fraction += idle;
    sum.bytes_sent_per_step = f.bytes_sent;
    sum.step_time_s += f.span_s;
    sum.wall_step_time_s += wall;
    sum.model_bytes_read = f.model_bytes_read;
    sum.expert_weight_bytes = f.expert_weight_bytes;
    let mut device = serde_json::json!({
        "device": sum.device,
        "stage": sum.stage,
        "dp_rank": sum.dp_rank,
        "cp_rank": sum.cp_rank,
        "tp_rank": sum.tp_rank,
        "peak_memory_bytes": peak,
        "memory_at_peak_bytes": f.memory.terms_at_peak(),
        "predicted_memory_bytes": sum.predicted_memory_bytes,
        "other_memory_bytes": f.memory.peak_other(),
        "idle_fraction": idle,
        "bytes_sent": f.bytes_sent,
        "bytes_sent_by_group": {
            "tp": f.bytes_tp, "dp": f.bytes_dp, "pp": f.bytes_pp, "cp": f.bytes_cp, "ep": f.bytes_ep,
        },
        "step_time_s": f.span_s,
        "wall_step_time_s": wall,
    });
    if sum.predicted_expert_weight_bytes > 0 || f.expert_weight_bytes > 0 {
        let obj = device.as_object_mut().expect("an object");
        obj.insert("expert_weight_bytes".into(), f.expert_weight_bytes.into());
        obj.insert(
            "predicted_expert_weight_bytes".into(),
            sum.predicted_expert_weight_bytes.into(),
        );
    }
    device
}

/// Keeps the lines of `metrics.jsonl` at `path` for steps up to `step` and drops the rest: the
/// steps after a checkpoint were recorded by the run that died, and the run resumed from it records
/// them again (a torn last line goes too). Nothing to do where there is no file.
pub fn keep_steps_up_to(path: &std::path::Path, step: usize) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let bytes = ferrotron_core::bounded::read(path, ferrotron_core::bounded::RECORDS)
        .map_err(|e| crate::error::EngineError::io(path, e))?;
    let text = String::from_utf8_lossy(&bytes);
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step")?.as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .flat_map(|line| [line, "\n"])
        .collect();
    if kept.len() != text.len() {
        crate::hf::write_atomic(path, kept.as_bytes())?;
    }
    Ok(())
}

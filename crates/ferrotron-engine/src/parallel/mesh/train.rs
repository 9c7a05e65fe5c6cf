//! One device through optimizer steps: the step, fp16 loss scaling, global-norm clipping, the
//! (ZeRO-sharded) update, and what the device measured.

use super::{Device, MeshStep};
use crate::comm::{Comm, CommStats, ReduceOp};
use crate::error::{EngineError, Result};
use crate::memory;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::parallel::pipeline::StageOutcome;
use crate::transformer::TokenBatch;
use ferrotron_core::model::ModelConfig;

/// Dynamic loss scaling (fp16): the loss is multiplied by `scale` before backward; a step whose
/// gradients hold an inf or NaN anywhere is skipped and the scale halved; after `growth_interval`
/// clean steps it doubles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaling {
    pub initial: f64,
    pub growth_interval: usize,
    /// Testing: put an inf into device 0's gradients at this step.
    pub inject_nonfinite_at: Option<usize>,
}

impl LossScaling {
    /// The usual start: 2¹⁶, doubled after 1000 clean steps.
    pub const DEFAULT: LossScaling = LossScaling {
        initial: 65536.0,
        growth_interval: 1000,
        inject_nonfinite_at: None,
    };
}

/// What one optimizer step measured on one device.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: usize,
    /// Mean loss over the global batch (the same on every device).
    pub loss: f64,
    /// Every device stops after this step (one was asked to, by a signal).
    pub stop: bool,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// This device's communication during the step.
    pub stats: CommStats,
    pub peak_stash_bytes: usize,
    /// Device time spent computing during the step, and the step's length in device time.
    pub busy_s: f64,
    pub span_s: f64,
    /// Every action of the step with its start and end in device time.
    pub timeline: Vec<(ferrotron_core::schedule::Action, f64, f64)>,
    /// Each action's compute time: its span less the collectives it waited in.
    pub action_compute_s: Vec<f64>,
    /// Sends and receives between stages, (what, start, end) in device time.
    pub transfers: Vec<(String, f64, f64)>,
    /// Device-time intervals of the reductions after the last action (with the global norm), and
    /// of the optimizer step.
    pub reduce_s: (f64, f64),
    pub update_s: (f64, f64),
    pub wall_s: f64,
    /// This device's memory during the step, measured by term.
    pub memory: memory::DeviceMemory,
    /// Its memory over the step: at the start, after each action, after the reductions, after the
    /// update and at the end.
    pub memory_over_step: Vec<memory::MemorySample>,
    /// fp16: the loss scale this step used, and whether it was skipped (inf/NaN in the gradients).
    pub loss_scale: f64,
    pub skipped: bool,
    /// A mixture of experts: per layer, the top-k places the router gave each expert over the
    /// step's whole batch (every device's), then the places each dropped over its capacity (`2 ·
    /// experts` counts); empty for a dense model.
    pub expert_tokens: Vec<Vec<f64>>,
}

/// How a device trains: steps to reach, each step's batch, the optimizer and clipping.
pub struct Training<'a> {
    /// Train up to (not including) this step.
    pub steps: usize,
    /// The batch of step k (the same on every device).
    pub batch_of: &'a dyn Fn(usize) -> TokenBatch,
    pub adam: AdamWConfig,
    pub lr: &'a LrSchedule,
    /// Clip the global gradient norm to this (0: off).
    pub clip: f64,
    /// Whether this device was asked to stop (a signal): read at the end of each step, where all
    /// devices agree on it (any one asking stops them all after that step).
    pub stop: &'a dyn Fn() -> bool,
}

impl MeshStep<'_> {
    /// Runs device `c.rank()` through optimizer steps up to `t.steps` (from 0, or from where a
    /// [`super::Resume`] says). `on_step` sees each step's report on every device. A device over its
    /// memory capacity ends the run on every device at the end of that step.
    pub fn train_device<C: Comm>(
        &mut self,
        c: &mut C,
        t: &Training,
        on_step: &mut dyn FnMut(&MeshStep, &mut C, &mut Device, &StepReport) -> Result<()>,
    ) -> Result<Device> {
        let dev = self.build_device(c, t.adam)?;
        self.train_built(c, t, dev, on_step)
    }

    /// Builds device `c.rank()` (its shard read, its state restored when the run resumes), on its
    /// memory account.
    pub fn build_device<C: Comm>(&mut self, c: &mut C, adam: AdamWConfig) -> Result<Device> {
        let account = self.account(c.rank());
        memory::set_device(account);
        let mut dev = self.device(c.rank(), adam)?;
        if let Some(r) = self.resume {
            (r.restore)(&mut dev)?;
            if let (Some(_), Some((scale, clean))) = (self.loss_scaling(), r.loss_scaler) {
                (self.loss_scale, self.clean_steps) = (scale, clean);
            }
        }
        Ok(dev)
    }

    /// [`MeshStep::train_device`] on a device [`MeshStep::build_device`] built.
    pub fn train_built<C: Comm>(
        &mut self,
        c: &mut C,
        t: &Training,
        mut dev: Device,
        on_step: &mut dyn FnMut(&MeshStep, &mut C, &mut Device, &StepReport) -> Result<()>,
    ) -> Result<Device> {
        memory::set_device(self.account(c.rank()));
        let first = self.resume.map_or(0, |r| r.step);
        if self.layout.schedule.is_async() {
            self.train_segments(c, t, first, &mut dev, on_step)?;
            return Ok(dev);
        }
        for step in first..t.steps {
            self.set_batch(&(t.batch_of)(step))?;
            let report = self.optimizer_step(c, &mut dev, step, t)?;
            on_step(self, c, &mut dev, &report)?;
        }
        Ok(dev)
    }

    /// One step of device `dev`: forward and backward, reductions, loss scaling, clipping, update.
    fn optimizer_step<C: Comm>(
        &mut self,
        c: &mut C,
        dev: &mut Device,
        step: usize,
        t: &Training,
    ) -> Result<StepReport> {
        let account = self.account(c.rank());
        memory::reset_peaks(account);
        let started = c.device_time();
        let mut memory_over_step = vec![memory::sample(account, started)];
        let from = c.stats().clone();
        let wall = std::time::Instant::now();
        let StageOutcome {
            loss,
            peak_bytes,
            timeline,
            action_compute_s,
            transfers,
            over_capacity,
            memory: samples,
            expert_tokens,
            ..
        } = self.step_device(c, dev)?;
        memory_over_step.extend(samples);
        let reduced = c.device_time();
        let scale_used = self.loss_scale;
        let skipped = self.unscale_or_skip(c, dev, step)?;
        let norm = if skipped {
            f64::NAN
        } else {
            self.grad_norm(c, dev)?
        };
        if !skipped && t.clip > 0.0 && norm > t.clip {
            let scale = (t.clip / (norm + 1e-6)) as f32;
            dev.zero.with_grad_view(|grads| {
                grads
                    .iter_mut()
                    .for_each(|g| g.iter_mut().for_each(|x| *x *= scale))
            });
        }
        let rate = t.lr.lr(step) as f32;
        let update_start = c.device_time();
        memory_over_step.push(memory::sample(account, update_start));
        if !skipped {
            dev.zero.update(c, rate)?;
        }
        let update_end = c.device_time();
        memory_over_step.push(memory::sample(account, update_end));
        // Every device learns the step's loss (summed from the devices that count it), whether
        // any device went over its capacity (then every device ends the run here, together), and
        // whether any was asked to stop.
        // A mixture of experts: every device adds its layers' expert counts (the same length on
        // every device: layers × experts, taken then dropped).
        let mut l = vec![
            loss,
            over_capacity.is_some() as u8 as f64,
            (t.stop)() as u8 as f64,
        ];
        l.extend(expert_counts_flat(self.cfg, &expert_tokens));
        c.all_reduce(&self.mesh.world(), &mut l, ReduceOp::Sum)?;
        let expert_tokens = expert_counts_rows(self.cfg, &l[3..]);
        if let Some(e) = over_capacity {
            return Err(e);
        }
        if l[1] > 0.0 {
            return Err(EngineError::PeerOutOfMemory(format!(
                "device {} stopped at step {}: another device went over its memory capacity",
                c.rank(),
                step + 1
            )));
        }
        // Without loss scaling (which skips such steps), a non-finite loss or norm ends the run:
        // nothing after it would be worth saving.
        let loss_total = l[0] / self.total_tokens as f64;
        if self.loss_scaling().is_none() && !(loss_total.is_finite() && norm.is_finite()) {
            return Err(self.non_finite(dev, c.rank(), step, loss_total, Some(norm)));
        }
        let ended = c.device_time();
        memory_over_step.push(memory::sample(account, ended));
        let stats = c.stats().since(&from);
        Ok(StepReport {
            step,
            loss: loss_total,
            stop: l[2] > 0.0,
            grad_norm: norm,
            lr: rate as f64,
            // Computing is the device's compute time; the rest of the step is waiting (bubble,
            // peers late to a collective) and moving data.
            busy_s: stats.compute_time_s,
            span_s: ended - started,
            stats,
            peak_stash_bytes: peak_bytes,
            // After the last action: the gradient reductions' tail and the global norm, then
            // the optimizer step (with ZeRO 1–2 its all-gather).
            reduce_s: (timeline.last().map_or(reduced, |a| a.2), update_start),
            update_s: (update_start, update_end),
            timeline,
            action_compute_s,
            transfers,
            wall_s: wall.elapsed().as_secs_f64(),
            memory: memory::device_memory(account),
            memory_over_step,
            loss_scale: scale_used,
            skipped,
            expert_tokens,
        })
    }

    /// The error of a step whose loss or gradient norm went non-finite, naming this device's first
    /// tensor with a non-finite gradient.
    pub(super) fn non_finite(
        &self,
        dev: &mut Device,
        rank: usize,
        step: usize,
        loss: f64,
        norm: Option<f64>,
    ) -> EngineError {
        let found = match self.first_non_finite_grad(dev) {
            Some(name) => format!("device {rank}'s first tensor with a non-finite gradient is `{name}`"),
            None => format!("device {rank}'s gradients are finite: the non-finite values are in the loss or on other devices' tensors"),
        };
        EngineError::NonFinite(format!(
            "step {}: the loss is {loss}{}; {found}. The run stops here and saves nothing: the last checkpoint is the last good state. Look for a setting out of its range (learning rate, Adam's betas and epsilon, a norm's epsilon, RoPE's theta) or non-finite weights",
            step + 1,
            norm.map_or(String::new(), |n| format!(" and the gradient norm {n}"))
        ))
    }

    /// fp16 loss scaling: an inf or NaN in any device's gradients skips the step for every device
    /// and halves the scale (returns true); otherwise the gradients are unscaled, and the scale
    /// doubles after `growth_interval` clean steps. Without loss scaling, nothing is skipped.
    fn unscale_or_skip<C: Comm>(
        &mut self,
        c: &mut C,
        dev: &mut Device,
        step: usize,
    ) -> Result<bool> {
        let Some(ls) = self.loss_scaling() else {
            return Ok(false);
        };
        if ls.inject_nonfinite_at == Some(step) && c.rank() == 0 {
            dev.zero.with_grad_view(|g| {
                if let Some(x) = g.iter_mut().find_map(|t| t.first_mut()) {
                    *x = f32::INFINITY;
                }
            });
        }
        let mut bad = [dev
            .zero
            .with_grad_view(|g| g.iter().any(|t| t.iter().any(|x| !x.is_finite())))
            as u8 as f64];
        c.all_reduce(&self.mesh.world(), &mut bad, ReduceOp::Sum)?;
        if bad[0] > 0.0 {
            self.loss_scale = (self.loss_scale / 2.0).max(1.0);
            self.clean_steps = 0;
            return Ok(true);
        }
        let unscale = (1.0 / self.loss_scale) as f32;
        dev.zero.with_grad_view(|g| {
            g.iter_mut()
                .for_each(|t| t.iter_mut().for_each(|x| *x *= unscale))
        });
        self.clean_steps += 1;
        if self.clean_steps >= ls.growth_interval.max(1) {
            self.loss_scale *= 2.0;
            self.clean_steps = 0;
        }
        Ok(false)
    }
}

/// A mixture of experts: a device's expert counts of a step ([`StageOutcome::expert_tokens`]) as
/// one row of `layers × 2·experts` numbers, zeros for the layers elsewhere, the same length on
/// every device (so that a sum over the devices adds them); empty for a dense model.
pub(super) fn expert_counts_flat(cfg: &ModelConfig, tokens: &[Vec<f64>]) -> Vec<f64> {
    let experts = 2 * cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let mut out = Vec::new();
    for layer in 0..cfg.num_layers * usize::from(experts > 0) {
        let row = tokens.get(layer).filter(|r| r.len() == experts);
        out.extend((0..experts).map(|e| row.map_or(0.0, |r| r[e])));
    }
    out
}

/// [`expert_counts_flat`]'s row (summed over the devices) back into one row per layer.
pub(super) fn expert_counts_rows(cfg: &ModelConfig, flat: &[f64]) -> Vec<Vec<f64>> {
    let experts = 2 * cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    flat.chunks(experts.max(1)).map(<[f64]>::to_vec).collect()
}

//! Training under an asynchronous schedule (PipeDream, PipeDream-2BW): the run is cut into segments
//! at the steps after which the pipeline must drain (an evaluation or a checkpoint follows, and the
//! end); each segment is one list without a flush, warm-up at its start and drain at its end. A
//! segment starts from the weights at hand, as the run's first step does (`build_async`).

use super::train::{expert_counts_flat, expert_counts_rows, StepReport, Training};
use super::{micro_batches, Device, MeshStep};
use crate::comm::{Comm, CommStats, Dim, ReduceOp};
use crate::error::{EngineError, Result};
use crate::memory::{self, Term};
use crate::parallel::pipedream::SegmentRun;
use crate::parallel::pipeline::StageRun;
use crate::transformer::TokenBatch;
use ferrotron_core::layout::Schedule;
use ferrotron_core::rank::Coords;
use ferrotron_core::schedule::build_async;

impl MeshStep<'_> {
    /// Refuses what the asynchronous executor does not run, naming the setting.
    pub(super) fn check_async(&self) -> Result<()> {
        let name = self.layout.schedule.name();
        let refuse = |what: String| {
            Err(EngineError::Invalid(format!(
                "schedule={name}: {what} (the asynchronous schedules run f32 or bf16, ZeRO 0–1, \
                 one chunk per stage)"
            )))
        };
        if self.precision.needs_loss_scaling() {
            return refuse(
                "fp16's loss scaling skips the steps whose gradients overflow, and an asynchronous \
                 pipeline applies every update it has begun (use bf16)"
                    .into(),
            );
        }
        if self.layout.zero > 1 {
            return refuse(format!(
                "ZeRO-{} shards the weights or gradients each version needs whole",
                self.layout.zero
            ));
        }
        if self.layout.vpp > 1 {
            return refuse("interleaving (vpp > 1) is a synchronous schedule's".into());
        }
        if self.frozen.is_some() {
            return refuse("LoRA with weight stashing is not implemented".into());
        }
        if self.layout.schedule == Schedule::TwoBw && self.m < self.mesh.pp {
            return refuse(format!(
                "2BW needs at least pp={} micro-batches per step, the layout has {}",
                self.mesh.pp, self.m
            ));
        }
        Ok(())
    }

    /// Runs device `c.rank()` through steps `first..t.steps` in segments, calling `on_step` for
    /// every step in order once its segment is done.
    pub(super) fn train_segments<C: Comm>(
        &self,
        c: &mut C,
        t: &Training,
        first: usize,
        dev: &mut Device,
        on_step: &mut dyn FnMut(&MeshStep, &mut C, &mut Device, &StepReport) -> Result<()>,
    ) -> Result<()> {
        self.check_async()?;
        let mut start = first;
        while start < t.steps {
            let drain = self.drain_after;
            let end = (start + 1..=t.steps)
                .find(|&k| k == t.steps || drain.is_some_and(|d| d(k - 1)))
                .expect("the run's end drains");
            let reports = self.segment(c, dev, start, end, t)?;
            for r in &reports {
                on_step(self, c, dev, r)?;
            }
            start = end;
        }
        Ok(())
    }

    /// One segment, steps `start..end`, on device `dev`: its reports, one per step.
    fn segment<C: Comm>(
        &self,
        c: &mut C,
        dev: &mut Device,
        start: usize,
        end: usize,
        t: &Training,
    ) -> Result<Vec<StepReport>> {
        let account = self.account(c.rank());
        let at = self.mesh.coords(dev.rank);
        let (tp_rank, d, s) = (at.tp, at.dp, at.pp);
        let (p, tp, m) = (self.mesh.pp, self.mesh.tp, self.m);
        let steps = end - start;
        let (micro, tokens_per_step) = self.replica_batches(t, start..end, d);
        let schedule = build_async(self.layout.schedule, p, m, steps, t.clip > 0.0)?;
        let per_update = schedule.micro_batches_per_update;
        // Each update averages over the tokens of its micro-batches on every replica: a step's
        // (2BW), or one micro-batch of each replica (PipeDream).
        let update_tokens = tokens_per_step * per_update / m;
        let device_of = |stage: usize| self.mesh.rank_of(Coords { pp: stage, ..at });
        let (micro, targets) = self.device_batches(dev.rank, &micro);
        let boundary = micro[0].batch * micro[0].seq * self.cfg.hidden_size
            / if dev.shard.sequence_parallel { tp } else { 1 };
        let lr_of = |u: usize| t.lr.lr(start + u * per_update / m) as f32;
        let tp_group = self.mesh.group_of(dev.rank, Dim::Tp);
        let replicas = self.mesh.replica_group(dev.rank);
        let router_group = (self.cfg.moe.is_some() && replicas.size() > 1).then_some(replicas);
        let seg = SegmentRun {
            run: StageRun {
                schedule: &schedule,
                stage: s,
                stages: p,
                chunks_per_device: 1,
                device_of: &device_of,
                micro: &micro,
                targets: &targets,
                boundary,
                scale: 1.0 / update_tokens as f32,
                counts_loss: tp_rank == 0,
                account,
                extra_compute_s: self.extra_compute_s(dev.rank),
                precision: self.precision,
                threads: self.kernel_threads,
                // A mixture of experts: each micro-batch's router statistics summed over the
                // replicas, as on the synchronous schedules.
                router_group: router_group.as_ref(),
            },
            mesh: self,
            cfg: self.cfg,
            micro_per_step: m,
            lr_of: &lr_of,
            clip: t.clip,
            world: self.mesh.world_size(),
            tp_group: tp_group.clone(),
            tied: self.cfg.tie_word_embeddings && self.frozen.is_none(),
        };
        memory::reset_peaks(account);
        // The clock first: it accrues the compute since its last reading (the previous step's
        // reporting) into the stats, which this segment must not count as its own.
        let (started, wall) = (c.device_time(), std::time::Instant::now());
        let from = c.stats().clone();
        let chunks = std::mem::take(&mut dev.chunks);
        let out = {
            let tpg = self.shard_group(c, dev);
            let _activations = memory::scope(Term::Activations);
            seg.execute(&tpg, dev, &chunks)
        };
        dev.chunks = chunks;
        let out = out?;
        // Every device learns each step's loss (summed over the devices that count it), and
        // whether any device went over its capacity: then all end the run here, together.
        let over = out.outcome.over_capacity.is_some();
        let mut l: Vec<f64> = out.step_loss.clone();
        l.push(over as u8 as f64);
        // Asked to stop: the segment ends drained, so its last step is where all devices stop.
        l.push((t.stop)() as u8 as f64);
        // A mixture of experts: each step's expert counts, summed over the devices.
        for counts in &out.step_expert_tokens {
            l.extend(expert_counts_flat(self.cfg, counts));
        }
        c.all_reduce(&self.mesh.world(), &mut l, ReduceOp::Sum)?;
        let per_step = expert_counts_flat(self.cfg, &[]).len();
        let step_expert_tokens = |k: usize| {
            let at = steps + 2 + k * per_step;
            expert_counts_rows(self.cfg, &l[at..at + per_step])
        };
        if let Some(e) = out.outcome.over_capacity {
            return Err(e);
        }
        if l[steps] > 0.0 {
            return Err(EngineError::PeerOutOfMemory(format!(
                "device {} stopped at step {end}: another device went over its memory capacity",
                c.rank()
            )));
        }
        // A non-finite loss ends the run at the first step that had one (the asynchronous
        // schedules' losses are every device's, summed above; they keep no loss scaling).
        if let Some(k) = (0..steps).find(|&k| !l[k].is_finite()) {
            return Err(self.non_finite(dev, c.rank(), start + k, l[k], None));
        }
        let ended = c.device_time();
        let stats = c.stats().since(&from);
        let memory = memory::device_memory(account);
        let share = |x: f64| x / steps as f64;
        let updates_per_step = m / per_update;
        Ok((0..steps)
            .map(|k| {
                let norms = &out.update_norm[k * updates_per_step..(k + 1) * updates_per_step];
                let last = k + 1 == steps;
                let o = &out.outcome;
                StepReport {
                    step: start + k,
                    loss: l[k] / tokens_per_step as f64,
                    stop: last && l[steps + 1] > 0.0,
                    grad_norm: norms.iter().sum::<f64>() / norms.len() as f64,
                    lr: t.lr.lr(start + k),
                    stats: shared(&stats, steps),
                    peak_stash_bytes: o.peak_bytes,
                    busy_s: share(stats.compute_time_s),
                    span_s: share(ended - started),
                    timeline: if last { o.timeline.clone() } else { Vec::new() },
                    action_compute_s: if last {
                        o.action_compute_s.clone()
                    } else {
                        Vec::new()
                    },
                    transfers: if last {
                        o.transfers.clone()
                    } else {
                        Vec::new()
                    },
                    reduce_s: (ended, ended),
                    update_s: (ended, ended),
                    wall_s: share(wall.elapsed().as_secs_f64()),
                    memory,
                    memory_over_step: if last { o.memory.clone() } else { Vec::new() },
                    loss_scale: 1.0,
                    skipped: false,
                    expert_tokens: step_expert_tokens(k),
                }
            })
            .collect())
    }
}

/// A segment's communication spread evenly over its `steps` steps (what each step's report says).
fn shared(stats: &CommStats, steps: usize) -> CommStats {
    let mut out = stats.clone();
    let n = steps.max(1);
    for op in out.by_op.values_mut() {
        op.calls /= n as u64;
        op.bytes_sent /= n as u64;
        op.bytes_received /= n as u64;
        op.time_blocked_s /= n as f64;
        op.time_transfer_s /= n as f64;
    }
    out.compute_time_s /= n as f64;
    out.device_time_s /= n as f64;
    out.wall_time_s /= n as f64;
    out
}

impl MeshStep<'_> {
    /// Replica `d`'s micro-batches of steps `steps`, in order, and the tokens a step predicts.
    fn replica_batches(
        &self,
        t: &Training,
        steps: std::ops::Range<usize>,
        d: usize,
    ) -> (Vec<TokenBatch>, usize) {
        let (m, mbs) = (self.m, self.layout.micro_batch_size.max(1));
        let mut micro = Vec::with_capacity(steps.len() * m);
        let mut tokens_per_step = 0;
        for k in steps {
            let batch = (t.batch_of)(k);
            tokens_per_step = batch.predicted_tokens().max(1);
            micro.extend(micro_batches(&batch, mbs).drain(d * m..(d + 1) * m));
        }
        (micro, tokens_per_step)
    }
}

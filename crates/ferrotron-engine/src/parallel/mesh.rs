//! The dp × pp × tp mesh: which device holds what, one step of forward and backward on every device
//! (each data-parallel replica on its share of the global batch), the gradient reductions that make
//! the step equal the unsplit one, and the optimizer step over ZeRO-sharded state.
//!
//! Ranks follow the design's order: `rank = tp_rank + tp · (dp_rank + dp · stage)`.

use super::data::ZeroState;
use super::half::Wire;
use super::pipeline::{DeviceResult, PipelineRun, StageOutcome, StageRun};
use super::tensor::{finish_grads, gather_tensor, TpGroup, TpShard};
use crate::comm::{Comm, CommStats, DeviceMesh, Dim, Group, ReduceOp};
use crate::error::{EngineError, Result};
use crate::memory::{self, Term};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::transformer::{Half, ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{ModelConfig, ParamSpec};
use ferrotron_core::schedule::{build, PipelineSchedule, StagePartition};

/// Everything every device of a step shares: the model, the layout, its schedule, and the batch cut
/// into micro-batches (replica d takes the d-th contiguous share).
pub struct MeshStep<'a> {
    cfg: &'a ModelConfig,
    params: &'a ParamStore,
    layout: &'a Layout,
    partition: &'a StagePartition,
    mesh: DeviceMesh,
    schedule: PipelineSchedule,
    /// Micro-batches per replica.
    m: usize,
    micro: Vec<TokenBatch>,
    scale: f32,
    total_tokens: usize,
    /// Device r's memory is counted in account `account_base + r`.
    account_base: usize,
    /// A device made slow on purpose, and by how much per action (device seconds).
    slow_device: Option<(usize, f64)>,
    /// Mixed precision: the 16-bit format of weights, gradients and activations.
    storage: Option<Half>,
    /// fp16: dynamic loss scaling, and the scale now.
    loss_scaling: Option<LossScaling>,
    loss_scale: f64,
    clean_steps: usize,
    /// Training resumed from a checkpoint: where, and how each device restores its state.
    resume: Option<Resume<'a>>,
}

/// Where a resumed run starts: the first step to run, the loss scaler's state then, and how a
/// device, once built from the checkpoint's parameters, restores its optimizer state.
#[derive(Clone, Copy)]
pub struct Resume<'a> {
    pub step: usize,
    pub loss_scaler: Option<(f64, usize)>,
    pub restore: &'a (dyn Fn(&mut Device) -> Result<()> + Sync),
}

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

/// One device's lasting state: its model chunks and its parameters, gradients and optimizer state.
pub struct Device {
    pub rank: usize,
    pub shard: TpShard,
    chunks: Vec<Transformer>,
    pub zero: ZeroState,
}

impl<'a> MeshStep<'a> {
    /// Checks the batch against the layout and builds the schedule.
    pub fn new(
        cfg: &'a ModelConfig,
        params: &'a ParamStore,
        batch: &TokenBatch,
        layout: &'a Layout,
        partition: &'a StagePartition,
    ) -> Result<Self> {
        let mbs = layout.micro_batch_size.max(1);
        let (p, v, dp, tp) = (
            layout.pp.max(1),
            layout.vpp.max(1),
            layout.dp.max(1),
            layout.tp.max(1),
        );
        if !batch.batch.is_multiple_of(mbs * dp) {
            return Err(EngineError::Invalid(format!(
                "batch size {} is not divisible by dp × micro-batch size = {dp} × {mbs}",
                batch.batch
            )));
        }
        if partition.stages() != p * v {
            return Err(EngineError::Invalid(format!(
                "the partition has {} ranges, the layout needs pp·vpp = {} (one per model chunk)",
                partition.stages(),
                p * v
            )));
        }
        if layout.zero > 3 {
            return Err(EngineError::Invalid(format!(
                "zero={}: ZeRO stages are 0 to 3",
                layout.zero
            )));
        }
        TpShard::check(cfg, tp)?;
        let rows = mbs * batch.seq;
        if layout.sequence_parallel && tp > 1 && !rows.is_multiple_of(tp) {
            return Err(EngineError::Invalid(format!(
                "sequence parallelism: a micro-batch's {rows} tokens do not split over tp={tp}"
            )));
        }
        let m = batch.batch / (mbs * dp);
        let schedule = build(layout.schedule, p, m, v)?;
        let world = tp * dp * p;
        let mesh = DeviceMesh::new(tp, dp, p, world, world)?;
        Ok(Self {
            cfg,
            params,
            layout,
            partition,
            mesh,
            schedule,
            m,
            micro: micro_batches(batch, mbs),
            scale: 1.0 / batch.predicted_tokens().max(1) as f32,
            total_tokens: batch.predicted_tokens().max(1),
            account_base: 0,
            slow_device: None,
            storage: None,
            loss_scaling: None,
            loss_scale: 1.0,
            clean_steps: 0,
            resume: None,
        })
    }

    /// Resumes training: [`MeshStep::train_device`] starts at `resume.step` with the devices'
    /// optimizer state and the loss scaler restored.
    pub fn with_resume(mut self, resume: Option<Resume<'a>>) -> Self {
        self.resume = resume;
        self
    }

    /// The fp16 loss scaler's state: the scale and the clean steps since it last changed.
    pub fn loss_scaler(&self) -> Option<(f64, usize)> {
        self.loss_scaling
            .map(|_| (self.loss_scale, self.clean_steps))
    }

    /// Mixed precision: weights, gradients and activations stored (and moved) in `storage`; master
    /// weights and optimizer state in f32. fp16 should come with loss scaling.
    pub fn with_precision(mut self, storage: Option<Half>, scaling: Option<LossScaling>) -> Self {
        self.storage = storage;
        self.loss_scaling = scaling;
        self.loss_scale = scaling.map_or(1.0, |s| s.initial);
        self
    }

    /// Makes device `rank` compute `seconds` longer per action: a straggler, injected.
    pub fn with_slow_device(mut self, slow: Option<(usize, f64)>) -> Self {
        self.slow_device = slow;
        self
    }

    /// Counts device r's memory in account `base + r` (see [`crate::memory::Accounts`]).
    pub fn with_account_base(mut self, base: usize) -> Self {
        self.account_base = base;
        self
    }

    /// The memory account of device `rank`.
    pub fn account(&self, rank: usize) -> usize {
        self.account_base + rank
    }

    /// Devices the step runs on.
    pub fn world(&self) -> usize {
        self.mesh.world_size()
    }

    /// The next step's batch (same shape): training reuses the devices and the schedule.
    pub fn set_batch(&mut self, batch: &TokenBatch) -> Result<()> {
        let mbs = self.layout.micro_batch_size.max(1);
        if batch.batch != self.micro.len() * mbs || batch.seq != self.micro[0].seq {
            return Err(EngineError::Invalid(
                "every step's batch must have the first one's shape".into(),
            ));
        }
        self.micro = micro_batches(batch, mbs);
        self.scale = 1.0 / batch.predicted_tokens().max(1) as f32;
        self.total_tokens = batch.predicted_tokens().max(1);
        Ok(())
    }

    /// The layers of every model chunk device `rank` runs.
    fn ranges(&self, rank: usize) -> Vec<std::ops::Range<usize>> {
        let (_, _, s) = self.mesh.coords(rank);
        let (p, v) = (self.layout.pp.max(1), self.layout.vpp.max(1));
        (0..v)
            .map(|k| self.partition.layers[k * p + s].clone())
            .collect()
    }

    /// The parameters device `rank` holds, as its shard names and shapes them (in store order).
    pub fn device_specs(&self, rank: usize) -> Result<Vec<ParamSpec>> {
        let (t, _, _) = self.mesh.coords(rank);
        let local = TpShard::new(self.cfg, self.mesh.tp, t, false)?.local_config(self.cfg);
        let ranges = self.ranges(rank);
        Ok(local
            .param_specs()
            .into_iter()
            .filter(|spec| ranges.iter().any(|r| self.cfg.stage_owns(&spec.name, r)))
            .collect())
    }

    /// Builds device `rank`: its shard of `self.params`, its chunks, its ZeRO state.
    pub fn device(&self, rank: usize, adam: AdamWConfig) -> Result<Device> {
        let (cfg, layout) = (self.cfg, self.layout);
        let (t, d, _) = self.mesh.coords(rank);
        let shard = TpShard::new(cfg, self.mesh.tp, t, layout.sequence_parallel)?;
        let local = shard.local_config(cfg);
        let ranges = self.ranges(rank);
        let store = {
            let _weights = memory::scope(Term::Weights);
            shard.shard_store(
                cfg,
                &self
                    .params
                    .subset(|n| ranges.iter().any(|r| cfg.stage_owns(n, r))),
            )?
        };
        let chunks = ranges
            .iter()
            .map(|r| {
                Transformer::stage(&local, &store, r.clone())
                    .with_recompute(layout.recompute)
                    .with_vocab_slice(shard.vocab_slice(cfg))
                    .with_activation_storage(self.storage)
            })
            .collect();
        let dp_group = self.mesh.group_of(rank, Dim::Dp);
        let zero = ZeroState::new(
            cfg,
            store,
            layout.zero,
            dp_group,
            d,
            self.m,
            adam,
            self.storage,
        );
        Ok(Device {
            rank,
            shard,
            chunks,
            zero,
        })
    }

    /// Runs one forward and backward of this step's batch on `dev` (whose rank is `c.rank()`), then
    /// reduces the gradients over the replicas and the partial sums over the tensor-parallel group
    /// and the tied embedding's two stages. Returns the loss this device counts and what its action
    /// list measured.
    fn step_device<C: Comm>(&self, c: &mut C, dev: &Device) -> Result<StageOutcome> {
        let (t, d, s) = self.mesh.coords(dev.rank);
        let (p, tp) = (self.mesh.pp, self.mesh.tp);
        let device_of = |stage: usize| self.mesh.rank_of(t, d, stage);
        let boundary = self.micro[0].batch * self.micro[0].seq * self.cfg.hidden_size
            / if dev.shard.sequence_parallel { tp } else { 1 };
        let run = StageRun {
            schedule: &self.schedule,
            stage: s,
            stages: p,
            chunks_per_device: self.layout.vpp.max(1),
            device_of: &device_of,
            micro: &self.micro[d * self.m..(d + 1) * self.m],
            boundary,
            scale: self.scale * self.loss_scale as f32,
            counts_loss: t == 0,
            account: self.account(dev.rank),
            extra_compute_s: match self.slow_device {
                Some((r, s)) if r == dev.rank => s,
                _ => 0.0,
            },
            wire: Wire(self.storage),
        };
        dev.zero.begin_step();
        let tp_group = self.mesh.group_of(dev.rank, Dim::Tp);
        let tpg = TpGroup::new(c, tp_group.clone(), dev.shard).with_wire(Wire(self.storage));
        let out = {
            let _activations = memory::scope(Term::Activations);
            run.execute(&tpg, &dev.zero, &dev.chunks)?
        };
        drop(tpg);
        dev.zero.reduce_grads(c)?;
        let specs = dev.zero.specs();
        dev.zero.with_grad_view(|grads| -> Result<()> {
            // A tied output layer is the first stage's embedding copied to the last: their gradients
            // sum (the same piece of it on both under ZeRO).
            if self.cfg.tie_word_embeddings && p > 1 && (s == 0 || s == p - 1) {
                let g = Group::new("pp", vec![device_of(0), device_of(p - 1)]);
                let id = specs
                    .iter()
                    .position(|sp| sp.name == self.cfg.embedding_name())
                    .expect("tied embedding on the first and last stage");
                c.all_reduce(&g, grads[id], ReduceOp::Sum)?;
            }
            finish_grads(c, self.cfg, &dev.shard, &tp_group, &specs, grads)
        })?;
        Ok(out)
    }

    /// The global gradient norm: each parameter element counted exactly once over all devices
    /// (replicated copies, shared KV heads and the tied embedding's second copy excluded).
    fn grad_norm<C: Comm>(&self, c: &mut C, dev: &Device) -> Result<f64> {
        let (_, d, s) = self.mesh.coords(dev.rank);
        let specs = dev.zero.specs();
        let tied_copy = self.cfg.tie_word_embeddings && self.mesh.pp > 1 && s == self.mesh.pp - 1;
        let counts_dp = dev.zero.grads_sharded() || d == 0;
        let mut sq = [0f64];
        if counts_dp {
            sq[0] = dev.zero.with_grad_view(|grads| {
                specs
                    .iter()
                    .zip(grads.iter())
                    .filter(|(sp, _)| {
                        dev.shard.counts_in_norm(self.cfg, &sp.name)
                            && !(tied_copy && sp.name == self.cfg.embedding_name())
                    })
                    .map(|(_, g)| g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
                    .sum()
            });
        }
        c.all_reduce(&self.mesh.world(), &mut sq, ReduceOp::Sum)?;
        Ok(sq[0].sqrt())
    }

    /// Runs device `c.rank()`'s part of the step `1 + warmup` times (only the last counts) and returns
    /// its loss, its gradients (reduced over replicas, whole) and what it measured.
    pub fn run_device<C: Comm>(&self, c: &mut C, warmup: usize) -> Result<DeviceResult> {
        let account = self.account(c.rank());
        memory::set_device(account);
        let dev = self.device(c.rank(), AdamWConfig::default())?;
        let mut measured_from = c.stats().clone();
        let mut last = None;
        for _ in 0..=warmup {
            measured_from = c.stats().clone();
            memory::reset_peaks(account);
            last = Some(self.step_device(c, &dev)?);
        }
        let measured = memory::device_memory(account);
        let StageOutcome {
            loss,
            peak,
            peak_bytes,
            timeline,
            ..
        } = last.expect("at least one pass");
        let end = c.device_time();
        let stats = c.stats().since(&measured_from);
        // Whole gradients for the report (not part of the step: after the measurements).
        let grads = dev.zero.full_grads(c)?;
        Ok(DeviceResult {
            loss,
            grads,
            stats,
            peak,
            peak_bytes,
            end,
            timeline,
            memory: measured,
        })
    }

    /// Runs device `c.rank()` through optimizer steps up to `steps` (from 0, or from where a
    /// [`Resume`] says), the batch of step k from `batch_of(k)`
    /// (the same on every device), gradients clipped to `clip` by the global norm (0: off).
    /// `on_step` sees each step's report on every device.
    #[allow(clippy::too_many_arguments)]
    pub fn train_device<C: Comm>(
        &mut self,
        c: &mut C,
        steps: usize,
        batch_of: &dyn Fn(usize) -> TokenBatch,
        adam: AdamWConfig,
        lr: &LrSchedule,
        clip: f64,
        on_step: &mut dyn FnMut(&MeshStep, &mut C, &Device, &StepReport) -> Result<()>,
    ) -> Result<Device> {
        let account = self.account(c.rank());
        memory::set_device(account);
        let mut dev = self.device(c.rank(), adam)?;
        let mut first = 0;
        if let Some(r) = self.resume {
            (r.restore)(&mut dev)?;
            first = r.step;
            if let (Some(_), Some((scale, clean))) = (self.loss_scaling, r.loss_scaler) {
                (self.loss_scale, self.clean_steps) = (scale, clean);
            }
        }
        for step in first..steps {
            self.set_batch(&batch_of(step))?;
            memory::reset_peaks(account);
            let started = c.device_time();
            let from = c.stats().clone();
            let wall = std::time::Instant::now();
            let StageOutcome {
                loss,
                peak_bytes,
                timeline,
                transfers,
                ..
            } = self.step_device(c, &dev)?;
            let reduced = c.device_time();
            // Loss scaling: an inf or NaN anywhere skips the step for every device.
            let mut skipped = false;
            let scale_used = self.loss_scale;
            if let Some(ls) = self.loss_scaling {
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
                    skipped = true;
                    self.loss_scale = (self.loss_scale / 2.0).max(1.0);
                    self.clean_steps = 0;
                } else {
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
                }
            }
            let norm = if skipped {
                f64::NAN
            } else {
                self.grad_norm(c, &dev)?
            };
            if !skipped && clip > 0.0 && norm > clip {
                let scale = (clip / (norm + 1e-6)) as f32;
                dev.zero.with_grad_view(|grads| {
                    grads
                        .iter_mut()
                        .for_each(|g| g.iter_mut().for_each(|x| *x *= scale))
                });
            }
            let rate = lr.lr(step) as f32;
            let update_start = c.device_time();
            if !skipped {
                dev.zero.update(c, rate)?;
            }
            let update_end = c.device_time();
            // Every device learns the step's loss (summed from the devices that count it).
            let mut l = [loss];
            c.all_reduce(&self.mesh.world(), &mut l, ReduceOp::Sum)?;
            let ended = c.device_time();
            let stats = c.stats().since(&from);
            let report = StepReport {
                step,
                loss: l[0] / self.total_tokens as f64,
                grad_norm: norm,
                lr: rate as f64,
                // Computing is the device's CPU time; the rest of the step is waiting (bubble,
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
                transfers,
                wall_s: wall.elapsed().as_secs_f64(),
                memory: memory::device_memory(account),
                loss_scale: scale_used,
                skipped,
            };
            on_step(self, c, &dev, &report)?;
        }
        Ok(dev)
    }

    /// The whole model's parameters, gathered from every device onto rank 0 (`None` elsewhere).
    /// Every device must call it.
    pub fn gather_params<C: Comm>(&self, c: &mut C, dev: &Device) -> Result<Option<ParamStore>> {
        let mine = dev.zero.full_params(c)?;
        self.gather_to_root(c, mine, 1 << 61)
    }

    /// Sends every device's whole-shard store to rank 0, which assembles the model's tensors (from
    /// replica 0 of each stage's tensor-parallel group).
    fn gather_to_root<C: Comm>(
        &self,
        c: &mut C,
        mine: ParamStore,
        tag: u64,
    ) -> Result<Option<ParamStore>> {
        let (_, d, _) = self.mesh.coords(c.rank());
        if c.rank() != 0 {
            if d == 0 {
                for (i, t) in mine.tensors.iter().enumerate() {
                    c.send(0, t, tag + i as u64)?;
                }
            }
            return Ok(None);
        }
        let mut stores = vec![mine];
        for r in 1..self.world() {
            if self.mesh.coords(r).1 != 0 {
                continue;
            }
            let mut s = ParamStore::zeros(self.device_specs(r)?);
            for (i, t) in s.tensors.iter_mut().enumerate() {
                c.recv(r, t, tag + i as u64)?;
            }
            stores.push(s);
        }
        // `stores` is in rank order over replica 0: stage-major, tensor-parallel rank fastest.
        let mut full = self.params.zeros_like();
        for stage in stores.chunks(self.mesh.tp) {
            for spec in &stage[0].specs {
                let shards: Vec<&[f32]> = stage
                    .iter()
                    .map(|s| {
                        s.get(&spec.name)
                            .expect("a stage's devices hold its parameters")
                    })
                    .collect();
                let id = full.id(&spec.name).expect("model parameter");
                full.tensors[id] = gather_tensor(self.cfg, &full.specs[id], &shards)?;
            }
        }
        Ok(Some(full))
    }

    /// Runs this process's device of the step and collects every device's loss and gradients on
    /// rank 0, which returns the combined run (every other rank returns `None`). The entry for
    /// backends with one device per process (MPI); other ranks' communication statistics stay with
    /// them.
    pub fn run_collected<C: Comm>(&self, c: &mut C) -> Result<Option<PipelineRun>> {
        if c.world_size() != self.world() {
            return Err(EngineError::Invalid(format!(
                "layout `{}` needs {} devices, the job has {} ranks",
                self.layout,
                self.world(),
                c.world_size()
            )));
        }
        let wall = std::time::Instant::now();
        let mine = self.run_device(c, 0)?;
        // Tags above any pipeline tag (those fit in 48 bits).
        const COLLECT: u64 = 1 << 60;
        if c.rank() != 0 {
            let head = [
                mine.loss,
                mine.end,
                mine.stats.compute_time_s,
                mine.peak as f64,
                mine.peak_bytes as f64,
            ];
            c.send(0, &head, COLLECT)?;
            for (i, t) in mine.grads.tensors.iter().enumerate() {
                c.send(0, t, COLLECT + 1 + i as u64)?;
            }
            return Ok(None);
        }
        let mut results = vec![mine];
        for r in 1..self.world() {
            let mut head = [0f64; 5];
            c.recv(r, &mut head, COLLECT)?;
            let mut grads = ParamStore::zeros(self.device_specs(r)?);
            for (i, t) in grads.tensors.iter_mut().enumerate() {
                c.recv(r, t, COLLECT + 1 + i as u64)?;
            }
            results.push(DeviceResult {
                loss: head[0],
                grads,
                stats: CommStats {
                    rank: r,
                    compute_time_s: head[2],
                    ..CommStats::default()
                },
                peak: head[3] as usize,
                peak_bytes: head[4] as usize,
                end: head[1],
                timeline: Vec::new(),
                memory: memory::DeviceMemory::default(),
            });
        }
        self.combine(results, wall.elapsed().as_secs_f64())
            .map(Some)
    }

    /// Combines every device's result (in rank order) into the step's loss and whole gradients.
    pub fn combine(&self, results: Vec<DeviceResult>, wall_time_s: f64) -> Result<PipelineRun> {
        let mut full = self.params.zeros_like();
        let tp = self.mesh.tp;
        // Replica 0's devices, stage-major, tensor-parallel rank fastest.
        let replica0: Vec<&DeviceResult> = results
            .iter()
            .enumerate()
            .filter(|(r, _)| self.mesh.coords(*r).1 == 0)
            .map(|(_, x)| x)
            .collect();
        for stage in replica0.chunks(tp) {
            for spec in &stage[0].grads.specs {
                let shards: Vec<&[f32]> = stage
                    .iter()
                    .map(|r| {
                        r.grads
                            .get(&spec.name)
                            .expect("every device of a stage holds its parameters")
                    })
                    .collect();
                let id = full
                    .id(&spec.name)
                    .expect("stage parameters are model parameters");
                full.tensors[id] = gather_tensor(self.cfg, &full.specs[id], &shards)?;
            }
        }
        let mut run = PipelineRun {
            loss: 0.0,
            grads: ParamStore::zeros(Vec::new()),
            stats: Vec::new(),
            peak_stashed: Vec::new(),
            peak_stash_bytes: Vec::new(),
            device_time_s: Vec::new(),
            compute_time_s: Vec::new(),
            wall_time_s,
            timeline: Vec::new(),
            stages: self.mesh.pp,
            memory: Vec::new(),
        };
        for r in results {
            run.loss += r.loss;
            run.compute_time_s.push(r.stats.compute_time_s);
            run.stats.push(r.stats);
            run.peak_stashed.push(r.peak);
            run.peak_stash_bytes.push(r.peak_bytes);
            run.device_time_s.push(r.end);
            run.timeline.push(r.timeline);
            run.memory.push(r.memory);
        }
        run.loss /= self.total_tokens as f64;
        run.grads = full;
        Ok(run)
    }

    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
}

/// What one optimizer step measured on one device.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: usize,
    /// Mean loss over the global batch (the same on every device).
    pub loss: f64,
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
    /// Sends and receives between stages, (what, start, end) in device time.
    pub transfers: Vec<(String, f64, f64)>,
    /// Device-time intervals of the reductions after the last action (with the global norm), and
    /// of the optimizer step.
    pub reduce_s: (f64, f64),
    pub update_s: (f64, f64),
    pub wall_s: f64,
    /// This device's memory during the step, measured by term.
    pub memory: memory::DeviceMemory,
    /// fp16: the loss scale this step used, and whether it was skipped (inf/NaN in the gradients).
    pub loss_scale: f64,
    pub skipped: bool,
}

fn micro_batches(batch: &TokenBatch, mbs: usize) -> Vec<TokenBatch> {
    batch
        .ids
        .chunks(mbs * batch.seq)
        .map(|ids| TokenBatch {
            ids: ids.to_vec(),
            batch: mbs,
            seq: batch.seq,
        })
        .collect()
}

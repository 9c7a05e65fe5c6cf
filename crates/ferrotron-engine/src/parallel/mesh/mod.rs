//! The dp × pp × tp mesh: which device holds what, one step of forward and backward on every device
//! (each data-parallel replica on its share of the global batch), the gradient reductions that make
//! the step equal the unsplit one, and the optimizer step over ZeRO-sharded state.
//!
//! Ranks follow the design's order: `rank = tp_rank + tp · (dp_rank + dp · stage)`.
//!
//! `train.rs` runs a device through optimizer steps; `gather.rs` brings whole tensors to rank 0;
//! `runners.rs` runs one step of the whole mesh on threads.

mod gather;
mod runners;
mod segments;
mod train;

pub use runners::{pipeline_step, pipeline_steps, pipeline_steps_of};
pub use train::{LossScaling, StepReport, Training};

use super::context::ContextShard;
use super::data::{GroupedZero, ZeroState};
use super::pipeline::{DeviceResult, StageOutcome, StageRun};
use super::tensor::{finish_grads, TpGroup, TpShard};
use super::weights::WeightSource;
use crate::comm::{Comm, DeviceMesh, Dim, Group, ReduceOp};
use crate::error::{EngineError, Result};
use crate::half_storage::Wire;
use crate::memory::{self, Term};
use crate::optim::AdamWConfig;
use crate::transformer::{FrozenBase, ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig, ParamSpec};
use ferrotron_core::precision::MixedPrecision;
use ferrotron_core::rank::Coords;
use ferrotron_core::schedule::{build, build_async, PipelineSchedule, StagePartition};

/// Everything every device of a step shares: the model, the layout, its schedule, and the batch cut
/// into micro-batches (replica d takes the d-th contiguous share).
pub struct MeshStep<'a> {
    cfg: &'a ModelConfig,
    /// Where each device reads its shard of what trains (the model, or with LoRA the adapters).
    params: &'a dyn WeightSource,
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
    /// The run's precision policy: storage, wire format and products follow from it.
    precision: MixedPrecision,
    /// Dynamic loss scaling's settings (used when the policy needs it: fp16), and the scale now.
    loss_scaling: LossScaling,
    loss_scale: f64,
    clean_steps: usize,
    /// Training resumed from a checkpoint: where, and how each device restores its state.
    resume: Option<Resume<'a>>,
    /// Kernel threads per device: 1 when several devices share the process's cores.
    kernel_threads: usize,
    /// ZeRO-3: prefetch the next unit's gather (on by default).
    zero3_prefetch: bool,
    /// LoRA: the frozen base (the whole model's parameters) and the adapters' configuration; then
    /// `params` are the adapters, the only tensors that train.
    frozen: Option<(&'a dyn WeightSource, &'a LoraConfig)>,
    /// Asynchronous schedules: whether the pipeline drains after (0-based) step k (an evaluation
    /// or a checkpoint follows); it always does at the end.
    drain_after: Option<&'a (dyn Fn(usize) -> bool + Sync)>,
}

/// Where a resumed run starts: the first step to run, the loss scaler's state then, and how a
/// device, once built from the checkpoint's parameters, restores its optimizer state.
#[derive(Clone, Copy)]
pub struct Resume<'a> {
    pub step: usize,
    pub loss_scaler: Option<(f64, usize)>,
    pub restore: &'a (dyn Fn(&mut Device) -> Result<()> + Sync),
}

/// One device's lasting state: its model chunks and its parameters, gradients and optimizer state.
pub struct Device {
    pub rank: usize,
    pub shard: TpShard,
    /// Bytes this device read from where the model is stored to build its shard (its files'
    /// headers included; 0 for a model in memory).
    pub model_bytes_read: u64,
    pub(crate) chunks: Vec<Transformer>,
    pub zero: GroupedZero,
}

impl<'a> MeshStep<'a> {
    /// Checks the batch against the layout and builds the schedule.
    pub fn new(
        cfg: &'a ModelConfig,
        params: &'a dyn WeightSource,
        batch: &TokenBatch,
        layout: &'a Layout,
        partition: &'a StagePartition,
    ) -> Result<Self> {
        batch.check(cfg).map_err(EngineError::Invalid)?;
        let mbs = layout.micro_batch_size.max(1);
        let (p, v, dp, tp, cp) = (
            layout.pp.max(1),
            layout.vpp.max(1),
            layout.dp.max(1),
            layout.tp.max(1),
            layout.cp.max(1),
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
        let context = ContextShard {
            size: cp,
            index: 0,
            comm: layout.cp_comm,
        };
        context.check(batch.seq).map_err(EngineError::Invalid)?;
        let local = TpShard::new(cfg, tp, 0, false)?.local_config(cfg);
        context
            .check_heads(local.num_heads, local.num_kv_heads)
            .map_err(EngineError::Invalid)?;
        let rows = mbs * batch.seq / cp;
        if layout.sequence_parallel && tp > 1 && !rows.is_multiple_of(tp) {
            return Err(EngineError::Invalid(format!(
                "sequence parallelism: a micro-batch's {rows} tokens do not split over tp={tp}"
            )));
        }
        let m = batch.batch / (mbs * dp);
        // An asynchronous schedule spans the steps of a segment (`train.rs` builds each); one
        // step's list is kept to check the shape here.
        let schedule = if layout.schedule.is_async() {
            build_async(layout.schedule, p, m, 1, true)?
        } else {
            build(layout.schedule, p, m, v)?
        };
        let world = layout.world_size();
        let mesh = DeviceMesh::new(layout.rank_grid(world), world)?;
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
            precision: MixedPrecision::F32,
            loss_scaling: LossScaling::DEFAULT,
            loss_scale: 1.0,
            clean_steps: 0,
            resume: None,
            kernel_threads: 1,
            zero3_prefetch: true,
            frozen: None,
            drain_after: None,
        })
    }

    /// Asynchronous schedules: drain the pipeline after each step `drain` names (an evaluation or
    /// a checkpoint follows it), besides the end.
    pub fn with_drain_after(mut self, drain: &'a (dyn Fn(usize) -> bool + Sync)) -> Self {
        self.drain_after = Some(drain);
        self
    }

    /// LoRA: `params` (given to [`MeshStep::new`]) are the adapters of `lora` on the frozen `base`.
    /// Each device holds its shard of the base (16-bit under mixed precision) beside its adapters;
    /// only the adapters have gradients, optimizer state and (ZeRO) shards.
    pub fn with_lora(mut self, base: &'a dyn WeightSource, lora: &'a LoraConfig) -> Self {
        self.frozen = Some((base, lora));
        self
    }

    /// The routed experts' part of device `dev`'s weights between steps (what it trains, and
    /// under LoRA its frozen base's experts): what `train` shows apart from the rest of the weights
    /// term, beside the planner's `expert_weight_bytes_per_stage`. 0 for a dense model.
    pub fn expert_weight_bytes(&self, dev: &Device) -> u64 {
        let routed =
            |s: &ferrotron_core::model::ParamSpec| self.cfg.routed_expert_of(&s.name).is_some();
        let frozen: usize = dev
            .chunks
            .iter()
            .filter_map(Transformer::frozen_base)
            .map(|b| b.bytes_where(&routed))
            .sum();
        (dev.zero.weight_bytes_where(&routed) + frozen) as u64
    }

    /// The LoRA configuration, when the step trains adapters on a frozen base.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.frozen.map(|f| f.1)
    }

    /// ZeRO-3 prefetch on or off (benchmarks compare the two).
    pub fn with_zero3_prefetch(mut self, on: bool) -> Self {
        self.zero3_prefetch = on;
        self
    }

    /// Kernel threads each device computes on. More than one only for a device that has the
    /// process to itself (a one-device world, or an MPI rank), whose clock must then be wall time.
    pub fn with_kernel_threads(mut self, threads: usize) -> Self {
        self.kernel_threads = threads.max(1);
        self
    }

    /// Kernel threads each device computes on.
    pub fn kernel_threads(&self) -> usize {
        self.kernel_threads
    }

    /// Resumes training: [`MeshStep::train_device`] starts at `resume.step` with the devices'
    /// optimizer state and the loss scaler restored.
    pub fn with_resume(mut self, resume: Option<Resume<'a>>) -> Self {
        self.resume = resume;
        self
    }

    /// The fp16 loss scaler's state: the scale and the clean steps since it last changed.
    pub fn loss_scaler(&self) -> Option<(f64, usize)> {
        self.loss_scaling()
            .map(|_| (self.loss_scale, self.clean_steps))
    }

    /// The run's precision policy: under mixed precision, weights, gradients and activations are
    /// stored (and moved) in 16 bits, master weights and optimizer state in f32; bf16 multiplies in
    /// bf16; fp16 scales the loss ([`MeshStep::with_loss_scaling`]'s settings).
    pub fn with_precision(mut self, precision: MixedPrecision) -> Self {
        self.precision = precision;
        self.loss_scale = self.loss_scaling().map_or(1.0, |s| s.initial);
        self
    }

    /// Dynamic loss scaling's settings, for a policy that scales the loss.
    pub fn with_loss_scaling(mut self, scaling: LossScaling) -> Self {
        self.loss_scaling = scaling;
        self.loss_scale = self.loss_scaling().map_or(1.0, |s| s.initial);
        self
    }

    /// Dynamic loss scaling, when the policy needs it.
    pub(super) fn loss_scaling(&self) -> Option<LossScaling> {
        self.precision
            .needs_loss_scaling()
            .then_some(self.loss_scaling)
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
        let s = self.mesh.coords(rank).pp;
        let (p, v) = (self.layout.pp.max(1), self.layout.vpp.max(1));
        (0..v)
            .map(|k| self.partition.layers[k * p + s].clone())
            .collect()
    }

    /// The model as device `rank` holds it: its tensor-parallel shard's shape, with its share of
    /// the experts under expert parallelism.
    fn local_config(&self, rank: usize, shard: &TpShard) -> ModelConfig {
        let l = self.layout;
        shard
            .local_config(self.cfg)
            .expert_shard(self.mesh.expert_shard(rank, l.ep, l.expert_blocks()))
    }

    /// The parameters device `rank` holds, as its shard names and shapes them (in store order).
    pub fn device_specs(&self, rank: usize) -> Result<Vec<ParamSpec>> {
        let t = self.mesh.coords(rank).tp;
        let local = self.local_config(rank, &TpShard::of_layout(self.cfg, self.layout, t)?);
        let ranges = self.ranges(rank);
        let specs = match self.frozen {
            Some((_, lora)) => lora.adapter_specs(&local),
            None => local.param_specs(),
        };
        Ok(specs
            .into_iter()
            .filter(|spec| ranges.iter().any(|r| self.cfg.stage_owns(&spec.name, r)))
            .collect())
    }

    /// A mixture-of-experts model runs on the layouts [`Layout::experts_fit`] allows.
    fn check_experts(&self) -> Result<()> {
        let l = self.layout;
        l.experts_fit(self.cfg)
            .map_err(|(_, why)| EngineError::Invalid(format!("layout `{l}`: {why}")))
    }

    /// Builds device `rank`: its shard of `self.params`, its chunks, its ZeRO state.
    pub fn device(&self, rank: usize, adam: AdamWConfig) -> Result<Device> {
        self.check_experts()?;
        let (cfg, layout) = (self.cfg, self.layout);
        let t = self.mesh.coords(rank).tp;
        let shard = TpShard::of_layout(cfg, layout, t)?;
        let local = self.local_config(rank, &shard);
        let ranges = self.ranges(rank);
        {
            let _other = memory::scope(Term::Other);
            crate::kernels::CpuBackend::with_threads(self.kernel_threads).reserve_workspace();
        }
        let held = local.moe.as_ref().map(|m| m.held.held(m.num_experts));
        let mine = |n: &str| {
            ranges.iter().any(|r| cfg.stage_owns(n, r))
                && cfg
                    .routed_expert_of(n)
                    .is_none_or(|e| held.as_ref().is_none_or(|h| h.contains(&e)))
        };
        let (store, mut model_bytes_read) = {
            let _weights = memory::scope(Term::Weights);
            shard.shard_store(cfg, self.params, &mine)?
        };
        model_bytes_read += self.params.fixed_bytes();
        let base_shard = match self.frozen {
            Some((base, _)) => {
                let _weights = memory::scope(Term::Weights);
                let (store, read) = shard.shard_store(cfg, base, &mine)?;
                model_bytes_read += read + base.fixed_bytes();
                Some(store)
            }
            None => None,
        };
        let chunks = ranges
            .iter()
            .map(|r| {
                let chunk = |p: &ParamStore| {
                    Transformer::stage(&local, p, r.clone())
                        .with_recompute(layout.recompute)
                        .with_vocab_slice(shard.vocab_slice(cfg))
                        .with_activation_storage(self.precision.storage())
                };
                match (&base_shard, self.frozen) {
                    (Some(b), Some((_, lora))) => {
                        let _weights = memory::scope(Term::Weights);
                        let mine = b.subset(|n| cfg.stage_owns(n, r));
                        let base = FrozenBase::new(&local, mine, self.precision.storage());
                        // ZeRO-3 shards the 4-bit codes of a QLoRA base over the replicas too.
                        let base = if layout.zero == 3 {
                            let replicas = self.mesh.replica_group(rank);
                            base.shard_codes(replicas.size(), self.mesh.replica_index(rank))
                        } else {
                            base
                        };
                        chunk(base.names()).with_lora(lora, &store, base)
                    }
                    _ => chunk(&store),
                }
            })
            .collect();
        drop(base_shard);
        // The shard's replicas (dp × cp) sum their gradients, and ZeRO shards over them; under
        // expert parallelism the routed experts' only over the replicas holding the same ones.
        let state = |store: ParamStore, (group, index): (crate::comm::Group, usize)| {
            ZeroState::new(
                cfg,
                store,
                layout.zero,
                group,
                index,
                self.m,
                adam,
                self.precision.storage(),
            )
        };
        let replicas = (self.mesh.replica_group(rank), self.mesh.replica_index(rank));
        let mut zero = if layout.ep > 1 {
            let [(experts, expert_at), (dense, dense_at)] =
                store.split(|n| cfg.routed_expert_of(n).is_some());
            let expert_replicas = self.mesh.expert_replica_group(rank, layout.ep);
            GroupedZero::from_parts(vec![
                (state(dense, replicas), dense_at),
                (state(experts, expert_replicas), expert_at),
            ])
        } else {
            GroupedZero::whole(state(store, replicas))
        };
        zero.set_threaded_update(self.kernel_threads > 1);
        zero.set_prefetch(self.zero3_prefetch);
        Ok(Device {
            rank,
            shard,
            model_bytes_read,
            chunks,
            zero,
        })
    }

    /// Runs one forward and backward of this step's batch on `dev` (whose rank is `c.rank()`), then
    /// reduces the gradients over the replicas and the partial sums over the tensor-parallel group
    /// and the tied embedding's two stages. Returns the loss this device counts and what its action
    /// list measured.
    fn step_device<C: Comm>(&self, c: &mut C, dev: &mut Device) -> Result<StageOutcome> {
        if self.layout.schedule.is_async() {
            return Err(EngineError::Invalid(format!(
                "schedule={} is asynchronous: it changes the optimizer's semantics across steps, \
                 so it has no one-step gradients; train with it, or compare it with its \
                 delayed-update reference (`ferrotron verify --steps K`)",
                self.layout.schedule.name()
            )));
        }
        let at = self.mesh.coords(dev.rank);
        let (t, s) = (at.tp, at.pp);
        let (p, tp) = (self.mesh.pp, self.mesh.tp);
        let device_of = |stage: usize| self.mesh.rank_of(Coords { pp: stage, ..at });
        let (micro, targets) =
            self.device_batches(dev.rank, &self.micro[at.dp * self.m..(at.dp + 1) * self.m]);
        let boundary = micro[0].batch * micro[0].seq * self.cfg.hidden_size
            / if dev.shard.sequence_parallel { tp } else { 1 };
        let replicas = self.mesh.replica_group(dev.rank);
        let router_group = (self.cfg.moe.is_some() && replicas.size() > 1).then_some(&replicas);
        let run = StageRun {
            schedule: &self.schedule,
            stage: s,
            stages: p,
            chunks_per_device: self.layout.vpp.max(1),
            device_of: &device_of,
            micro: &micro,
            targets: &targets,
            boundary,
            scale: self.scale * self.loss_scale as f32,
            counts_loss: t == 0,
            account: self.account(dev.rank),
            extra_compute_s: self.extra_compute_s(dev.rank),
            precision: self.precision,
            threads: self.kernel_threads,
            router_group,
        };
        dev.zero.begin_step();
        let tp_group = self.mesh.group_of(dev.rank, Dim::Tp);
        let tpg = self.shard_group(c, dev);
        let out = {
            let _activations = memory::scope(Term::Activations);
            run.execute(&tpg, &mut dev.zero, &dev.chunks)?
        };
        drop(tpg);
        dev.zero.reduce_grads(c)?;
        let specs = dev.zero.specs();
        dev.zero.with_grad_view(|grads| -> Result<()> {
            // A tied output layer is the first stage's embedding copied to the last: their gradients
            // sum (the same piece of it on both under ZeRO).
            let trains_embedding = self.frozen.is_none();
            if self.cfg.tie_word_embeddings && trains_embedding && p > 1 && (s == 0 || s == p - 1) {
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
    fn grad_norm<C: Comm>(&self, c: &mut C, dev: &mut Device) -> Result<f64> {
        let mut sq = [self.grad_sq_partial(dev)];
        c.all_reduce(&self.mesh.world(), &mut sq, ReduceOp::Sum)?;
        Ok(sq[0].sqrt())
    }

    /// Device `dev`'s share of the squared global gradient norm (of its reduced gradients).
    pub(crate) fn grad_sq_partial(&self, dev: &mut Device) -> f64 {
        let s = self.mesh.coords(dev.rank).pp;
        let specs = dev.zero.specs();
        let tied_copy = self.cfg.tie_word_embeddings && self.mesh.pp > 1 && s == self.mesh.pp - 1;
        // Identical replicas' copies are counted a part on each (every replica sums its share).
        dev.zero.with_counted_grad_view(|grads, counted| {
            specs
                .iter()
                .zip(grads.iter())
                .zip(counted)
                .filter(|((sp, _), _)| {
                    dev.shard.counts_in_norm(self.cfg, &sp.name)
                        && !(tied_copy && sp.name == self.cfg.embedding_name())
                })
                .map(|((_, g), part)| sum_of_squares(&g[part.clone()], self.kernel_threads))
                .sum()
        })
    }

    /// The name of the first of device `dev`'s tensors (in model order) whose reduced gradient
    /// holds a NaN or an infinity, if any.
    pub(crate) fn first_non_finite_grad(&self, dev: &mut Device) -> Option<String> {
        let specs = dev.zero.specs();
        dev.zero.with_grad_view(|grads| {
            specs
                .iter()
                .zip(grads.iter())
                .find(|(_, g)| g.iter().any(|x| !x.is_finite()))
                .map(|(sp, _)| sp.name.clone())
        })
    }

    /// Runs device `c.rank()`'s part of the step `1 + warmup` times (only the last counts) and returns
    /// its loss, its gradients (reduced over replicas, whole) and what it measured.
    pub fn run_device<C: Comm>(&self, c: &mut C, warmup: usize) -> Result<DeviceResult> {
        let account = self.account(c.rank());
        memory::set_device(account);
        let mut dev = self.device(c.rank(), AdamWConfig::default())?;
        let mut measured_from = c.stats().clone();
        let mut last = None;
        for _ in 0..=warmup {
            measured_from = c.stats().clone();
            memory::reset_peaks(account);
            let out = self.step_device(c, &mut dev)?;
            if let Some(e) = out.over_capacity {
                return Err(e);
            }
            last = Some(out);
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
        // Whole gradients for the report (not part of the step: after the measurements), of the
        // loss itself: fp16's loss scale divided out, as the optimizer step would.
        let mut grads = dev.zero.full_grads(c)?;
        if self.loss_scale != 1.0 {
            let unscale = (1.0 / self.loss_scale) as f32;
            grads
                .tensors
                .iter_mut()
                .for_each(|t| t.iter_mut().for_each(|x| *x *= unscale));
        }
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

    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// Seconds device `rank` computes longer per action (a straggler made on purpose).
    pub(super) fn extra_compute_s(&self, rank: usize) -> f64 {
        match self.slow_device {
            Some((r, s)) if r == rank => s,
            _ => 0.0,
        }
    }

    /// Device `rank`'s place in its context-parallel group.
    pub fn context_of(&self, rank: usize) -> ContextShard {
        ContextShard {
            size: self.mesh.cp,
            index: self.mesh.coords(rank).cp,
            comm: self.layout.cp_comm,
        }
    }

    /// What device `rank` runs of its replica's micro-batches (its part of each sequence under
    /// context parallelism), and their next-token targets.
    pub(super) fn device_batches(
        &self,
        rank: usize,
        micro: &[TokenBatch],
    ) -> (Vec<TokenBatch>, Vec<Vec<Option<u32>>>) {
        let cx = self.context_of(rank);
        micro.iter().map(|b| cx.split(b)).unzip()
    }

    /// The collectives device `dev`'s model shard calls: its tensor-parallel group, and its
    /// context-parallel group when sequences are split.
    pub(super) fn shard_group<'c, C: Comm>(&self, c: &'c mut C, dev: &Device) -> TpGroup<'c, C> {
        let tp_group = self.mesh.group_of(dev.rank, Dim::Tp);
        let cp_group = self.mesh.group_of(dev.rank, Dim::Cp);
        let (ep_group, ep_index) = self.mesh.expert_group(dev.rank, self.layout.ep.max(1));
        TpGroup::new(c, tp_group, dev.shard)
            .with_wire(Wire::of(self.precision))
            .with_context(self.context_of(dev.rank), cp_group)
            .with_experts(ep_group, ep_index)
    }
}

/// Σx² in f64, over the device's kernel threads when it has several (chunked, so the order of the
/// partial sums depends only on the length).
pub(crate) fn sum_of_squares(g: &[f32], threads: usize) -> f64 {
    let sq = |c: &[f32]| c.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
    if threads > 1 && g.len() >= 1 << 17 {
        use rayon::prelude::*;
        let parts: Vec<f64> = g.par_chunks(1 << 16).map(sq).collect();
        parts.iter().sum()
    } else {
        sq(g)
    }
}

pub(super) fn micro_batches(batch: &TokenBatch, mbs: usize) -> Vec<TokenBatch> {
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

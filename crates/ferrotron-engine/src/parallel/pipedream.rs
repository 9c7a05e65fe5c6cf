//! Asynchronous pipelines (PipeDream, PipeDream-2BW): one device runs its stage's list for a segment
//! of optimizer steps without a flush — each forward on the weight version the list names, each
//! backward on the version its forward used, each update where the list puts it — and keeps the
//! versions that micro-batches still in flight will need (weight stashing). The lists and their
//! semantics are `ferrotron_core::schedule::build_async`'s.
//!
//! An update's gradients accumulate in a store of their own (2BW holds a step's until its update
//! while the next step's accumulate). When the stage's last backward of an update is done the update
//! is *closed*: its gradients are reduced over the replicas and the tensor-parallel group, a tied
//! embedding's two halves are summed between the end stages, and this device's share of the squared
//! global norm is sent to every device. At the update those messages are received — clipping uses
//! the global norm of the (delayed) gradients across every stage — and the optimizer steps.

use super::data::{GroupedUpdateGrads, GroupedZero};
use super::mesh::{Device, MeshStep};
use super::pipeline::{add_expert_counts, clocks, Pass, StageOutcome, StageRun};
use super::tensor::{finish_grads, TpGroup};
use crate::comm::{Comm, Group};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::memory::{self, Term};
use crate::transformer::{ParamStore, Resident, Transformer};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::Action;
use std::collections::HashMap;

/// Message tags of the exchanges around an update (above the pipeline's, below the collectors').
const NORM: u64 = 1 << 57;
const TIED: u64 = 1 << 56;
const TIED_SUM: u64 = (1 << 56) | (1 << 55);

/// What a device's segment needs beyond its stage's run.
pub(crate) struct SegmentRun<'a> {
    pub run: StageRun<'a>,
    pub mesh: &'a MeshStep<'a>,
    pub cfg: &'a ModelConfig,
    /// Micro-batches per optimizer step of the run (the data's step, whatever the updates).
    pub micro_per_step: usize,
    /// The learning rate of each update of the segment.
    pub lr_of: &'a dyn Fn(usize) -> f32,
    /// Clip each update's gradients to this global norm (0: off).
    pub clip: f64,
    /// The devices of the world (the norm's exchange), this device's tensor-parallel group, and
    /// the device of the same tensor-parallel and data-parallel ranks on stage `s`.
    pub world: usize,
    pub tp_group: Group,
    /// Whether the tied embedding's gradient is summed between the first and the last stage.
    pub tied: bool,
}

/// What a device measured over a segment.
pub(crate) struct SegmentOutcome {
    pub outcome: StageOutcome,
    /// Per step of the segment: the loss this device counts, summed over its micro-batches.
    pub step_loss: Vec<f64>,
    /// Per update: the global gradient norm before clipping (NaN when not clipping).
    pub update_norm: Vec<f64>,
    /// A mixture of experts: per step of the segment, this device's expert counts of its
    /// micro-batches (as [`StageOutcome::expert_tokens`]).
    pub step_expert_tokens: Vec<Vec<Vec<f64>>>,
}

/// The weight versions of this device: the newest in the optimizer's state, older ones stashed
/// while a micro-batch in flight (or a forward to come) reads them.
struct Versions {
    current: usize,
    stash: HashMap<usize, ParamStore>,
    /// The last action index that reads each version.
    last_use: HashMap<usize, usize>,
}

impl Versions {
    fn of(list: &[Action], versions: &[usize]) -> Self {
        let mut last_use = HashMap::new();
        for (i, (a, &v)) in list.iter().zip(versions).enumerate() {
            if !matches!(a, Action::Update { .. }) {
                last_use.insert(v, i);
            }
        }
        Self {
            current: 0,
            stash: HashMap::new(),
            last_use,
        }
    }

    fn params<'z>(&'z self, zero: &'z GroupedZero, v: usize) -> Result<&'z ParamStore> {
        if v == self.current {
            return Ok(zero.current_params());
        }
        self.stash.get(&v).ok_or_else(|| {
            EngineError::Invalid(format!("weight version {v} is neither current nor stashed"))
        })
    }

    /// Before an update at action `at`: keeps the current version if anything after reads it.
    fn stash_current(&mut self, zero: &GroupedZero, at: usize) {
        if self.last_use.get(&self.current).is_some_and(|&i| i > at) {
            let current = zero.current_params();
            // The bookkeeping outside the account: the version's weights are its tensors (and
            // under bf16 the compute copies it keeps alive, counted when an update copies them).
            let mut version = ParamStore::empty(current.specs.clone());
            version.bf16 = current.bf16.clone();
            version.nf4 = current.nf4.clone();
            let _weights = memory::scope(Term::Weights);
            version.tensors = current.tensors.clone();
            self.stash.insert(self.current, version);
        }
    }

    /// After action `at`: drops the stashed versions nothing reads any more.
    fn release(&mut self, at: usize) {
        let last_use = &self.last_use;
        self.stash
            .retain(|v, _| last_use.get(v).is_some_and(|&i| i > at));
    }

    /// The stashed versions' bytes: f32 tensors, and (mixed precision) the 16-bit compute copies
    /// they keep alive.
    fn stashed_bytes(&self) -> usize {
        let bytes = |p: &ParamStore| {
            let f32s: usize = p.tensors.iter().map(|t| 4 * t.len()).sum();
            let bf16s: usize = p.bf16.iter().flatten().map(|t| 2 * t.len()).sum();
            f32s + bf16s
        };
        self.stash.values().map(bytes).sum()
    }
}

impl SegmentRun<'_> {
    /// Runs this device's list of the segment.
    pub fn execute<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        dev: &mut Device,
        chunks: &[Transformer],
    ) -> Result<SegmentOutcome> {
        let run = &self.run;
        let sched = run.schedule;
        let list = &sched.actions[run.stage];
        let be = CpuBackend::with_threads(run.threads.max(1)).computing(run.precision.products());
        let updates = sched.micro_batches.div_ceil(sched.micro_batches_per_update);
        let mut left: Vec<usize> = vec![0; updates];
        for a in list {
            if let Action::Backward { mb, .. } = a {
                left[sched.update_of(*mb)] += 1;
            }
        }
        // The state's own whole-gradient store goes unused (each update accumulates in a store of
        // its own, swapped in for its reductions and its step): freed.
        let mut own = dev.zero.no_update_grads();
        dev.zero.swap_update_grads(&mut own);
        drop(own);
        dev.zero.begin_versions(&mut **tpg.comm())?;
        let result = self.run_list(tpg, dev, chunks, &be, &mut left);
        dev.zero.end_versions();
        result
    }

    /// [`SegmentRun::execute`]'s list, between the views of its first and its last version.
    fn run_list<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        dev: &mut Device,
        chunks: &[Transformer],
        be: &CpuBackend,
        left: &mut [usize],
    ) -> Result<SegmentOutcome> {
        let run = &self.run;
        let sched = run.schedule;
        let (list, versions) = (&sched.actions[run.stage], &sched.versions[run.stage]);
        let updates = left.len();
        let steps = sched.micro_batches / self.micro_per_step;
        let mut vers = Versions::of(list, versions);
        let mut open: HashMap<usize, GroupedUpdateGrads> = HashMap::new();
        let mut closed: HashMap<usize, (GroupedUpdateGrads, f64)> = HashMap::new();
        let mut out = SegmentOutcome {
            outcome: StageOutcome::default(),
            step_loss: vec![0.0; steps],
            update_norm: vec![f64::NAN; updates],
            step_expert_tokens: vec![Vec::new(); steps],
        };
        let mut pass = Pass::default();
        let now = tpg.comm().device_time();
        pass.out.memory.push(memory::sample(run.account, now));
        let mut peak_versions = 0usize;
        for (i, (&action, &v)) in list.iter().zip(versions).enumerate() {
            run.check_capacity(&mut pass.out.over_capacity);
            match action {
                Action::Forward { mb, .. } => {
                    let mut res = Resident::new(vers.params(&dev.zero, v)?);
                    run.forward(tpg, &mut res, be, &chunks[0], &mut pass, (mb, 0))?;
                    // Each micro-batch's expert counts go to its step.
                    let counts = std::mem::take(&mut pass.out.expert_tokens);
                    let step = &mut out.step_expert_tokens[mb / self.micro_per_step];
                    for (layer, row) in counts.iter().enumerate() {
                        add_expert_counts(step, layer, row);
                    }
                }
                Action::Backward { mb, .. } => {
                    let u = sched.update_of(mb);
                    let grads = open.entry(u).or_insert_with(|| dev.zero.update_grads());
                    let before = pass.out.loss;
                    let zero = &dev.zero;
                    let mut res = zero.accumulating(vers.params(zero, v)?, grads);
                    run.backward(tpg, &mut res, be, &chunks[0], &mut pass, (mb, 0), false)?;
                    out.step_loss[mb / self.micro_per_step] += pass.out.loss - before;
                    left[u] -= 1;
                    if left[u] == 0 {
                        let g = open.remove(&u).expect("opened by its first backward");
                        let closed_u = self.close(tpg, dev, u, g)?;
                        closed.insert(u, closed_u);
                    }
                }
                Action::Update { step: u } => {
                    let started = clocks(tpg);
                    let (g, partial) = closed.remove(&u).ok_or_else(|| {
                        EngineError::Invalid(format!(
                            "stage {}: update {u} before its micro-batches' backwards",
                            run.stage
                        ))
                    })?;
                    vers.stash_current(&dev.zero, i);
                    out.update_norm[u] = self.apply(tpg, dev, u, g, partial)?;
                    vers.current += 1;
                    run.computed(tpg, action, started, &mut pass)?;
                }
                other => {
                    return Err(EngineError::Invalid(format!(
                        "stage {}: {other} in an asynchronous list",
                        run.stage
                    )))
                }
            }
            vers.release(i);
            peak_versions = peak_versions.max(vers.stash.len());
            pass.out.peak_bytes = pass.out.peak_bytes.max(vers.stashed_bytes());
        }
        run.check_capacity(&mut pass.out.over_capacity);
        // `peak` counts the versions stashed at once (the stash of activations is in the memory
        // accounting).
        pass.out.peak = peak_versions;
        out.outcome = pass.out;
        Ok(out)
    }

    /// Ends update `u`'s accumulation on this device: reductions over the replicas and the
    /// tensor-parallel group, the tied embedding's halves, and this device's share of the squared
    /// global norm sent to every device. Returns the reduced gradients and that share.
    fn close<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        dev: &mut Device,
        u: usize,
        mut g: GroupedUpdateGrads,
    ) -> Result<(GroupedUpdateGrads, f64)> {
        let run = &self.run;
        let (s, p) = (run.stage, run.stages);
        let mut c = tpg.comm();
        let c = &mut **c;
        let specs = dev.zero.specs();
        dev.zero.swap_update_grads(&mut g);
        let reduced = (|| -> Result<f64> {
            dev.zero.reduce_all(c)?;
            let shard = dev.shard;
            dev.zero.with_grad_view(|grads| -> Result<()> {
                finish_grads(c, self.cfg, &shard, &self.tp_group, &specs, grads)?;
                if self.tied && p > 1 && (s == 0 || s == p - 1) {
                    let id = specs
                        .iter()
                        .position(|sp| sp.name == self.cfg.embedding_name())
                        .expect("the tied embedding is on the first and the last stage");
                    let (first, last) = ((run.device_of)(0), (run.device_of)(p - 1));
                    if s == p - 1 {
                        c.send(first, grads[id], TIED | u as u64)?;
                    } else {
                        let mut other = vec![0f32; grads[id].len()];
                        c.recv(last, &mut other, TIED | u as u64)?;
                        grads[id].iter_mut().zip(&other).for_each(|(a, b)| *a += b);
                        c.send(last, grads[id], TIED_SUM | u as u64)?;
                    }
                }
                Ok(())
            })?;
            if self.clip <= 0.0 {
                return Ok(0.0);
            }
            let partial = [self.mesh.grad_sq_partial(dev)];
            let me = c.rank();
            for r in (0..self.world).filter(|&r| r != me) {
                c.send(r, &partial, NORM | u as u64)?;
            }
            Ok(partial[0])
        })();
        dev.zero.swap_update_grads(&mut g);
        Ok((g, reduced?))
    }

    /// Update `u`: the last stage's tied half replaced by the sum, the global norm from every
    /// device's share, clipping, the optimizer step. Returns the norm (NaN without clipping).
    fn apply<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        dev: &mut Device,
        u: usize,
        mut g: GroupedUpdateGrads,
        partial: f64,
    ) -> Result<f64> {
        let run = &self.run;
        let (s, p) = (run.stage, run.stages);
        let mut c = tpg.comm();
        let c = &mut **c;
        let specs = dev.zero.specs();
        dev.zero.swap_update_grads(&mut g);
        let result = (|| -> Result<f64> {
            if self.tied && p > 1 && s == p - 1 {
                let id = specs
                    .iter()
                    .position(|sp| sp.name == self.cfg.embedding_name())
                    .expect("the tied embedding is on the last stage");
                let first = (run.device_of)(0);
                dev.zero
                    .with_grad_view(|grads| c.recv(first, grads[id], TIED_SUM | u as u64))?;
            }
            let mut norm = f64::NAN;
            if self.clip > 0.0 {
                let mut sq = partial;
                let me = c.rank();
                for r in (0..self.world).filter(|&r| r != me) {
                    let mut x = [0f64];
                    c.recv(r, &mut x, NORM | u as u64)?;
                    sq += x[0];
                }
                norm = sq.sqrt();
                if norm > self.clip {
                    let scale = (self.clip / (norm + 1e-6)) as f32;
                    dev.zero.with_grad_view(|grads| {
                        grads
                            .iter_mut()
                            .for_each(|t| t.iter_mut().for_each(|x| *x *= scale))
                    });
                }
            }
            dev.zero.update_version(c, (self.lr_of)(u))?;
            Ok(norm)
        })();
        dev.zero.swap_update_grads(&mut g);
        result
    }
}

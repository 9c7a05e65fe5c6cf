//! Data parallelism with ZeRO stages 0–3 over the dp group of one device.
//!
//! Every tensor of the device's (tensor- and pipeline-parallel) shard is cut, for ZeRO, into dp equal
//! pieces (padded with zeros to a multiple of dp); dp rank d owns piece d.
//! - **ZeRO-0**: parameters, gradients and Adam moments whole on every replica; gradients all-reduced
//!   in buckets (a unit's tensors, as soon as their last contribution of the step is in, overlapping
//!   the rest of the backward pass).
//! - **ZeRO-1**: Adam moments (and the f32 master, which in f32 training is the parameter itself) only
//!   for the owned piece; gradients reduce-scattered in buckets, the owned piece updated, parameters
//!   all-gathered after the step.
//! - **ZeRO-2**: gradients sharded too: each unit's gradient exists whole only while its backward runs,
//!   then is reduce-scattered into the owned piece (every micro-batch: accumulation across micro-batches
//!   happens in the pieces, so pipelining stays correct).
//! - **ZeRO-3**: parameters sharded too: a unit's parameters are all-gathered just before the executor
//!   uses them (forward, and again in backward) and freed after.

use super::half::HalfParts;
use super::tensor::TpGroup;
use crate::comm::{Comm, CommError, Group, Pending, ReduceOp};
use crate::memory::{self, Term};
use crate::optim::AdamW;
use crate::transformer::{ParamStore, Residency, Unit};
use ferrotron_core::model::ModelConfig;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;

/// The unit(s) parameter `name` belongs to: its block, the embedding, the head (the tied embedding is
/// in both the embedding and the head).
pub fn units_of(cfg: &ModelConfig, name: &str) -> Vec<Unit> {
    let (fw, fb) = cfg.final_norm_names();
    let mut units = Vec::new();
    if name == cfg.embedding_name() || Some(name) == cfg.position_embedding_name() {
        units.push(Unit::Embedding);
    }
    if name == fw || Some(name) == fb || name == cfg.lm_head_name() {
        units.push(Unit::Head);
    }
    if units.is_empty() {
        let rest = name
            .strip_prefix("model.layers.")
            .or_else(|| name.strip_prefix("transformer.h."));
        if let Some(i) = rest.and_then(|r| r.split('.').next()?.parse().ok()) {
            units.push(Unit::Layer(i));
        }
    }
    units
}

/// This rank's piece of a tensor of `len` elements padded to a multiple of `dp`.
pub(crate) fn piece(len: usize, dp: usize, rank: usize) -> Range<usize> {
    let n = len.div_ceil(dp);
    rank * n..(rank + 1) * n
}

/// The part of a tensor of `len` elements a rank owns (its piece without the padding).
pub(crate) fn owned(len: usize, dp: usize, rank: usize) -> Range<usize> {
    let r = piece(len, dp, rank);
    let end = r.end.min(len);
    r.start.min(end)..end
}

/// Rank `rank`'s piece of each tensor, padded, concatenated.
fn own_pieces(tensors: &[&[f32]], dp: usize, rank: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for t in tensors {
        let r = piece(t.len(), dp, rank);
        let end = r.end.min(t.len());
        let start = r.start.min(end);
        out.extend_from_slice(&t[start..end]);
        out.resize(out.len() + r.len() - (end - start), 0.0);
    }
    out
}

/// What a rank owns of one tensor of its shard: the range of the flattened tensor, and there the f32
/// master values and the Adam moments.
pub struct OwnedState {
    pub flat: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

/// One device's parameters, gradients and optimizer state under ZeRO stage `stage` over `dp` replicas.
pub struct ZeroState {
    pub stage: u8,
    dp: usize,
    dp_rank: usize,
    dp_group: Group,
    /// Every tensor whole (ZeRO 0–2); under ZeRO-3 empty except while its unit is gathered.
    params: RefCell<ParamStore>,
    /// Whole gradients (ZeRO 0–1, accumulated over the step); under ZeRO-2/3 empty except while a
    /// unit's backward runs.
    grads: RefCell<ParamStore>,
    /// ZeRO-3: this rank's pieces of the parameters, the only lasting copy.
    param_pieces: Vec<Vec<f32>>,
    /// ZeRO-2/3: this rank's pieces of the step's reduced gradients (ZeRO-1 files its reduced
    /// pieces in place, in the whole gradients).
    grad_pieces: RefCell<Vec<Vec<f32>>>,
    /// Tensor indices of each unit this device holds.
    units: HashMap<Unit, Vec<usize>>,
    /// Per tensor: unit visits with gradients still to come this step, and whether it was reduced.
    visits_left: RefCell<Vec<usize>>,
    visits_per_step: Vec<usize>,
    reduced: RefCell<Vec<bool>>,
    /// The bucket being reduced in the background (ZeRO 0–1) and its tensors.
    in_flight: RefCell<Option<(Vec<usize>, Pending<f32>)>>,
    opt: AdamW,
    /// Mixed precision: 16-bit weights and gradients, f32 master weights (then `params` is only the
    /// executor's per-unit f32 view and `grads` its per-unit f32 scratch).
    half: Option<HalfStore>,
}

/// The 16-bit state, in its format.
enum HalfStore {
    Bf16(RefCell<HalfParts<half::bf16>>),
    F16(RefCell<HalfParts<half::f16>>),
}

/// Runs `$body` with `$p` bound to the `RefCell` of the 16-bit state, whatever its format.
macro_rules! with_half {
    ($store:expr, $p:ident => $body:expr) => {
        match $store {
            HalfStore::Bf16($p) => $body,
            HalfStore::F16($p) => $body,
        }
    };
}

impl ZeroState {
    /// Takes over the device's shard `params`; `micro_batches` backward passes accumulate per step;
    /// `storage` is the 16-bit format under mixed precision.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ModelConfig,
        params: ParamStore,
        stage: u8,
        dp_group: Group,
        dp_rank: usize,
        micro_batches: usize,
        adam: crate::optim::AdamWConfig,
        storage: Option<crate::transformer::Half>,
    ) -> Self {
        let dp = dp_group.size();
        let mut units: HashMap<Unit, Vec<usize>> = HashMap::new();
        let mut visits_per_step = vec![0; params.specs.len()];
        for (i, spec) in params.specs.iter().enumerate() {
            for u in units_of(cfg, &spec.name) {
                units.entry(u).or_default().push(i);
                visits_per_step[i] += micro_batches;
            }
        }
        let pieces = |store: &ParamStore| -> Vec<Vec<f32>> {
            store
                .tensors
                .iter()
                .map(|t| {
                    let r = piece(t.len(), dp, dp_rank);
                    let mut p = vec![0f32; r.len()];
                    let end = r.end.min(t.len());
                    if r.start < end {
                        p[..end - r.start].copy_from_slice(&t[r.start..end]);
                    }
                    p
                })
                .collect()
        };
        let sharded = stage >= 1 && dp > 1;
        let opt = {
            let _states = memory::scope(Term::OptimizerStates);
            // Moments for what this rank updates: every element, or its pieces.
            let shapes = ParamStore::from_tensors(
                params.specs.clone(),
                params
                    .tensors
                    .iter()
                    .map(|t| {
                        let n = if sharded {
                            piece(t.len(), dp, dp_rank).len()
                        } else {
                            t.len()
                        };
                        vec![0f32; n]
                    })
                    .collect(),
            );
            let mut opt = AdamW::new(adam, &shapes);
            drop(shapes);
            opt.shrink();
            opt
        };
        let mut param_pieces = Vec::new();
        let mut params = params;
        let n = params.specs.len();
        let (grads, grad_pieces, half) = match storage {
            Some(h) => {
                let half =
                    match h {
                        crate::transformer::Half::Bf16 => HalfStore::Bf16(RefCell::new(
                            HalfParts::new(&mut params, stage, dp, dp_rank),
                        )),
                        crate::transformer::Half::F16 => HalfStore::F16(RefCell::new(
                            HalfParts::new(&mut params, stage, dp, dp_rank),
                        )),
                    };
                // The executor's f32 gradients exist per unit only (scratch).
                let scratch = ParamStore::from_tensors(params.specs.clone(), vec![Vec::new(); n]);
                (scratch, Vec::new(), Some(half))
            }
            None => {
                if stage == 3 && dp > 1 {
                    let _weights = memory::scope(Term::Weights);
                    param_pieces = pieces(&params);
                    params.tensors.iter_mut().for_each(|t| *t = Vec::new());
                }
                let _grads_term = memory::scope(Term::Gradients);
                let grads = if stage >= 2 && dp > 1 {
                    ParamStore::from_tensors(params.specs.clone(), vec![Vec::new(); n])
                } else {
                    let mut g = ParamStore::zeros(params.specs.clone());
                    // Fault the buffers in now, not in the first backward.
                    g.tensors.iter_mut().for_each(|t| t.fill(0.0));
                    g
                };
                let grad_pieces = if stage >= 2 && dp > 1 {
                    params
                        .specs
                        .iter()
                        .map(|s| vec![0f32; piece(s.numel(), dp, dp_rank).len()])
                        .collect()
                } else {
                    Vec::new()
                };
                (grads, grad_pieces, None)
            }
        };
        Self {
            stage,
            dp,
            dp_rank,
            dp_group,
            params: RefCell::new(params),
            grads: RefCell::new(grads),
            param_pieces,
            grad_pieces: RefCell::new(grad_pieces),
            units,
            visits_left: RefCell::new(visits_per_step.clone()),
            visits_per_step,
            reduced: RefCell::new(vec![false; n]),
            in_flight: RefCell::new(None),
            opt,
            half,
        }
    }

    fn sharded(&self) -> bool {
        self.stage >= 1 && self.dp > 1
    }

    /// The parameter specs of the device's shard.
    pub fn specs(&self) -> Vec<ferrotron_core::model::ParamSpec> {
        self.params.borrow().specs.clone()
    }

    /// Starts a step: gradients zeroed, every tensor waiting for its contributions.
    pub fn begin_step(&self) {
        if let Some(h) = &self.half {
            with_half!(h, p => p.borrow_mut().begin_step());
            return;
        }
        if self.stage < 2 || self.dp == 1 {
            self.grads
                .borrow_mut()
                .tensors
                .iter_mut()
                .for_each(|t| t.fill(0.0));
        }
        self.grad_pieces
            .borrow_mut()
            .iter_mut()
            .for_each(|p| p.fill(0.0));
        self.visits_left
            .borrow_mut()
            .clone_from(&self.visits_per_step);
        self.reduced.borrow_mut().fill(false);
    }

    /// A residency for the executor over this state, with the device's communicator.
    pub fn residency<'s, 'c, C: Comm>(
        &'s self,
        tpg: &'s TpGroup<'c, C>,
    ) -> ZeroResidency<'s, 'c, C> {
        ZeroResidency { state: self, tpg }
    }

    /// Lays out `ids`' tensors as dp blocks, block k holding piece k of each tensor in turn (so that a
    /// reduce-scatter hands each rank its pieces, and an all-gather of pieces rebuilds the tensors).
    fn interleave(&self, tensors: &[&[f32]]) -> Vec<f32> {
        let mut out = Vec::new();
        for k in 0..self.dp {
            for t in tensors {
                let r = piece(t.len(), self.dp, k);
                let end = r.end.min(t.len());
                let start = r.start.min(end);
                out.extend_from_slice(&t[start..end]);
                out.resize(out.len() + r.len() - (end - start), 0.0);
            }
        }
        out
    }

    /// Splits this rank's block of an interleaved buffer back into per-tensor pieces.
    fn split_pieces(&self, ids: &[usize], lens: &[usize], block: &[f32]) -> Vec<(usize, Vec<f32>)> {
        let mut at = 0;
        ids.iter()
            .zip(lens)
            .map(|(&id, &len)| {
                let n = piece(len, self.dp, 0).len();
                let p = block[at..at + n].to_vec();
                at += n;
                (id, p)
            })
            .collect()
    }

    /// Gathers whole tensors `ids` from every rank's pieces (ZeRO-3), or widens them from 16-bit
    /// storage (mixed precision), into the executor's view.
    fn gather<C: Comm>(&self, c: &mut C, ids: &[usize]) -> Result<(), CommError> {
        if let Some(h) = &self.half {
            let mut view = self.params.borrow_mut();
            return with_half!(h, p => p.borrow().materialize(c, &self.dp_group, ids, &mut view));
        }
        let lens: Vec<usize> = {
            let p = self.params.borrow();
            ids.iter().map(|&i| p.specs[i].numel()).collect()
        };
        // A gathered unit's parameters are transient buffers (the lasting copy is the pieces).
        let _buffers = memory::scope(Term::CommBuffers);
        let mine: Vec<f32> = ids
            .iter()
            .flat_map(|&i| self.param_pieces[i].iter().copied())
            .collect();
        let mut all = vec![0f32; mine.len() * self.dp];
        c.all_gather(&self.dp_group, &mine, &mut all)?;
        let block = mine.len();
        let mut params = self.params.borrow_mut();
        let mut at = 0;
        for (&id, &len) in ids.iter().zip(&lens) {
            let n = piece(len, self.dp, 0).len();
            let mut t = Vec::with_capacity(n * self.dp);
            for k in 0..self.dp {
                t.extend_from_slice(&all[k * block + at..k * block + at + n]);
            }
            t.truncate(len);
            params.tensors[id] = t;
            at += n;
        }
        Ok(())
    }

    fn release(&self, ids: &[usize]) {
        let mut params = self.params.borrow_mut();
        for &i in ids {
            params.tensors[i] = Vec::new();
        }
    }

    /// Reduce-scatters whole gradients `ids` into this rank's pieces and frees them (ZeRO-2/3).
    fn scatter_grads<C: Comm>(&self, c: &mut C, ids: &[usize]) -> Result<(), CommError> {
        let _buffers = memory::scope(Term::CommBuffers);
        let (buf, lens) = {
            let g = self.grads.borrow();
            let ts: Vec<&[f32]> = ids.iter().map(|&i| g.tensors[i].as_slice()).collect();
            (
                self.interleave(&ts),
                ts.iter().map(|t| t.len()).collect::<Vec<_>>(),
            )
        };
        let mut mine = vec![0f32; buf.len() / self.dp];
        c.reduce_scatter(&self.dp_group, &buf, &mut mine, ReduceOp::Sum)?;
        drop(buf);
        let mut pieces = self.grad_pieces.borrow_mut();
        for (id, p) in self.split_pieces(ids, &lens, &mine) {
            pieces[id].iter_mut().zip(&p).for_each(|(a, b)| *a += b);
        }
        let mut g = self.grads.borrow_mut();
        for &i in ids {
            g.tensors[i] = Vec::new();
        }
        Ok(())
    }

    /// Mixed precision: zeroed f32 gradients for `ids`, for the executor to accumulate into.
    fn open_scratch(&self, ids: &[usize]) {
        let _grads = memory::scope(Term::Gradients);
        let mut g = self.grads.borrow_mut();
        for &i in ids {
            g.tensors[i] = vec![0f32; g.specs[i].numel()];
        }
    }

    /// Mixed precision: rounds the f32 gradients of `ids` into the 16-bit storage (and frees them).
    fn absorb<C: Comm>(&self, c: &mut C, ids: &[usize]) -> Result<(), CommError> {
        let h = self.half.as_ref().expect("mixed precision");
        let mut scratch = self.grads.borrow_mut();
        with_half!(h, p => p.borrow_mut().absorb(c, &self.dp_group, ids, &mut scratch))
    }

    /// Allocates zeroed whole gradients for `ids` (ZeRO-2/3): a bucket that lives until it is
    /// reduce-scattered, so it counts as a communication buffer.
    fn open_grads(&self, ids: &[usize]) {
        let _bucket = memory::scope(Term::CommBuffers);
        let mut g = self.grads.borrow_mut();
        for &i in ids {
            g.tensors[i] = vec![0f32; g.specs[i].numel()];
        }
    }

    /// Waits for the bucket in flight, if any, and files its result.
    fn finish_in_flight<C: Comm>(&self, c: &mut C) -> Result<(), CommError> {
        let Some((ids, pending)) = self.in_flight.borrow_mut().take() else {
            return Ok(());
        };
        let out = c.wait(pending)?;
        self.file_reduced(&ids, &out);
        Ok(())
    }

    /// Files the result of a bucket's reduction: whole sums (ZeRO-0), or this rank's pieces into
    /// their place in the whole gradients (ZeRO-1; the rest of them is stale from then on).
    fn file_reduced(&self, ids: &[usize], out: &[f32]) {
        if self.sharded() {
            let mut g = self.grads.borrow_mut();
            let mut at = 0;
            for &i in ids {
                let t = &mut g.tensors[i];
                let (own, n) = (self.own_range(t.len()), piece(t.len(), self.dp, 0).len());
                let len = own.len();
                t[own].copy_from_slice(&out[at..at + len]);
                at += n;
            }
        } else {
            let mut g = self.grads.borrow_mut();
            let mut at = 0;
            for &i in ids {
                let n = g.tensors[i].len();
                g.tensors[i].copy_from_slice(&out[at..at + n]);
                at += n;
            }
        }
    }

    /// Starts the reduction of the tensors whose gradients are final (ZeRO 0–1), after the previous
    /// bucket (one collective in flight per group).
    fn start_bucket<C: Comm>(&self, c: &mut C, ids: Vec<usize>) -> Result<(), CommError> {
        self.finish_in_flight(c)?;
        let _buffers = memory::scope(Term::CommBuffers);
        let buf: Vec<f32> = {
            let g = self.grads.borrow();
            let ts: Vec<&[f32]> = ids.iter().map(|&i| g.tensors[i].as_slice()).collect();
            if self.sharded() {
                self.interleave(&ts)
            } else {
                ts.concat()
            }
        };
        let pending = if self.sharded() {
            c.start_reduce_scatter(&self.dp_group, buf, ReduceOp::Sum)?
        } else {
            c.start_all_reduce(&self.dp_group, buf, ReduceOp::Sum)?
        };
        {
            let mut reduced = self.reduced.borrow_mut();
            ids.iter().for_each(|&i| reduced[i] = true);
        }
        *self.in_flight.borrow_mut() = Some((ids, pending));
        Ok(())
    }

    /// Counts one gradient visit of `unit`'s tensors and, under ZeRO 0–1, starts reducing those that
    /// are now final.
    fn visited<C: Comm>(&self, c: &mut C, unit: Unit) -> Result<(), CommError> {
        if self.dp == 1 || self.stage >= 2 {
            return Ok(());
        }
        let ready: Vec<usize> = {
            let mut left = self.visits_left.borrow_mut();
            self.units
                .get(&unit)
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .copied()
                .filter(|&i| {
                    left[i] = left[i].saturating_sub(1);
                    left[i] == 0
                })
                .collect()
        };
        if ready.is_empty() {
            return Ok(());
        }
        self.start_bucket(c, ready)
    }

    /// Accumulates deferred weight gradients (a zero-bubble W action): `apply` writes into a gradient
    /// store in which every tensor it touches is present.
    pub fn apply_deferred<C: Comm>(
        &self,
        c: &mut C,
        touched: &[usize],
        apply: impl FnOnce(&mut ParamStore),
    ) -> Result<(), CommError> {
        if self.half.is_some() {
            self.open_scratch(touched);
            apply(&mut self.grads.borrow_mut());
            return self.absorb(c, touched);
        }
        let sharded_grads = self.stage >= 2 && self.dp > 1;
        if sharded_grads {
            self.open_grads(touched);
        }
        apply(&mut self.grads.borrow_mut());
        if sharded_grads {
            self.scatter_grads(c, touched)?;
        }
        Ok(())
    }

    /// Ends the step's gradient reduction over dp: every gradient not yet reduced is, and the bucket in
    /// flight completes. Afterwards [`ZeroState::grad_view`] holds the reduced gradients this rank owns.
    pub fn reduce_grads<C: Comm>(&self, c: &mut C) -> Result<(), CommError> {
        if let Some(h) = &self.half {
            return with_half!(h, p => p.borrow_mut().reduce(c, &self.dp_group));
        }
        if self.dp == 1 || self.stage >= 2 {
            return Ok(());
        }
        let rest: Vec<usize> = self
            .reduced
            .borrow()
            .iter()
            .enumerate()
            .filter(|(_, &r)| !r)
            .map(|(i, _)| i)
            .collect();
        if !rest.is_empty() {
            self.start_bucket(c, rest)?;
        }
        self.finish_in_flight(c)
    }

    /// The part of a tensor of `len` elements this rank owns (its piece without the padding).
    fn own_range(&self, len: usize) -> Range<usize> {
        owned(len, self.dp, self.dp_rank)
    }

    /// The gradients this rank holds after the reduction, by tensor: whole (no sharding) or the
    /// part it owns (the same part of each tensor on every device that shares the layout).
    pub fn with_grad_view<R>(&self, f: impl FnOnce(&mut [&mut [f32]]) -> R) -> R {
        if let Some(h) = &self.half {
            return with_half!(h, p => {
                let mut parts = p.borrow_mut();
                let mut view: Vec<&mut [f32]> =
                    parts.main.iter_mut().map(|g| g.as_mut_slice()).collect();
                f(&mut view)
            });
        }
        if self.stage >= 2 && self.dp > 1 {
            let mut pieces = self.grad_pieces.borrow_mut();
            let mut view: Vec<&mut [f32]> = pieces.iter_mut().map(|p| p.as_mut_slice()).collect();
            f(&mut view)
        } else if self.sharded() {
            let mut g = self.grads.borrow_mut();
            let mut view: Vec<&mut [f32]> = g
                .tensors
                .iter_mut()
                .map(|t| {
                    let own = self.own_range(t.len());
                    &mut t[own]
                })
                .collect();
            f(&mut view)
        } else {
            let mut g = self.grads.borrow_mut();
            let mut view: Vec<&mut [f32]> =
                g.tensors.iter_mut().map(|t| t.as_mut_slice()).collect();
            f(&mut view)
        }
    }

    /// Whether the gradient view holds pieces (a share of each tensor) rather than whole tensors.
    pub fn grads_sharded(&self) -> bool {
        self.sharded()
    }

    /// One AdamW update of what this rank owns, then (ZeRO 1–2) the updated pieces all-gathered.
    pub fn update<C: Comm>(&mut self, c: &mut C, lr: f32) -> Result<(), CommError> {
        if let Some(h) = &self.half {
            let opt = &mut self.opt;
            return with_half!(h, p => {
                let mut parts = p.borrow_mut();
                let parts = &mut *parts;
                let g: Vec<&[f32]> = parts.main.iter().map(Vec::as_slice).collect();
                let mut m: Vec<&mut [f32]> =
                    parts.master.iter_mut().map(|t| t.as_mut_slice()).collect();
                opt.step_slices(&mut m, &g, lr);
                drop(g);
                parts.refresh_weights(c, &self.dp_group)
            });
        }
        if !self.sharded() {
            let params = self.params.get_mut();
            let grads = self.grads.get_mut();
            self.opt.step_serial(params, grads, lr);
            return Ok(());
        }
        // The owned gradients: pieces (ZeRO-2/3) or the owned part of the whole ones (ZeRO-1).
        let (dp, rank) = (self.dp, self.dp_rank);
        let own = |len: usize| owned(len, dp, rank);
        let pieces = std::mem::take(self.grad_pieces.get_mut());
        let whole = std::mem::replace(self.grads.get_mut(), ParamStore::zeros(Vec::new()));
        let g: Vec<&[f32]> = if self.stage >= 2 {
            pieces.iter().map(Vec::as_slice).collect()
        } else {
            whole.tensors.iter().map(|t| &t[own(t.len())]).collect()
        };
        if self.stage == 3 {
            let mut p: Vec<&mut [f32]> = self
                .param_pieces
                .iter_mut()
                .map(|t| t.as_mut_slice())
                .collect();
            self.opt.step_slices(&mut p, &g, lr);
        } else {
            // In f32 the parameters are their own master copy: update this rank's part in place,
            // then gather every part.
            let params = self.params.get_mut();
            let mut p: Vec<&mut [f32]> = params
                .tensors
                .iter_mut()
                .map(|t| {
                    let r = own(t.len());
                    &mut t[r]
                })
                .collect();
            self.opt.step_slices(&mut p, &g, lr);
            let (mine, mut all) = {
                let _buffers = memory::scope(Term::CommBuffers);
                let ts: Vec<&[f32]> = params.tensors.iter().map(Vec::as_slice).collect();
                let mine: Vec<f32> = own_pieces(&ts, dp, rank);
                let all = vec![0f32; mine.len() * dp];
                (mine, all)
            };
            c.all_gather(&self.dp_group, &mine, &mut all)?;
            let block = mine.len();
            let mut at = 0;
            for t in params.tensors.iter_mut() {
                let (len, n) = (t.len(), piece(t.len(), dp, 0).len());
                for k in 0..dp {
                    let r = piece(len, dp, k);
                    let end = r.end.min(len);
                    let start = r.start.min(end);
                    t[start..end]
                        .copy_from_slice(&all[k * block + at..k * block + at + (end - start)]);
                }
                at += n;
            }
        }
        drop(g);
        *self.grad_pieces.get_mut() = pieces;
        *self.grads.get_mut() = whole;
        Ok(())
    }

    /// Mixed precision: the whole f32 master weights (or, `master` false, the step's main gradients),
    /// gathered over the replicas when sharded.
    fn half_whole<C: Comm>(&self, c: &mut C, master: bool) -> Result<ParamStore, CommError> {
        let h = self.half.as_ref().expect("mixed precision");
        let specs = self.params.borrow().specs.clone();
        let whole = with_half!(h, p => {
            let parts = p.borrow();
            let which = if master { &parts.master } else { &parts.main };
            parts.whole(c, &self.dp_group, which)
        })?;
        Ok(ParamStore::from_tensors(specs, whole))
    }

    /// The range of each flattened tensor this rank owns: whole, or its ZeRO piece without the
    /// padding (what it updates, and so what it keeps in a checkpoint).
    pub fn owned_ranges(&self) -> Vec<Range<usize>> {
        let p = self.params.borrow();
        p.specs
            .iter()
            .map(|s| {
                if self.sharded() {
                    owned(s.numel(), self.dp, self.dp_rank)
                } else {
                    0..s.numel()
                }
            })
            .collect()
    }

    /// What this rank owns of each tensor, for a checkpoint: the f32 master values and the two Adam
    /// moments over [`ZeroState::owned_ranges`]. Between steps only.
    pub fn owned_state(&self) -> Vec<OwnedState> {
        let ranges = self.owned_ranges();
        let master: Vec<Vec<f32>> = if let Some(h) = &self.half {
            with_half!(h, p => {
                let parts = p.borrow();
                ranges.iter().zip(&parts.master).map(|(r, m)| m[..r.len()].to_vec()).collect()
            })
        } else if self.stage == 3 && self.dp > 1 {
            let pieces = self.param_pieces.iter();
            ranges
                .iter()
                .zip(pieces)
                .map(|(r, m)| m[..r.len()].to_vec())
                .collect()
        } else {
            let p = self.params.borrow();
            ranges
                .iter()
                .zip(&p.tensors)
                .map(|(r, t)| t[r.clone()].to_vec())
                .collect()
        };
        ranges
            .into_iter()
            .zip(master)
            .enumerate()
            .map(|(i, (flat, master))| OwnedState {
                exp_avg: self.opt.m[i][..flat.len()].to_vec(),
                exp_avg_sq: self.opt.v[i][..flat.len()].to_vec(),
                flat,
                master,
            })
            .collect()
    }

    /// Optimizer steps taken (Adam's bias-correction count).
    pub fn optimizer_step(&self) -> u64 {
        self.opt.step
    }

    /// Resumes the optimizer: its step count and each tensor's moments over the owned range (the
    /// parameters come with the store the state was built from).
    pub fn restore_optimizer(&mut self, step: u64, moments: Vec<(Vec<f32>, Vec<f32>)>) {
        self.opt.step = step;
        for (i, (m, v)) in moments.into_iter().enumerate() {
            self.opt.m[i][..m.len()].copy_from_slice(&m);
            self.opt.v[i][..v.len()].copy_from_slice(&v);
        }
    }

    /// The device's whole parameters (ZeRO-3: gathered from the pieces; every dp rank must call it).
    pub fn full_params<C: Comm>(&self, c: &mut C) -> Result<ParamStore, CommError> {
        let _other = memory::scope(Term::Other);
        if self.half.is_some() {
            return self.half_whole(c, true);
        }
        if self.stage == 3 && self.dp > 1 {
            let ids: Vec<usize> = (0..self.param_pieces.len()).collect();
            self.gather(c, &ids)?;
            let out = self.params.borrow().clone();
            self.release(&ids);
            return Ok(out);
        }
        Ok(self.params.borrow().clone())
    }

    /// The device's whole reduced gradients (gathered from the pieces when sharded; every dp rank must
    /// call it).
    pub fn full_grads<C: Comm>(&self, c: &mut C) -> Result<ParamStore, CommError> {
        let _other = memory::scope(Term::Other);
        if self.half.is_some() {
            return self.half_whole(c, false);
        }
        let specs = self.params.borrow().specs.clone();
        if !self.sharded() {
            return Ok(self.grads.borrow().clone());
        }
        let mine: Vec<f32> = if self.stage >= 2 {
            self.grad_pieces.borrow().concat()
        } else {
            let g = self.grads.borrow();
            let ts: Vec<&[f32]> = g.tensors.iter().map(Vec::as_slice).collect();
            own_pieces(&ts, self.dp, self.dp_rank)
        };
        let mut all = vec![0f32; mine.len() * self.dp];
        c.all_gather(&self.dp_group, &mine, &mut all)?;
        let block = mine.len();
        let mut out = ParamStore::zeros(specs);
        let mut at = 0;
        for t in out.tensors.iter_mut() {
            let (len, n) = (t.len(), piece(t.len(), self.dp, 0).len());
            t.clear();
            for k in 0..self.dp {
                t.extend_from_slice(&all[k * block + at..k * block + at + n]);
            }
            t.truncate(len);
            at += n;
        }
        Ok(out)
    }
}

/// The executor's view of a [`ZeroState`]: units gathered just in time (ZeRO-3), gradients reduced
/// away per unit (ZeRO-2/3) or in background buckets (ZeRO 0–1).
pub struct ZeroResidency<'s, 'c, C: Comm> {
    state: &'s ZeroState,
    tpg: &'s TpGroup<'c, C>,
}

impl<C: Comm> ZeroResidency<'_, '_, C> {
    fn ids(&self, unit: Unit) -> &[usize] {
        self.state.units.get(&unit).map_or(&[], Vec::as_slice)
    }
    fn gathered(&self) -> bool {
        self.state.stage == 3 && self.state.dp > 1 || self.state.half.is_some()
    }
}

impl<C: Comm> Residency for ZeroResidency<'_, '_, C> {
    fn params(&self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        let ids = self.ids(unit);
        if self.gathered() {
            self.tpg.with_comm(|c| self.state.gather(c, ids));
        }
        f(&self.state.params.borrow());
        if self.gathered() {
            self.state.release(ids);
        }
    }

    fn params_and_grads(&self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        let ids = self.ids(unit);
        let s = self.state;
        if self.gathered() {
            self.tpg.with_comm(|c| s.gather(c, ids));
        }
        if s.half.is_some() {
            s.open_scratch(ids);
            f(&s.params.borrow(), &mut s.grads.borrow_mut());
            s.release(ids);
            self.tpg.with_comm(|c| s.absorb(c, ids));
            return;
        }
        let sharded_grads = s.stage >= 2 && s.dp > 1;
        if sharded_grads {
            s.open_grads(ids);
        }
        f(&s.params.borrow(), &mut s.grads.borrow_mut());
        if self.gathered() {
            s.release(ids);
        }
        if sharded_grads {
            self.tpg.with_comm(|c| s.scatter_grads(c, ids));
        } else {
            self.tpg.with_comm(|c| s.visited(c, unit));
        }
    }
}

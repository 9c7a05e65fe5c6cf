//! A device's state when its tensors are shared with different replicas: under expert parallelism
//! the dense tensors with every replica of the shard (dp·cp), a mixture of experts' routed experts
//! only with the replicas holding the same experts (dp·cp / ep). Each set is a [`ZeroState`] over
//! its own group (so ZeRO 1–3 partitions both); the executor sees one store in the shard's order,
//! assembled per unit by moving the tensors in and out (no copies).
//!
//! A device runs one collective at a time: with two sets, each set's collectives complete before
//! the other's start (its prefetches and background buckets are settled), trading their overlap
//! with compute for correctness on every backend.

use super::{OwnedState, ZeroState};
use crate::comm::{Comm, CommError};
use crate::parallel::tensor::TpGroup;
use crate::pieces::owned;
use crate::transformer::{FrozenBase, ParamStore, Residency, Unit};
use ferrotron_core::model::ParamSpec;
use std::ops::Range;

/// One set of tensors: its state, and where each of its tensors sits in the shard's order.
pub(super) struct Part {
    pub(super) state: ZeroState,
    pub(super) at: Vec<usize>,
}

/// The device's state: one [`ZeroState`] over its replicas, or (expert parallelism) one per set
/// of tensors shared alike.
pub struct GroupedZero {
    pub(super) parts: Vec<Part>,
    /// The shard's tensors in its order, and the executor's views in that order (tensors moved in
    /// from the parts for a unit's work, then back).
    pub(super) specs: Vec<ParamSpec>,
    pub(super) params: ParamStore,
    grads: ParamStore,
    /// An asynchronous segment runs: the parts' current weight version is lent to `params`
    /// (see `asynchronous.rs`).
    pub(super) versions: bool,
}

impl GroupedZero {
    /// Every tensor in one state (shared with every replica alike).
    pub fn whole(state: ZeroState) -> Self {
        let n = state.params.specs.len();
        Self::from_parts(vec![(state, (0..n).collect())])
    }

    /// Tensors in several states, `at[i]` the shard's index of each state's `i`-th tensor.
    pub fn from_parts(parts: Vec<(ZeroState, Vec<usize>)>) -> Self {
        let n: usize = parts.iter().map(|(_, at)| at.len()).sum();
        let mut specs: Vec<Option<ParamSpec>> = vec![None; n];
        for (state, at) in &parts {
            for (spec, &j) in state.params.specs.iter().zip(at) {
                specs[j] = Some(spec.clone());
            }
        }
        let specs: Vec<ParamSpec> = specs
            .into_iter()
            .map(|s| s.expect("the parts cover the shard"))
            .collect();
        let mut parts: Vec<Part> = parts
            .into_iter()
            .map(|(state, at)| Part { state, at })
            .collect();
        if parts.len() > 1 {
            // Prefetching would keep one set's gather in flight while the other's runs.
            parts.iter_mut().for_each(|p| p.state.set_prefetch(false));
        }
        Self {
            params: ParamStore::empty(specs.clone()),
            grads: ParamStore::empty(specs.clone()),
            specs,
            parts,
            versions: false,
        }
    }

    pub fn set_prefetch(&mut self, on: bool) {
        let alone = self.parts.len() == 1;
        self.parts
            .iter_mut()
            .for_each(|p| p.state.set_prefetch(on && alone));
    }

    pub fn set_threaded_update(&mut self, threaded: bool) {
        self.parts
            .iter_mut()
            .for_each(|p| p.state.set_threaded_update(threaded));
    }

    /// Bytes of the weights this device holds between steps of the tensors `which` selects.
    pub fn weight_bytes_where(&self, which: &dyn Fn(&ParamSpec) -> bool) -> usize {
        let mut total = 0;
        for p in &self.parts {
            for (i, spec) in p.state.params.specs.iter().enumerate() {
                if which(spec) {
                    total += p.state.weight_bytes(i);
                }
            }
        }
        total
    }

    /// The shard's parameter specs, in its order.
    pub fn specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }

    pub fn begin_step(&mut self) {
        self.parts.iter_mut().for_each(|p| p.state.begin_step());
    }

    /// Ends the step's gradient reductions, set by set.
    pub fn reduce_grads<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        self.parts
            .iter_mut()
            .try_for_each(|p| p.state.reduce_grads(c))
    }

    /// One optimizer update of every set.
    pub fn update<C: Comm>(&mut self, c: &mut C, lr: f32) -> Result<(), CommError> {
        self.parts
            .iter_mut()
            .try_for_each(|p| p.state.update(c, lr))
    }

    pub fn optimizer_step(&self) -> u64 {
        self.parts[0].state.optimizer_step()
    }

    /// Runs `f` over the reduced gradients this device holds, in the shard's order (see
    /// [`ZeroState::with_grad_view`]).
    pub fn with_grad_view<R>(&mut self, f: impl FnOnce(&mut [&mut [f32]]) -> R) -> R {
        self.with_counted_grad_view(|g, _| f(g))
    }

    /// [`GroupedZero::with_grad_view`], with the part of each tensor's view this device counts in a
    /// global sum over devices: its own piece whole when the replicas shard the state, else the
    /// `dp_rank`-th of `dp` equal parts of the whole tensor every replica holds, so that the
    /// replicas share a sum's work evenly (one of them counting every replicated tensor would keep
    /// the others waiting for it).
    pub fn with_counted_grad_view<R>(
        &mut self,
        f: impl FnOnce(&mut [&mut [f32]], &[Range<usize>]) -> R,
    ) -> R {
        let n = self.specs.len();
        // Per tensor: `None` counted whole, or the (dp, dp_rank) of the replicas splitting it.
        let mut split: Vec<Option<(usize, usize)>> = vec![None; n];
        for p in &self.parts {
            let s = &p.state;
            let share = (!s.sharded()).then_some((s.dp, s.dp_rank));
            p.at.iter().for_each(|&j| split[j] = share);
        }
        let counted = |view: &[&mut [f32]]| -> Vec<Range<usize>> {
            view.iter()
                .zip(&split)
                .map(|(g, share)| match *share {
                    None => 0..g.len(),
                    Some((dp, rank)) => owned(g.len(), dp, rank),
                })
                .collect()
        };
        match self.parts.as_mut_slice() {
            // Built by `whole`: the shard's order is the state's.
            [one] => one.state.with_grad_view(|g| {
                let c = counted(g);
                f(g, &c)
            }),
            [a, b] => a.state.with_grad_view(|ga| {
                b.state.with_grad_view(|gb| {
                    let mut view: Vec<&mut [f32]> = Vec::with_capacity(n);
                    view.resize_with(n, Default::default);
                    for (&j, g) in a.at.iter().zip(ga.iter_mut()) {
                        view[j] = &mut **g;
                    }
                    for (&j, g) in b.at.iter().zip(gb.iter_mut()) {
                        view[j] = &mut **g;
                    }
                    let c = counted(&view);
                    f(&mut view, &c)
                })
            }),
            _ => unreachable!("a shard's tensors are shared in one or two ways"),
        }
    }

    /// The shard's whole parameters (every replica of each set must call it).
    pub fn full_params<C: Comm>(&mut self, c: &mut C) -> Result<ParamStore, CommError> {
        let mut out = Vec::new();
        for p in &mut self.parts {
            out.push(p.state.full_params(c)?);
        }
        Ok(self.merge(out))
    }

    /// The shard's whole reduced gradients (every replica of each set must call it).
    pub fn full_grads<C: Comm>(&self, c: &mut C) -> Result<ParamStore, CommError> {
        let mut out = Vec::new();
        for p in &self.parts {
            out.push(p.state.full_grads(c)?);
        }
        Ok(self.merge(out))
    }

    /// One store per part, in the shard's order.
    fn merge(&self, stores: Vec<ParamStore>) -> ParamStore {
        let mut tensors = vec![Vec::new(); self.specs.len()];
        for (p, store) in self.parts.iter().zip(stores) {
            for (&j, t) in p.at.iter().zip(store.tensors) {
                tensors[j] = t;
            }
        }
        ParamStore::from_tensors(self.specs.clone(), tensors)
    }

    /// The range of each tensor this device owns (see [`ZeroState::owned_ranges`]), in the shard's
    /// order.
    pub fn owned_ranges(&self) -> Vec<Range<usize>> {
        let mut out = vec![0..0; self.specs.len()];
        for p in &self.parts {
            for (&j, r) in p.at.iter().zip(p.state.owned_ranges()) {
                out[j] = r;
            }
        }
        out
    }

    /// What this device owns of each tensor, for a checkpoint, in the shard's order.
    pub fn owned_state(&self) -> Vec<OwnedState> {
        let mut out: Vec<Option<OwnedState>> = (0..self.specs.len()).map(|_| None).collect();
        for p in &self.parts {
            for (&j, s) in p.at.iter().zip(p.state.owned_state()) {
                out[j] = Some(s);
            }
        }
        out.into_iter()
            .map(|s| s.expect("every tensor in a part"))
            .collect()
    }

    /// Resumes the optimizer: each tensor's moments over its owned range, in the shard's order.
    pub fn restore_optimizer(&mut self, step: u64, moments: Vec<(Vec<f32>, Vec<f32>)>) {
        let mut moments: Vec<Option<(Vec<f32>, Vec<f32>)>> =
            moments.into_iter().map(Some).collect();
        for p in &mut self.parts {
            let mine =
                p.at.iter()
                    .map(|&j| moments[j].take().expect("one tensor, one part"))
                    .collect();
            p.state.restore_optimizer(step, mine);
        }
    }

    /// Accumulates deferred weight gradients (a zero-bubble W action; see
    /// [`ZeroState::apply_deferred`]) of `touched` (the shard's indices), each set's reduced
    /// over its own group, one set after the other.
    pub fn apply_deferred<C: Comm>(
        &mut self,
        c: &mut C,
        touched: &[usize],
        apply: impl FnOnce(&mut ParamStore),
    ) -> Result<(), CommError> {
        if self.parts.len() == 1 {
            return self.parts[0].state.apply_deferred(c, touched, apply);
        }
        let mine: Vec<Vec<usize>> = self
            .parts
            .iter()
            .map(|p| {
                (0..p.at.len())
                    .filter(|&i| touched.contains(&p.at[i]))
                    .collect()
            })
            .collect();
        for (p, ids) in self.parts.iter_mut().zip(&mine) {
            p.state.open_deferred(ids);
        }
        self.lend(true);
        apply(&mut self.grads);
        self.lend(true);
        for (p, ids) in self.parts.iter_mut().zip(&mine) {
            p.state.close_deferred(c, ids)?;
        }
        Ok(())
    }

    /// A residency for the executor over this state, with the device's communicator.
    pub fn residency<'s, 'c, C: Comm>(
        &'s mut self,
        tpg: &'s TpGroup<'c, C>,
    ) -> GroupedResidency<'s, 'c, C> {
        GroupedResidency { zero: self, tpg }
    }

    /// Moves every part's tensors (parameters, and gradients when `grads`) into the views, or
    /// (called again) back.
    pub(super) fn lend(&mut self, grads: bool) {
        for p in &mut self.parts {
            for (i, &j) in p.at.iter().enumerate() {
                std::mem::swap(&mut self.params.tensors[j], &mut p.state.params.tensors[i]);
                std::mem::swap(&mut self.params.bf16[j], &mut p.state.params.bf16[i]);
                std::mem::swap(&mut self.params.nf4[j], &mut p.state.params.nf4[i]);
                if grads {
                    std::mem::swap(&mut self.grads.tensors[j], &mut p.state.grads.tensors[i]);
                }
            }
        }
    }
}

/// The executor's view of a [`GroupedZero`]: each part's unit brought in (one part's collectives
/// completed before the other's), its tensors lent to one store for the executor's work.
pub struct GroupedResidency<'s, 'c, C: Comm> {
    zero: &'s mut GroupedZero,
    tpg: &'s TpGroup<'c, C>,
}

impl<C: Comm> GroupedResidency<'_, '_, C> {
    /// Runs `step` on each part, settling each part's collectives before the next part's when
    /// there are several.
    fn each(&mut self, step: &mut dyn FnMut(&mut C, &mut ZeroState) -> Result<(), CommError>) {
        let several = self.zero.parts.len() > 1;
        for p in &mut self.zero.parts {
            self.tpg.with_comm(|c| {
                step(c, &mut p.state)?;
                if several {
                    p.state.settle(c)?;
                }
                Ok(())
            });
        }
    }
}

impl<C: Comm> Residency for GroupedResidency<'_, '_, C> {
    fn begin_pass(&mut self, units: &[Unit]) {
        if self.zero.parts.len() == 1 {
            self.zero.parts[0]
                .state
                .residency(self.tpg)
                .begin_pass(units);
        }
    }

    fn params(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        if self.zero.parts.len() == 1 {
            return self.zero.parts[0].state.residency(self.tpg).params(unit, f);
        }
        self.each(&mut |c, s| s.open_params(c, unit));
        self.zero.lend(false);
        f(&self.zero.params);
        self.zero.lend(false);
        self.zero
            .parts
            .iter_mut()
            .for_each(|p| p.state.close_params(unit));
    }

    fn gather_frozen(&mut self, unit: Unit, base: &FrozenBase) -> ParamStore {
        // LoRA on a mixture of experts is refused where LoRA is validated: one part.
        self.zero.parts[0]
            .state
            .residency(self.tpg)
            .gather_frozen(unit, base)
    }

    fn params_and_grads(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        if self.zero.parts.len() == 1 {
            return self.zero.parts[0]
                .state
                .residency(self.tpg)
                .params_and_grads(unit, f);
        }
        let mut ids: Vec<Vec<usize>> = vec![Vec::new(); self.zero.parts.len()];
        let mut k = 0;
        self.each(&mut |c, s| {
            ids[k] = s.open_unit_grads(c, unit)?;
            k += 1;
            Ok(())
        });
        self.zero.lend(true);
        f(&self.zero.params, &mut self.zero.grads);
        self.zero.lend(true);
        let mut k = 0;
        self.each(&mut |c, s| {
            let r = s.close_unit_grads(c, unit, &ids[k]);
            k += 1;
            r
        });
    }
}

//! What an asynchronous schedule (ZeRO 0–1) needs of the state: the whole current weight version
//! for its forwards and for stashing, one gradient store per update that it accumulates into
//! outside the state and swaps in for the update's reduction and step, and the reduction of a
//! whole store at once.
//!
//! In f32 the parameters are the version. Under bf16 the version is a view of the 16-bit compute
//! copy: its matrices shared as they are (a stashed view keeps the old ones alive, and the next
//! update writes a copy: copy on write), norm weights and biases widened. Each update's gradients
//! are summed in 16 bits, as the synchronous steps' micro-batches are.
//!
//! Each [`ZeroState`] keeps its own versions; a [`GroupedZero`] (expert parallelism: dense and
//! routed tensors in two states over two groups) lends its states' current versions to one store
//! in the shard's order for a segment, takes them back around each update, and splits an update's
//! gradients by state.

use super::grouped::GroupedZero;
use super::{HalfStore, ZeroState};
use crate::comm::{Comm, CommError};
use crate::half_storage::HalfGrads;
use crate::memory::{self, Term};
use crate::transformer::{ParamStore, Residency, Unit};

/// One update's gradients, in the state's format, held outside the state while they accumulate.
pub struct UpdateGrads(Store);

enum Store {
    F32(ParamStore),
    Bf16(HalfGrads<half::bf16>),
    F16(HalfGrads<half::f16>),
}

impl ZeroState {
    /// Starts a segment: under mixed precision the whole view of the current version is built.
    pub fn begin_versions<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        assert!(
            self.stage < 2 || self.dp == 1,
            "asynchronous schedules keep whole gradients (ZeRO 0–1)"
        );
        if self.half.is_some() {
            let all: Vec<usize> = (0..self.params.specs.len()).collect();
            self.gather(c, &all)?;
            self.version_view = true;
        }
        Ok(())
    }

    /// Ends a segment: the view of the version is dropped (the synchronous paths fill it per unit).
    pub fn end_versions(&mut self) {
        if self.version_view {
            let all: Vec<usize> = (0..self.params.specs.len()).collect();
            self.release(&all);
            self.version_view = false;
        }
    }

    /// One optimizer update, then (mixed precision) the view of the new version rebuilt. The view
    /// is dropped first, so that only a version a stash still holds is copied on write.
    pub fn update_version<C: Comm>(&mut self, c: &mut C, lr: f32) -> Result<(), CommError> {
        let view = self.version_view;
        if view {
            self.end_versions();
        }
        self.update(c, lr)?;
        if view {
            self.begin_versions(c)?;
        }
        Ok(())
    }

    /// A zeroed store for one update's gradients.
    pub fn update_grads(&self) -> UpdateGrads {
        UpdateGrads(match &self.half {
            None => {
                let mut g = ParamStore::empty(self.params.specs.clone());
                let _grads = memory::scope(Term::Gradients);
                g.allocate_zeroed();
                Store::F32(g)
            }
            Some(HalfStore::Bf16(p)) => Store::Bf16(p.zeroed_grads()),
            Some(HalfStore::F16(p)) => Store::F16(p.zeroed_grads()),
        })
    }

    /// A store without storage, to take the state's own out of use (an asynchronous segment
    /// accumulates each update in a store of its own).
    pub fn no_update_grads(&self) -> UpdateGrads {
        UpdateGrads(match &self.half {
            None => Store::F32(ParamStore::empty(self.params.specs.clone())),
            Some(HalfStore::Bf16(_)) => Store::Bf16(HalfGrads::none()),
            Some(HalfStore::F16(_)) => Store::F16(HalfGrads::none()),
        })
    }

    /// Exchanges the state's gradients with `other`, so that an update's gradients, accumulated
    /// outside, are reduced and applied by this state.
    pub fn swap_update_grads(&mut self, other: &mut UpdateGrads) {
        match (&mut self.half, &mut other.0) {
            (None, Store::F32(g)) => std::mem::swap(&mut self.grads, g),
            (Some(HalfStore::Bf16(p)), Store::Bf16(g)) => p.swap_grads(g),
            (Some(HalfStore::F16(p)), Store::F16(g)) => p.swap_grads(g),
            _ => unreachable!("a store is made by the state it returns to"),
        }
    }

    /// Reduces the whole gradients over the replicas at once (an all-reduce, or ZeRO-1's
    /// reduce-scatter into the owned pieces); under mixed precision in 16 bits, the owned part
    /// then widened into the main gradients.
    pub fn reduce_all<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        if let Some(h) = &mut self.half {
            return with_half!(h, p => p.reduce(c, &self.dp_group));
        }
        if self.dp == 1 {
            return Ok(());
        }
        self.reduced.fill(false);
        let all: Vec<usize> = (0..self.reduced.len()).collect();
        self.start_bucket(c, all)?;
        self.finish_in_flight(c)
    }
}

impl UpdateGrads {
    /// The store itself when the gradients are summed in f32 (a unit's added in place).
    fn in_f32(&mut self) -> Option<&mut ParamStore> {
        match &mut self.0 {
            Store::F32(g) => Some(g),
            _ => None,
        }
    }

    /// Adds the f32 gradients `ids` of `scratch` (then freed) into the 16-bit sums.
    fn absorb(&mut self, ids: &[usize], scratch: &mut ParamStore) {
        match &mut self.0 {
            Store::Bf16(sums) => sums.absorb(ids, scratch),
            Store::F16(sums) => sums.absorb(ids, scratch),
            Store::F32(_) => unreachable!("an f32 store takes a unit's gradients in place"),
        }
    }
}

/// One update's gradients of every state of a [`GroupedZero`], in its states' order, and the
/// bookkeeping every backward of the update reuses: the unit's gradients in the shard's order
/// (`view`), and under a 16-bit store each state's f32 scratch (tensors present only while a
/// unit's gradients move from the view into the sums).
pub struct GroupedUpdateGrads {
    stores: Vec<UpdateGrads>,
    view: ParamStore,
    scratch: Vec<ParamStore>,
}

impl GroupedZero {
    /// Starts a segment: each state's view of its current version, lent to one store in the
    /// shard's order until [`GroupedZero::end_versions`].
    pub fn begin_versions<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        assert!(!self.versions, "one segment at a time");
        for p in &mut self.parts {
            p.state.begin_versions(c)?;
        }
        self.lend(false);
        self.versions = true;
        Ok(())
    }

    /// Ends a segment: the current version back in its states, their views dropped.
    pub fn end_versions(&mut self) {
        if std::mem::take(&mut self.versions) {
            self.lend(false);
        }
        self.parts.iter_mut().for_each(|p| p.state.end_versions());
    }

    /// The whole parameters of the current version, which its forwards read and a stash keeps.
    pub fn current_params(&self) -> &ParamStore {
        assert!(
            self.versions,
            "the version exists between begin_versions and end_versions"
        );
        &self.params
    }

    /// One optimizer update of every state (one after the other), the new version lent again.
    pub fn update_version<C: Comm>(&mut self, c: &mut C, lr: f32) -> Result<(), CommError> {
        self.lend(false);
        let updated = self
            .parts
            .iter_mut()
            .try_for_each(|p| p.state.update_version(c, lr));
        self.lend(false);
        updated
    }

    /// A zeroed store for one update's gradients.
    pub fn update_grads(&self) -> GroupedUpdateGrads {
        let stores = self.parts.iter().map(|p| p.state.update_grads()).collect();
        self.grouped(stores)
    }

    /// A store without storage (see [`ZeroState::no_update_grads`]).
    pub fn no_update_grads(&self) -> GroupedUpdateGrads {
        let stores = self
            .parts
            .iter()
            .map(|p| p.state.no_update_grads())
            .collect();
        self.grouped(stores)
    }

    /// `stores` with the bookkeeping its backwards reuse (names and shapes, no tensors: kept out
    /// of the gradients and activations terms).
    fn grouped(&self, stores: Vec<UpdateGrads>) -> GroupedUpdateGrads {
        let _bookkeeping = memory::scope(Term::Other);
        let half = stores.iter().any(|g| !matches!(g.0, Store::F32(_)));
        let scratch = if half {
            let specs = |p: &super::grouped::Part| p.state.params.specs.clone();
            self.parts
                .iter()
                .map(|p| ParamStore::empty(specs(p)))
                .collect()
        } else {
            Vec::new()
        };
        GroupedUpdateGrads {
            stores,
            view: ParamStore::empty(self.specs.clone()),
            scratch,
        }
    }

    /// Exchanges the states' gradients with `other` (see [`ZeroState::swap_update_grads`]).
    pub fn swap_update_grads(&mut self, other: &mut GroupedUpdateGrads) {
        for (p, g) in self.parts.iter_mut().zip(&mut other.stores) {
            p.state.swap_update_grads(g);
        }
    }

    /// Reduces each state's whole gradients over its group, one state after the other.
    pub fn reduce_all<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        self.parts
            .iter_mut()
            .try_for_each(|p| p.state.reduce_all(c))
    }

    /// The executor's view for a pass on weight version `params` (in the shard's order), its
    /// weight gradients accumulated into `grads`.
    pub fn accumulating<'a>(
        &'a self,
        params: &'a ParamStore,
        grads: &'a mut GroupedUpdateGrads,
    ) -> VersionResidency<'a> {
        VersionResidency {
            zero: self,
            params,
            grads,
        }
    }
}

/// A weight version and an update's gradient store, as the executor sees them: every tensor
/// present, in the shard's order; each state's gradients moved into one view while a unit's
/// backward runs (f32), or (mixed precision) a unit's f32 gradients formed in the view and then
/// added into each state's 16-bit sums.
pub struct VersionResidency<'a> {
    zero: &'a GroupedZero,
    params: &'a ParamStore,
    grads: &'a mut GroupedUpdateGrads,
}

impl Residency for VersionResidency<'_> {
    fn params(&mut self, _unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        f(self.params)
    }

    fn params_and_grads(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        let parts = &self.zero.parts;
        let GroupedUpdateGrads {
            stores,
            view,
            scratch,
        } = &mut *self.grads;
        // Moves (no copies) tensor `i` of each state's store to and from the view's `at[i]`.
        let swap_in_f32 = |view: &mut ParamStore, stores: &mut [UpdateGrads]| {
            for (p, g) in parts.iter().zip(stores.iter_mut()) {
                let g = g.in_f32().expect("every state's store alike");
                for (i, &j) in p.at.iter().enumerate() {
                    std::mem::swap(&mut view.tensors[j], &mut g.tensors[i]);
                }
            }
        };
        if stores[0].in_f32().is_some() {
            swap_in_f32(view, stores);
            f(self.params, view);
            swap_in_f32(view, stores);
            return;
        }
        let ids: Vec<Vec<usize>> = parts.iter().map(|p| p.state.unit_ids(unit)).collect();
        let in_view: Vec<usize> = parts
            .iter()
            .zip(&ids)
            .flat_map(|(p, ids)| ids.iter().map(|&i| p.at[i]))
            .collect();
        super::reduce::open_scratch(view, &in_view);
        f(self.params, view);
        for (((p, ids), g), scratch) in parts.iter().zip(&ids).zip(stores).zip(scratch) {
            for &i in ids {
                std::mem::swap(&mut scratch.tensors[i], &mut view.tensors[p.at[i]]);
            }
            g.absorb(ids, scratch);
        }
    }
}

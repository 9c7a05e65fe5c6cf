//! What an asynchronous schedule (ZeRO 0–1) needs of the state: the whole current weight version
//! for its forwards and for stashing, one gradient store per update that it accumulates into
//! outside the state and swaps in for the update's reduction and step, and the reduction of a
//! whole store at once.
//!
//! In f32 the parameters are the version. Under bf16 the version is a view of the 16-bit compute
//! copy: its matrices shared as they are (a stashed view keeps the old ones alive, and the next
//! update writes a copy: copy on write), norm weights and biases widened. Each update's gradients
//! are summed in 16 bits, as the synchronous steps' micro-batches are.

use super::{HalfStore, ZeroState};
use crate::comm::{Comm, CommError};
use crate::half_storage::{Half16, HalfGrads};
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

    /// The whole parameters of the current version, which its forwards read and a stash keeps.
    pub fn current_params(&self) -> &ParamStore {
        assert!(
            self.half.is_none() || self.version_view,
            "the version's view exists between begin_versions and end_versions"
        );
        &self.params
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
                let _grads = memory::scope(Term::Gradients);
                Store::F32(ParamStore::zeros(self.params.specs.clone()))
            }
            Some(HalfStore::Bf16(p)) => Store::Bf16(p.zeroed_grads()),
            Some(HalfStore::F16(p)) => Store::F16(p.zeroed_grads()),
        })
    }

    /// A store without storage, to take the state's own out of use (an asynchronous segment
    /// accumulates each update in a store of its own).
    pub fn no_update_grads(&self) -> UpdateGrads {
        UpdateGrads(match &self.half {
            None => {
                let specs = self.params.specs.clone();
                let empty = vec![Vec::new(); specs.len()];
                Store::F32(ParamStore::from_tensors(specs, empty))
            }
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

    /// The executor's view for a pass on weight version `params`, its weight gradients accumulated
    /// into `grads`.
    pub fn accumulating<'a>(
        &'a self,
        params: &'a ParamStore,
        grads: &'a mut UpdateGrads,
    ) -> VersionResidency<'a> {
        // A 16-bit store's unit gradients form in f32 first; an f32 store takes them directly.
        let specs = &self.params.specs;
        let scratch = (!matches!(grads.0, Store::F32(_)))
            .then(|| ParamStore::from_tensors(specs.clone(), vec![Vec::new(); specs.len()]));
        VersionResidency {
            state: self,
            params,
            grads,
            scratch,
        }
    }
}

/// A weight version and an update's gradient store, as the executor sees them: every tensor
/// present; under mixed precision a unit's f32 gradients exist while its backward runs and are then
/// added into the 16-bit sums.
pub struct VersionResidency<'a> {
    state: &'a ZeroState,
    params: &'a ParamStore,
    grads: &'a mut UpdateGrads,
    /// Under a 16-bit store: the unit's f32 gradients while its backward runs.
    scratch: Option<ParamStore>,
}

impl VersionResidency<'_> {
    fn accumulate<T: Half16>(
        ids: &[usize],
        scratch: &mut ParamStore,
        params: &ParamStore,
        sums: &mut HalfGrads<T>,
        f: &mut dyn FnMut(&ParamStore, &mut ParamStore),
    ) {
        super::reduce::open_scratch(scratch, ids);
        f(params, scratch);
        sums.absorb(ids, scratch);
    }
}

impl Residency for VersionResidency<'_> {
    fn params(&mut self, _unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        f(self.params)
    }

    fn params_and_grads(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        let params = self.params;
        if let Store::F32(g) = &mut self.grads.0 {
            return f(params, g);
        }
        let ids = self.state.unit_ids(unit);
        let scratch = self
            .scratch
            .as_mut()
            .expect("a 16-bit store has its scratch");
        match &mut self.grads.0 {
            Store::Bf16(sums) => Self::accumulate(&ids, scratch, params, sums, f),
            Store::F16(sums) => Self::accumulate(&ids, scratch, params, sums, f),
            Store::F32(_) => unreachable!("taken above"),
        }
    }
}

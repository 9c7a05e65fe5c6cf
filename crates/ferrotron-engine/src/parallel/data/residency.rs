//! The executor's view of a [`ZeroState`]: units gathered (and prefetched) for it, gradients
//! reduced away per unit or in background buckets.

use super::ZeroState;
use crate::comm::{Comm, CommError};
use crate::parallel::tensor::TpGroup;
use crate::transformer::{FrozenBase, ParamStore, Residency, Unit};

/// The executor's view of a [`ZeroState`]: units gathered just in time (ZeRO-3), gradients reduced
/// away per unit (ZeRO-2/3) or in background buckets (ZeRO 0–1).
pub struct ZeroResidency<'s, 'c, C: Comm> {
    pub(super) state: &'s mut ZeroState,
    pub(super) tpg: &'s TpGroup<'c, C>,
}

impl ZeroState {
    /// Whether the executor's parameters are gathered per unit (ZeRO-3 over several replicas, or
    /// widened from 16-bit storage) rather than present throughout.
    pub(super) fn gathered(&self) -> bool {
        self.stage == 3 && self.dp > 1 || self.half.is_some()
    }

    /// Before the executor reads `unit`'s parameters: gathered, when they are per unit.
    pub(super) fn open_params<C: Comm>(&mut self, c: &mut C, unit: Unit) -> Result<(), CommError> {
        if self.gathered() {
            self.bring_in(c, unit)?;
        }
        Ok(())
    }

    /// After the executor read `unit`'s parameters: freed, when gathered per unit.
    pub(super) fn close_params(&mut self, unit: Unit) {
        if self.gathered() {
            self.release_unit(unit);
        }
    }

    /// Before the executor accumulates `unit`'s weight gradients: its parameters present, and
    /// zeroed gradients for it where they exist per unit (ZeRO-2/3, mixed precision's f32
    /// scratch). Returns the unit's tensors.
    pub(super) fn open_unit_grads<C: Comm>(
        &mut self,
        c: &mut C,
        unit: Unit,
    ) -> Result<Vec<usize>, CommError> {
        let ids = self.unit_ids(unit);
        self.open_params(c, unit)?;
        if self.half.is_some() {
            self.open_scratch(&ids);
        } else if self.stage >= 2 && self.dp > 1 {
            self.open_grads(&ids);
        }
        Ok(ids)
    }

    /// After the executor accumulated `unit`'s weight gradients (`ids`): its gathered parameters
    /// freed, and its gradients reduced away (ZeRO-2/3, mixed precision) or counted towards their
    /// bucket (ZeRO 0–1).
    pub(super) fn close_unit_grads<C: Comm>(
        &mut self,
        c: &mut C,
        unit: Unit,
        ids: &[usize],
    ) -> Result<(), CommError> {
        if self.half.is_some() {
            self.release(ids);
            return self.absorb(c, ids);
        }
        self.close_params(unit);
        if self.stage >= 2 && self.dp > 1 {
            // The prefetch completes first (the gathered unit is needed next anyway).
            self.finish_prefetch(c)?;
            self.scatter_grads(c, ids)
        } else {
            self.visited(c, unit)
        }
    }

    /// Completes every collective this state has in flight (a prefetch, a bucket): before another
    /// state's collectives on another group may start (a device runs one at a time).
    pub(super) fn settle<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        self.finish_prefetch(c)?;
        self.finish_scatter(c)?;
        self.finish_in_flight(c)
    }
}

impl<C: Comm> Residency for ZeroResidency<'_, '_, C> {
    fn begin_pass(&mut self, units: &[Unit]) {
        let s = &mut *self.state;
        if s.prefetches() {
            // Nothing of an earlier pass is still in flight (each pass asks for all its units).
            self.tpg.with_comm(|c| s.finish_prefetch(c));
            if let Some(u) = s.present.take() {
                s.release(&s.unit_ids(u));
            }
            s.pass = units.iter().copied().collect();
        }
    }

    fn params(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        let s = &mut *self.state;
        self.tpg.with_comm(|c| s.open_params(c, unit));
        f(&s.params);
        s.close_params(unit);
    }

    fn gather_frozen(&mut self, unit: Unit, base: &FrozenBase) -> ParamStore {
        let s = &mut *self.state;
        let mut view = None;
        self.tpg.with_comm(|c| {
            // One collective at a time on the group: a prefetch in flight completes first.
            s.finish_prefetch(c)?;
            let (v, done) = base.gather_unit(Some(c), &s.dp_group, unit);
            view = Some(v);
            done
        });
        view.unwrap_or_else(|| base.gather_unit::<C>(None, &s.dp_group, unit).0)
    }

    fn params_and_grads(&mut self, unit: Unit, f: &mut dyn FnMut(&ParamStore, &mut ParamStore)) {
        let s = &mut *self.state;
        let mut ids = s.unit_ids(unit);
        self.tpg.with_comm(|c| {
            ids = s.open_unit_grads(c, unit)?;
            Ok(())
        });
        f(&s.params, &mut s.grads);
        self.tpg.with_comm(|c| s.close_unit_grads(c, unit, &ids));
    }
}

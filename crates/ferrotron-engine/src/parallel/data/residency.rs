//! The executor's view of a [`ZeroState`]: units gathered (and prefetched) for it, gradients
//! reduced away per unit or in background buckets.

use super::ZeroState;
use crate::comm::Comm;
use crate::parallel::tensor::TpGroup;
use crate::transformer::{FrozenBase, ParamStore, Residency, Unit};

/// The executor's view of a [`ZeroState`]: units gathered just in time (ZeRO-3), gradients reduced
/// away per unit (ZeRO-2/3) or in background buckets (ZeRO 0–1).
pub struct ZeroResidency<'s, 'c, C: Comm> {
    pub(super) state: &'s mut ZeroState,
    pub(super) tpg: &'s TpGroup<'c, C>,
}

impl<C: Comm> ZeroResidency<'_, '_, C> {
    fn gathered(&self) -> bool {
        self.state.stage == 3 && self.state.dp > 1 || self.state.half.is_some()
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
        let gathered = self.gathered();
        let s = &mut *self.state;
        if gathered {
            self.tpg.with_comm(|c| s.bring_in(c, unit));
        }
        f(&s.params);
        if gathered {
            s.release_unit(unit);
        }
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
        let gathered = self.gathered();
        let s = &mut *self.state;
        let ids = s.unit_ids(unit);
        if gathered {
            self.tpg.with_comm(|c| s.bring_in(c, unit));
        }
        if s.half.is_some() {
            s.open_scratch(&ids);
            f(&s.params, &mut s.grads);
            s.release(&ids);
            self.tpg.with_comm(|c| s.absorb(c, &ids));
            return;
        }
        let sharded_grads = s.stage >= 2 && s.dp > 1;
        if sharded_grads {
            s.open_grads(&ids);
        }
        f(&s.params, &mut s.grads);
        if gathered {
            s.release_unit(unit);
        }
        if sharded_grads {
            // One collective at a time on the group: the prefetch completes first.
            self.tpg.with_comm(|c| {
                s.finish_prefetch(c)?;
                s.scatter_grads(c, &ids)
            });
        } else {
            self.tpg.with_comm(|c| s.visited(c, unit));
        }
    }
}

//! ZeRO-3 gathers: a unit's whole parameters from every replica's pieces, just before use, with
//! the pass's next unit prefetched in the background; and their release after use.

use super::{piece, ZeroState};
use crate::comm::{Comm, CommError};
use crate::memory::{self, Term};
use crate::pieces::from_gathered;
use crate::transformer::Unit;

impl ZeroState {
    /// Gathers whole tensors `ids` from every rank's pieces (ZeRO-3), or widens them from 16-bit
    /// storage (mixed precision), into the executor's view.
    pub(super) fn gather<C: Comm>(&mut self, c: &mut C, ids: &[usize]) -> Result<(), CommError> {
        if let Some(h) = &self.half {
            let view = &mut self.params;
            return with_half!(h, p => p.materialize(c, &self.dp_group, ids, view));
        }
        // A gathered unit's parameters are transient buffers (the lasting copy is the pieces).
        let _buffers = memory::scope(Term::CommBuffers);
        let mine = self.own_param_pieces(ids);
        let mut all = vec![0f32; mine.len() * self.dp];
        c.all_gather(&self.dp_group, &mine, &mut all)?;
        self.file_gathered(ids, &all);
        Ok(())
    }

    /// This rank's pieces of tensors `ids`, concatenated (what it contributes to their gather).
    pub(super) fn own_param_pieces(&self, ids: &[usize]) -> Vec<f32> {
        // Sized once (a collected flat_map would grow by doubling, copying itself).
        let n = ids.iter().map(|&i| self.param_pieces[i].len()).sum();
        let mut out = Vec::with_capacity(n);
        ids.iter()
            .for_each(|&i| out.extend_from_slice(&self.param_pieces[i]));
        out
    }

    /// Files an all-gather of `ids`' pieces (one block per rank) as whole tensors.
    pub(super) fn file_gathered(&mut self, ids: &[usize], all: &[f32]) {
        let block = all.len() / self.dp;
        let params = &mut self.params;
        let mut at = 0;
        for &id in ids {
            let len = params.specs[id].numel();
            params.tensors[id] = from_gathered(all, self.dp, block, at, len);
            at += piece(len, self.dp, 0).len();
        }
    }

    /// Whether units are gathered ahead of use (ZeRO-3 over several replicas, f32 storage).
    pub(super) fn prefetches(&self) -> bool {
        self.prefetch_enabled && self.stage == 3 && self.dp > 1 && self.half.is_none()
    }

    /// The tensors of `unit` (a copy: the caller goes on to change the state).
    pub(super) fn unit_ids(&self, unit: Unit) -> Vec<usize> {
        self.units.get(&unit).cloned().unwrap_or_default()
    }

    /// Starts the gather of `unit` in the background.
    pub(super) fn start_prefetch<C: Comm>(
        &mut self,
        c: &mut C,
        unit: Unit,
    ) -> Result<(), CommError> {
        let _buffers = memory::scope(Term::CommBuffers);
        let mine = self.own_param_pieces(&self.unit_ids(unit));
        let pending = c.start_all_gather(&self.dp_group, &mine)?;
        self.prefetch = Some((unit, pending));
        Ok(())
    }

    /// Completes the gather in flight, if any: its unit is present from then on.
    pub(super) fn finish_prefetch<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        let Some((unit, pending)) = self.prefetch.take() else {
            return Ok(());
        };
        let _buffers = memory::scope(Term::CommBuffers);
        let all = c.wait(pending)?;
        self.file_gathered(&self.unit_ids(unit), &all);
        self.present = Some(unit);
        Ok(())
    }

    /// Makes `unit`'s parameters present for the executor: prefetched, or gathered now. Then starts
    /// gathering the next unit of the pass, to overlap the work on this one.
    pub(super) fn bring_in<C: Comm>(&mut self, c: &mut C, unit: Unit) -> Result<(), CommError> {
        if !self.prefetches() {
            return self.gather(c, &self.unit_ids(unit));
        }
        self.finish_prefetch(c)?;
        match self.present.take() {
            Some(u) if u == unit => {}
            Some(other) => {
                self.release(&self.unit_ids(other));
                self.gather(c, &self.unit_ids(unit))?;
            }
            None => self.gather(c, &self.unit_ids(unit))?,
        }
        let next = {
            let pass = &mut self.pass;
            while let Some(u) = pass.pop_front() {
                if u == unit {
                    break;
                }
            }
            pass.front().copied()
        };
        match next {
            Some(n) => self.start_prefetch(c, n),
            None => Ok(()),
        }
    }

    /// Frees `unit`'s gathered parameters, except those the unit fetched next shares with it (a
    /// tied embedding is in the embedding and the head).
    pub(super) fn release_unit(&mut self, unit: Unit) {
        let ahead = self.prefetch.as_ref().map(|(u, _)| *u).or(self.present);
        let keep = ahead.map(|u| self.unit_ids(u)).unwrap_or_default();
        let ids: Vec<usize> = self
            .unit_ids(unit)
            .iter()
            .copied()
            .filter(|i| !keep.contains(i))
            .collect();
        self.release(&ids);
    }

    pub(super) fn release(&mut self, ids: &[usize]) {
        for &i in ids {
            self.params.tensors[i] = Vec::new();
            self.params.bf16[i] = None;
        }
    }
}

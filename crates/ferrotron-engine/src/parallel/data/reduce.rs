//! Gradient reductions over the replicas: background buckets (ZeRO 0–1), a unit's reduce-scatter
//! into this rank's pieces (ZeRO-2/3), 16-bit gradients (mixed precision), deferred weight gradients.

use super::{owned, piece, ZeroState};
use crate::comm::{Comm, CommError, ReduceOp};
use crate::memory::{self, Term};
use crate::pieces::push_padded_piece;
use crate::transformer::{ParamStore, Unit};

/// The point-to-point tags of the replicas' gradient reductions (ZeRO-2/3): this bit, and the
/// reduction's sequence number in the low bits (the same on every replica: each starts them in
/// the same order).
const SCATTER_TAG: u64 = 3 << 62 | 1 << 45;
const SCATTER_SEQ: u64 = (1 << 40) - 1;

/// A reduction of unit gradients started by `scatter_grads`: its tensors, their lengths, this
/// replica's own block, and its tag.
pub(super) struct ScatterInFlight {
    ids: Vec<usize>,
    lens: Vec<usize>,
    own: Vec<f32>,
    tag: u64,
}

impl ZeroState {
    /// Lays out `ids`' tensors as dp blocks, block k holding piece k of each tensor in turn (so that a
    /// reduce-scatter hands each rank its pieces, and an all-gather of pieces rebuilds the tensors).
    pub(super) fn interleave(&self, tensors: &[&[f32]]) -> Vec<f32> {
        // Sized once: grown by doubling it would copy itself and fault fresh pages in every step.
        let block: usize = tensors
            .iter()
            .map(|t| piece(t.len(), self.dp, 0).len())
            .sum();
        let mut out = Vec::with_capacity(self.dp * block);
        for k in 0..self.dp {
            tensors
                .iter()
                .for_each(|t| push_padded_piece(&mut out, t, self.dp, k));
        }
        out
    }

    /// Reduces whole gradients `ids` over the replicas into each owner's pieces and frees them
    /// (ZeRO-2/3). Each replica sends every other its piece straight away and goes on computing;
    /// the pieces addressed to this replica are taken in and summed before its next such reduction
    /// (or at the end of the step), so that replicas computing at slightly different speeds do
    /// not wait for the slowest at every unit, as a blocking ring made them. The bytes each sends
    /// are the ring's, (dp − 1)/dp of the unit; the sum runs over the replicas in rank order.
    pub(super) fn scatter_grads<C: Comm>(
        &mut self,
        c: &mut C,
        ids: &[usize],
    ) -> Result<(), CommError> {
        self.finish_scatter(c)?;
        let _buffers = memory::scope(Term::CommBuffers);
        let lens: Vec<usize> = ids.iter().map(|&i| self.grads.tensors[i].len()).collect();
        let buf = {
            let g = &self.grads;
            let ts: Vec<&[f32]> = ids.iter().map(|&i| g.tensors[i].as_slice()).collect();
            self.interleave(&ts)
        };
        let block = buf.len() / self.dp;
        let tag = SCATTER_TAG | (self.scatters_started & SCATTER_SEQ);
        self.scatters_started += 1;
        for k in (0..self.dp).filter(|&k| k != self.dp_rank) {
            let to = self.dp_group.ranks[k];
            c.send_overlapped("dp", to, &buf[k * block..(k + 1) * block], tag)?;
        }
        let own = buf[self.dp_rank * block..(self.dp_rank + 1) * block].to_vec();
        drop(buf);
        for &i in ids {
            self.grads.tensors[i] = Vec::new();
        }
        self.scatter = Some(ScatterInFlight {
            ids: ids.to_vec(),
            lens,
            own,
            tag,
        });
        Ok(())
    }

    /// Takes in the pieces of the reduction in flight, if any, and adds their sum (over the
    /// replicas, in rank order) into this replica's gradient pieces.
    pub(super) fn finish_scatter<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        let Some(s) = self.scatter.take() else {
            return Ok(());
        };
        let _buffers = memory::scope(Term::CommBuffers);
        let block = s.own.len();
        let mut sum = vec![0f32; block];
        let mut theirs = vec![0f32; block];
        for k in 0..self.dp {
            let piece = if k == self.dp_rank {
                &s.own
            } else {
                c.recv_as("dp", self.dp_group.ranks[k], &mut theirs, s.tag)?;
                &theirs
            };
            sum.iter_mut().zip(piece).for_each(|(a, b)| *a += b);
        }
        // This rank's block holds its piece of each tensor in turn: added where it belongs.
        let mut at = 0;
        for (&id, &len) in s.ids.iter().zip(&s.lens) {
            let n = piece(len, self.dp, 0).len();
            self.grad_pieces[id]
                .iter_mut()
                .zip(&sum[at..at + n])
                .for_each(|(a, b)| *a += b);
            at += n;
        }
        Ok(())
    }

    /// Mixed precision: zeroed f32 gradients for `ids`, for the executor to accumulate into.
    pub(super) fn open_scratch(&mut self, ids: &[usize]) {
        open_scratch(&mut self.grads, ids);
    }

    /// Mixed precision: rounds the f32 gradients of `ids` into the 16-bit storage (and frees them).
    pub(super) fn absorb<C: Comm>(&mut self, c: &mut C, ids: &[usize]) -> Result<(), CommError> {
        let h = self.half.as_mut().expect("mixed precision");
        let scratch = &mut self.grads;
        with_half!(h, p => p.absorb(c, &self.dp_group, ids, scratch))
    }

    /// Allocates zeroed whole gradients for `ids` (ZeRO-2/3): a bucket that lives until it is
    /// reduce-scattered, so it counts as a communication buffer.
    pub(super) fn open_grads(&mut self, ids: &[usize]) {
        let _bucket = memory::scope(Term::CommBuffers);
        let g = &mut self.grads;
        for &i in ids {
            g.tensors[i] = vec![0f32; g.specs[i].numel()];
        }
    }

    /// Waits for the bucket in flight, if any, and files its result.
    pub(super) fn finish_in_flight<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        let Some((ids, pending)) = self.in_flight.take() else {
            return Ok(());
        };
        let out = c.wait(pending)?;
        self.file_reduced(&ids, &out);
        Ok(())
    }

    /// Files the result of a bucket's reduction: whole sums (ZeRO-0), or this rank's pieces into
    /// their place in the whole gradients (ZeRO-1; the rest of them is stale from then on).
    pub(super) fn file_reduced(&mut self, ids: &[usize], out: &[f32]) {
        let (dp, dp_rank) = (self.dp, self.dp_rank);
        if self.sharded() {
            let g = &mut self.grads;
            let mut at = 0;
            for &i in ids {
                let t = &mut g.tensors[i];
                let (own, n) = (owned(t.len(), dp, dp_rank), piece(t.len(), dp, 0).len());
                let len = own.len();
                t[own].copy_from_slice(&out[at..at + len]);
                at += n;
            }
        } else {
            let g = &mut self.grads;
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
    pub(super) fn start_bucket<C: Comm>(
        &mut self,
        c: &mut C,
        ids: Vec<usize>,
    ) -> Result<(), CommError> {
        self.finish_in_flight(c)?;
        let _buffers = memory::scope(Term::CommBuffers);
        let buf: Vec<f32> = {
            let g = &self.grads;
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
        ids.iter().for_each(|&i| self.reduced[i] = true);
        self.in_flight = Some((ids, pending));
        Ok(())
    }

    /// Counts one gradient visit of `unit`'s tensors and, under ZeRO 0–1, starts reducing those that
    /// are now final.
    pub(super) fn visited<C: Comm>(&mut self, c: &mut C, unit: Unit) -> Result<(), CommError> {
        if self.dp == 1 || self.stage >= 2 {
            return Ok(());
        }
        let ready: Vec<usize> = {
            let left = &mut self.visits_left;
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
        &mut self,
        c: &mut C,
        touched: &[usize],
        apply: impl FnOnce(&mut ParamStore),
    ) -> Result<(), CommError> {
        self.open_deferred(touched);
        apply(&mut self.grads);
        self.close_deferred(c, touched)
    }

    /// Before deferred weight gradients of `touched` accumulate: zeroed gradients for them where
    /// gradients exist per unit (mixed precision's f32 scratch, ZeRO-2/3).
    pub(super) fn open_deferred(&mut self, touched: &[usize]) {
        if self.half.is_some() {
            self.open_scratch(touched);
        } else if self.stage >= 2 && self.dp > 1 {
            self.open_grads(touched);
        }
    }

    /// After deferred weight gradients of `touched` accumulated: reduced away where they exist
    /// per unit.
    pub(super) fn close_deferred<C: Comm>(
        &mut self,
        c: &mut C,
        touched: &[usize],
    ) -> Result<(), CommError> {
        if self.half.is_some() {
            return self.absorb(c, touched);
        }
        if self.stage >= 2 && self.dp > 1 {
            self.scatter_grads(c, touched)?;
        }
        Ok(())
    }

    /// Ends the step's gradient reduction over dp: every gradient not yet reduced is, and the bucket in
    /// flight completes. Afterwards [`ZeroState::grad_view`] holds the reduced gradients this rank owns.
    pub fn reduce_grads<C: Comm>(&mut self, c: &mut C) -> Result<(), CommError> {
        if let Some(h) = &mut self.half {
            return with_half!(h, p => p.reduce(c, &self.dp_group));
        }
        if self.dp == 1 {
            return Ok(());
        }
        if self.stage >= 2 {
            return self.finish_scatter(c);
        }
        let rest: Vec<usize> = self
            .reduced
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
}

/// Mixed precision: zeroed f32 gradients for `ids` in `scratch` (the executor accumulates a unit's
/// there before they are added into the 16-bit sums).
pub(super) fn open_scratch(scratch: &mut ParamStore, ids: &[usize]) {
    let _grads = memory::scope(Term::Gradients);
    for &i in ids {
        scratch.tensors[i] = vec![0f32; scratch.specs[i].numel()];
    }
}

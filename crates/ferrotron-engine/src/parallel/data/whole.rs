//! Whole tensors from this rank's shard of the state: the parameters (ZeRO-3: gathered from the
//! pieces) and the reduced gradients, for saving the model and for the equivalence checks.

use super::{own_pieces, piece, ZeroState};
use crate::comm::{Comm, CommError};
use crate::memory::{self, Term};
use crate::transformer::ParamStore;

impl ZeroState {
    /// Mixed precision: the whole f32 master weights (or, `master` false, the step's main gradients),
    /// gathered over the replicas when sharded.
    pub(super) fn half_whole<C: Comm>(
        &self,
        c: &mut C,
        master: bool,
    ) -> Result<ParamStore, CommError> {
        let h = self.half.as_ref().expect("mixed precision");
        let specs = self.params.specs.clone();
        let whole = with_half!(h, parts => {
            let which = if master { &parts.master } else { &parts.main };
            parts.whole(c, &self.dp_group, which)
        })?;
        Ok(ParamStore::from_tensors(specs, whole))
    }

    /// The device's whole parameters (ZeRO-3: gathered from the pieces; every dp rank must call it).
    pub fn full_params<C: Comm>(&mut self, c: &mut C) -> Result<ParamStore, CommError> {
        let _other = memory::scope(Term::Other);
        if self.half.is_some() {
            return self.half_whole(c, true);
        }
        if self.stage == 3 && self.dp > 1 {
            let ids: Vec<usize> = (0..self.param_pieces.len()).collect();
            self.gather(c, &ids)?;
            let out = self.params.clone();
            self.release(&ids);
            return Ok(out);
        }
        Ok(self.params.clone())
    }

    /// The device's whole reduced gradients (gathered from the pieces when sharded; every dp rank must
    /// call it).
    pub fn full_grads<C: Comm>(&self, c: &mut C) -> Result<ParamStore, CommError> {
        let _other = memory::scope(Term::Other);
        if self.half.is_some() {
            return self.half_whole(c, false);
        }
        let specs = self.params.specs.clone();
        if !self.sharded() {
            return Ok(self.grads.clone());
        }
        let mine: Vec<f32> = if self.stage >= 2 {
            self.grad_pieces.concat()
        } else {
            let g = &self.grads;
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

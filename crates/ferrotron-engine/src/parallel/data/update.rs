//! The optimizer step over what this rank owns (whole tensors, its ZeRO pieces, or the f32 master
//! of 16-bit weights), the updated pieces gathered back; and the owned state a checkpoint keeps.

use super::{own_pieces, owned, piece, OwnedState, ZeroState};
use crate::comm::{Comm, CommError};
use crate::memory::{self, Term};
use crate::transformer::ParamStore;
use std::ops::Range;

impl ZeroState {
    /// One AdamW update of what this rank owns, then (ZeRO 1–2) the updated pieces all-gathered.
    pub fn update<C: Comm>(&mut self, c: &mut C, lr: f32) -> Result<(), CommError> {
        if let Some(h) = &mut self.half {
            let opt = &mut self.opt;
            return with_half!(h, parts => {
                let g: Vec<&[f32]> = parts.main.iter().map(Vec::as_slice).collect();
                let mut m: Vec<&mut [f32]> =
                    parts.master.iter_mut().map(|t| t.as_mut_slice()).collect();
                opt.step_slices(&mut m, &g, lr);
                drop(g);
                parts.refresh_weights(c, &self.dp_group)
            });
        }
        if !self.sharded() {
            let (params, grads) = (&mut self.params, &mut self.grads);
            if self.threaded_update {
                self.opt.step(params, grads, lr);
            } else {
                self.opt.step_serial(params, grads, lr);
            }
            return Ok(());
        }
        // The owned gradients: pieces (ZeRO-2/3) or the owned part of the whole ones (ZeRO-1).
        let (dp, rank) = (self.dp, self.dp_rank);
        let own = |len: usize| owned(len, dp, rank);
        let pieces = std::mem::take(&mut self.grad_pieces);
        let whole = std::mem::replace(&mut self.grads, ParamStore::zeros(Vec::new()));
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
            // then gather every part, one unit at a time (as the gradients were reduced), so the
            // gather's buffers are one unit's, not the stage's.
            let chunks = self.gather_chunks();
            let params = &mut self.params;
            let mut p: Vec<&mut [f32]> = params
                .tensors
                .iter_mut()
                .map(|t| {
                    let r = own(t.len());
                    &mut t[r]
                })
                .collect();
            self.opt.step_slices(&mut p, &g, lr);
            for ids in &chunks {
                gather_updated(c, &self.dp_group, params, ids, dp, rank)?;
            }
        }
        drop(g);
        self.grad_pieces = pieces;
        self.grads = whole;
        Ok(())
    }

    /// The tensors gathered together after an update: each unit's (in order of their first tensor),
    /// then any tensor no unit holds on its own.
    fn gather_chunks(&self) -> Vec<Vec<usize>> {
        let mut chunks: Vec<Vec<usize>> = self.units.values().cloned().collect();
        chunks.iter_mut().for_each(|c| c.sort_unstable());
        chunks.sort();
        let mut seen = vec![false; self.params.tensors.len()];
        let mut out: Vec<Vec<usize>> = Vec::new();
        for c in chunks {
            // A tensor shared by two units (tied embeddings) is gathered once.
            let fresh: Vec<usize> = c
                .into_iter()
                .filter(|&i| !std::mem::replace(&mut seen[i], true))
                .collect();
            if !fresh.is_empty() {
                out.push(fresh);
            }
        }
        out.extend((0..seen.len()).filter(|&i| !seen[i]).map(|i| vec![i]));
        out
    }

    /// The range of each flattened tensor this rank owns: whole, or its ZeRO piece without the
    /// padding (what it updates, and so what it keeps in a checkpoint).
    pub fn owned_ranges(&self) -> Vec<Range<usize>> {
        let p = &self.params;
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
            with_half!(h, parts => {
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
            let p = &self.params;
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
}

/// All-gathers the updated pieces of tensors `ids` over `group` into the whole tensors.
fn gather_updated<C: Comm>(
    c: &mut C,
    group: &crate::comm::Group,
    params: &mut ParamStore,
    ids: &[usize],
    dp: usize,
    rank: usize,
) -> Result<(), CommError> {
    let (mine, mut all) = {
        let _buffers = memory::scope(Term::CommBuffers);
        let ts: Vec<&[f32]> = ids.iter().map(|&i| params.tensors[i].as_slice()).collect();
        let mine: Vec<f32> = own_pieces(&ts, dp, rank);
        let all = vec![0f32; mine.len() * dp];
        (mine, all)
    };
    c.all_gather(group, &mine, &mut all)?;
    let block = mine.len();
    let mut at = 0;
    for &i in ids {
        let t = &mut params.tensors[i];
        let (len, n) = (t.len(), piece(t.len(), dp, 0).len());
        for k in 0..dp {
            let r = piece(len, dp, k);
            let end = r.end.min(len);
            let start = r.start.min(end);
            t[start..end].copy_from_slice(&all[k * block + at..k * block + at + (end - start)]);
        }
        at += n;
    }
    Ok(())
}

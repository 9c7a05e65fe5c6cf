//! Weight gradients computed now or deferred: zero-bubble pipeline schedules split a backward into the
//! input gradient (on the critical path) and the weight gradient (run later, to fill a bubble).

use super::layer::{Lin, NormIds, NormStash};
use super::ParamStore;
use crate::kernels::Backend;

/// Where a backward's weight gradients go.
pub(crate) enum WeightSink<'a> {
    /// Accumulated into the store at once.
    Now(&'a mut ParamStore),
    /// Recorded, with the tensors they need, for [`WeightGrads::apply`].
    Later(&'a mut Vec<WeightJob>),
}

/// One deferred weight-gradient computation.
pub(crate) enum WeightJob {
    Linear {
        lin: Lin,
        dy: Vec<f32>,
        x: Vec<f32>,
    },
    Norm {
        norm: NormIds,
        dy: Vec<f32>,
        x: Vec<f32>,
        stash: NormStash,
    },
    Embedding {
        table: usize,
        ids: Vec<u32>,
        dout: Vec<f32>,
        dim: usize,
    },
}

/// The weight-gradient half of a split backward.
pub struct WeightGrads(pub(crate) Vec<WeightJob>);

impl WeightGrads {
    /// Bytes this deferred work keeps alive.
    pub fn bytes(&self) -> usize {
        self.0
            .iter()
            .map(|j| match j {
                WeightJob::Linear { dy, x, .. } => 4 * (dy.len() + x.len()),
                WeightJob::Norm { dy, x, stash, .. } => 4 * (dy.len() + x.len()) + stash.bytes(),
                WeightJob::Embedding { ids, dout, .. } => 4 * (ids.len() + dout.len()),
            })
            .sum()
    }

    /// Indices of the tensors whose gradients this work accumulates.
    pub fn tensors(&self) -> Vec<usize> {
        let mut ids: Vec<usize> = self
            .0
            .iter()
            .flat_map(|j| match j {
                WeightJob::Linear { lin, .. } => vec![Some(lin.w), lin.b],
                WeightJob::Norm { norm, .. } => vec![Some(norm.w), norm.b],
                WeightJob::Embedding { table, .. } => vec![Some(*table)],
            })
            .flatten()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Accumulates every deferred weight gradient into `g`.
    pub fn apply(self, be: &dyn Backend, g: &mut ParamStore) {
        for job in self.0 {
            match job {
                WeightJob::Linear { lin, dy, x } => lin.backward_weight(be, g, &dy, &x),
                WeightJob::Norm { norm, dy, x, stash } => {
                    norm.backward_weight(be, g, &dy, &x, &stash)
                }
                WeightJob::Embedding {
                    table,
                    ids,
                    dout,
                    dim,
                } => be.embedding_backward_weight(&ids, &dout, dim, &mut g.tensors[table]),
            }
        }
    }
}

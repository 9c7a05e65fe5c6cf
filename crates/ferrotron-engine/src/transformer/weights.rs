//! Weight gradients computed now or deferred: zero-bubble pipeline schedules split a backward into the
//! input gradient (on the critical path) and the weight gradient (run later, to fill a bubble).

use super::linear::{scale_in_place, Lin, Weights};
use super::norm::{NormIds, NormStash};
use super::ParamStore;
use crate::kernels::Backend;
use ferrotron_core::model::NormKind;

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

/// The backward of a linear layer: its input gradient, and its weight gradients into a sink.
impl Lin {
    /// Input gradient into `dx` (overwrite or accumulate); the weight (and bias) gradient goes to `g`,
    /// now or later — with an adapter, its two gradients, and the frozen base's none.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        be: &dyn Backend,
        w: Weights,
        g: &mut WeightSink,
        dy: &[f32],
        x: &[f32],
        dx: &mut [f32],
        acc: bool,
    ) {
        let s = self.shape(dy.len() / self.out_dim);
        be.linear_backward_input(s, dy, w.base.matrix(self.w), dx, acc);
        self.backward_rest(be, w, g, dy, x, dx);
    }

    /// [`Lin::backward`] with the input gradient in a new buffer (no zeroing pass).
    pub(crate) fn backward_new(
        &self,
        be: &dyn Backend,
        w: Weights,
        g: &mut WeightSink,
        dy: &[f32],
        x: &[f32],
    ) -> Vec<f32> {
        let mut dx = Lin::input_grad(be, self.shape(dy.len() / self.out_dim), dy, w.base, self.w);
        self.backward_rest(be, w, g, dy, x, &mut dx);
        dx
    }

    /// What [`Lin::backward`] does after the base's input gradient: the weight gradient and the
    /// adapter's part.
    pub(super) fn backward_rest(
        &self,
        be: &dyn Backend,
        w: Weights,
        g: &mut WeightSink,
        dy: &[f32],
        x: &[f32],
        dx: &mut [f32],
    ) {
        let rows = dy.len() / self.out_dim;
        if !w.frozen() {
            self.weight_grad(be, g, dy, x);
        }
        let Some(ad) = self.adapter else { return };
        let store = w
            .adapters
            .expect("an adapter's tensors are in the adapter store");
        let (down, up) = (
            Lin::plain(ad.a, self.in_dim, ad.rank),
            Lin::plain(ad.b, ad.rank, self.out_dim),
        );
        // z = scale · x·Aᵀ is recomputed rather than stashed: r/out of the layer's own product.
        let mut z = down.product(be, store, x, rows, false);
        scale_in_place(&mut z, ad.scale);
        // dz = dy·B, and du = scale · dz is the gradient at x·Aᵀ.
        let mut du = Lin::input_grad(be, up.shape(rows), dy, store, ad.b);
        scale_in_place(&mut du, ad.scale);
        be.linear_backward_input(down.shape(rows), &du, store.matrix(ad.a), dx, true);
        up.weight_grad(be, g, dy, &z);
        down.weight_grad(be, g, &du, x);
    }

    /// The weight (and bias) gradient of `dy` at input `x`, into `g` now or later.
    pub(super) fn weight_grad(&self, be: &dyn Backend, g: &mut WeightSink, dy: &[f32], x: &[f32]) {
        match g {
            WeightSink::Now(store) => self.backward_weight(be, store, dy, x),
            WeightSink::Later(jobs) => jobs.push(WeightJob::Linear {
                lin: *self,
                dy: dy.to_vec(),
                x: x.to_vec(),
            }),
        }
    }
}

/// The backward of a norm: its input gradient, and its weight gradients into a sink.
impl NormIds {
    /// Input gradient into `dx`; the weight (and bias) gradient to `g`, unless the base is frozen.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        be: &dyn Backend,
        p: Weights,
        g: &mut WeightSink,
        dy: &[f32],
        x: &[f32],
        s: &NormStash,
        dx: &mut [f32],
        acc: bool,
    ) {
        let w = &p.base.tensors[self.w];
        match self.kind {
            NormKind::RmsNorm => be.rmsnorm_backward_input(dy, x, w, &s.rstd, dx, acc),
            NormKind::LayerNorm => be.layernorm_backward_input(dy, x, w, &s.mean, &s.rstd, dx, acc),
        }
        if p.frozen() {
            return;
        }
        match g {
            WeightSink::Now(store) => self.backward_weight(be, store, dy, x, s),
            WeightSink::Later(jobs) => jobs.push(WeightJob::Norm {
                norm: *self,
                dy: dy.to_vec(),
                x: x.to_vec(),
                stash: NormStash {
                    out: Vec::new(),
                    ..s.clone()
                },
            }),
        }
    }
}

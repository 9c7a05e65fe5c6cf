//! A linear layer as the executor runs it: the base projection (either Hugging Face weight
//! layout, a bias, a 16-bit compute copy) and a LoRA adapter beside it. How its backward routes
//! weight gradients (now, or deferred for a zero-bubble schedule) is in `weights.rs`.

use super::ParamStore;
use crate::kernels::{Backend, LinearShape};
use ferrotron_core::model::WeightLayout;

/// The tensors a unit's work reads: the base model's parameters and, with LoRA, the adapters. With
/// adapters the base is frozen: it gets no gradients, and the gradient store is the adapters'.
#[derive(Clone, Copy)]
pub(crate) struct Weights<'a> {
    pub base: &'a ParamStore,
    pub adapters: Option<&'a ParamStore>,
}

impl Weights<'_> {
    pub fn frozen(&self) -> bool {
        self.adapters.is_some()
    }
}

/// A LoRA adapter beside a projection: `A` (`[r, in]`) and `B` (`[out, r]`), both `nn.Linear`
/// weights, by index into the adapter store, and the scale `alpha / r`. The projection becomes
/// `y = x·Wᵀ + scale · (x·Aᵀ)·Bᵀ`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adapter {
    pub a: usize,
    pub b: usize,
    pub rank: usize,
    pub scale: f32,
}

/// A linear layer's parameters, by index into the store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lin {
    pub w: usize,
    pub b: Option<usize>,
    pub in_dim: usize,
    pub out_dim: usize,
    pub layout: WeightLayout,
    /// A LoRA adapter beside it (its tensors index the adapter store).
    pub adapter: Option<Adapter>,
}

/// `x *= s`, element-wise.
pub(super) fn scale_in_place(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

impl Lin {
    /// A plain `[in → out]` map of weight `w` (no bias, no adapter): an adapter's halves.
    pub(super) fn plain(w: usize, in_dim: usize, out_dim: usize) -> Self {
        Self {
            w,
            b: None,
            in_dim,
            out_dim,
            layout: WeightLayout::OutIn,
            adapter: None,
        }
    }

    pub fn shape(&self, rows: usize) -> LinearShape {
        LinearShape {
            rows,
            in_dim: self.in_dim,
            out_dim: self.out_dim,
            layout: self.layout,
        }
    }

    /// `x·Wᵀ (+ b)` with this layer's tensors in `store`.
    pub(crate) fn product(
        &self,
        be: &dyn Backend,
        store: &ParamStore,
        x: &[f32],
        rows: usize,
        bias: bool,
    ) -> Vec<f32> {
        let b = self.b.filter(|_| bias).map(|b| store.tensors[b].as_slice());
        let (s, w) = (self.shape(rows), store.matrix(self.w));
        // SAFETY: the product writes every element of its output (then adds the bias).
        unsafe {
            be.overwritten(rows * self.out_dim, &mut |y| {
                be.linear_forward(s, x, w, b, y)
            })
        }
    }

    pub(super) fn forward(&self, be: &dyn Backend, w: Weights, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = self.product(be, w.base, x, rows, true);
        self.add_adapter(be, w, x, rows, &mut y);
        y
    }

    /// `y += scale · (x·Aᵀ)·Bᵀ` when an adapter sits beside this layer.
    pub(super) fn add_adapter(
        &self,
        be: &dyn Backend,
        w: Weights,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
    ) {
        let Some(ad) = self.adapter else { return };
        let store = w
            .adapters
            .expect("an adapter's tensors are in the adapter store");
        let mut z = Lin::plain(ad.a, self.in_dim, ad.rank).product(be, store, x, rows, false);
        scale_in_place(&mut z, ad.scale);
        let up = Lin::plain(ad.b, ad.rank, self.out_dim).product(be, store, &z, rows, false);
        be.add_assign(y, &up);
    }

    /// `dy·W` of weight `w` in `store`, in a new buffer (not zeroed first: the product writes it).
    pub(super) fn input_grad(
        be: &dyn Backend,
        s: LinearShape,
        dy: &[f32],
        store: &ParamStore,
        w: usize,
    ) -> Vec<f32> {
        let w = store.matrix(w);
        // SAFETY: without accumulation the product writes every element of its output.
        unsafe {
            be.overwritten(s.rows * s.in_dim, &mut |dx| {
                be.linear_backward_input(s, dy, w, dx, false)
            })
        }
    }

    pub(crate) fn backward_weight(
        &self,
        be: &dyn Backend,
        g: &mut ParamStore,
        dy: &[f32],
        x: &[f32],
    ) {
        let s = self.shape(dy.len() / self.out_dim);
        match self.b {
            Some(b) => {
                let [dw, db] = g
                    .tensors
                    .get_disjoint_mut([self.w, b])
                    .expect("distinct weight and bias");
                be.linear_backward_weight(s, dy, x, dw, Some(db));
            }
            None => be.linear_backward_weight(s, dy, x, &mut g.tensors[self.w], None),
        }
    }
}

//! A norm layer (RMSNorm or LayerNorm) as the executor runs it: forward with its statistics kept,
//! and its weight gradient. Its backward, which routes that gradient, is in `weights.rs`.

use super::ParamStore;
use crate::kernels::Backend;
use ferrotron_core::model::NormKind;

#[derive(Debug, Clone, Copy)]
pub(crate) struct NormIds {
    pub kind: NormKind,
    pub w: usize,
    pub b: Option<usize>,
}

/// A norm's output and the per-row statistics its backward needs.
#[derive(Debug, Default, Clone)]
pub(crate) struct NormStash {
    pub out: Vec<f32>,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

impl NormStash {
    pub fn bytes(&self) -> usize {
        4 * (self.out.len() + self.mean.len() + self.rstd.len())
    }
}

impl NormIds {
    pub fn forward(&self, be: &dyn Backend, p: &ParamStore, x: &[f32], eps: f32) -> NormStash {
        let w = &p.tensors[self.w];
        let rows = x.len() / w.len();
        let (mut mean, mut rstd) = (Vec::new(), vec![0f32; rows]);
        let mut write = |out: &mut [f32]| match self.kind {
            NormKind::RmsNorm => be.rmsnorm_forward(x, w, eps, out, &mut rstd),
            NormKind::LayerNorm => {
                mean = vec![0f32; rows];
                let b = &p.tensors[self.b.expect("layernorm has a bias")];
                be.layernorm_forward(x, w, b, eps, out, &mut mean, &mut rstd)
            }
        };
        // SAFETY: both norms write every element of their output.
        let out = unsafe { be.overwritten(x.len(), &mut write) };
        NormStash { out, mean, rstd }
    }

    pub(crate) fn backward_weight(
        &self,
        be: &dyn Backend,
        g: &mut ParamStore,
        dy: &[f32],
        x: &[f32],
        s: &NormStash,
    ) {
        match self.kind {
            NormKind::RmsNorm => be.rmsnorm_backward_weight(dy, x, &s.rstd, &mut g.tensors[self.w]),
            NormKind::LayerNorm => {
                let b = self.b.expect("layernorm has a bias");
                let [dw, db] = g
                    .tensors
                    .get_disjoint_mut([self.w, b])
                    .expect("distinct weight and bias");
                be.layernorm_backward_weight(dy, x, &s.mean, &s.rstd, dw, db);
            }
        }
    }
}

//! SwiGLU (Llama MLP) and GELU-tanh (GPT-2 MLP), fused and threaded.

use super::simd::{self, sigmoid};
use super::CpuBackend;
use rayon::prelude::*;

const CHUNK: usize = 4096;
const GELU_C: f32 = 0.797_884_6; // √(2/π)
const GELU_A: f32 = 0.044715;

impl CpuBackend {
    /// Runs `f(offset, a_chunk, b_chunk)` over matching chunks of two outputs.
    fn for_pairs<F>(&self, a: &mut [f32], b: &mut [f32], f: F)
    where
        F: Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
    {
        assert_eq!(a.len(), b.len());
        if self.threads > 1 && a.len() >= 4 * CHUNK {
            a.par_chunks_mut(CHUNK)
                .zip(b.par_chunks_mut(CHUNK))
                .enumerate()
                .for_each(|(i, (a, b))| f(i * CHUNK, a, b));
        } else {
            f(0, a, b)
        }
    }

    pub(crate) fn swiglu_forward_impl(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        self.for_rows(out, CHUNK, |c, o| {
            let off = c * CHUNK;
            simd::vectorized(|| {
                for ((o, &g), &u) in o.iter_mut().zip(&gate[off..]).zip(&up[off..]) {
                    *o = g * sigmoid(g) * u;
                }
            })
        });
    }

    pub(crate) fn swiglu_backward_impl(
        &self,
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        self.for_pairs(dgate, dup, |off, dg, du| {
            let n = dg.len();
            let (gate, up, dout) = (&gate[off..off + n], &up[off..off + n], &dout[off..off + n]);
            simd::vectorized(|| {
                for i in 0..n {
                    let (g, u, d) = (gate[i], up[i], dout[i]);
                    let s = sigmoid(g);
                    du[i] = d * g * s;
                    dg[i] = d * u * s * (1.0 + g * (1.0 - s));
                }
            })
        });
    }

    pub(crate) fn gelu_forward_impl(&self, x: &[f32], out: &mut [f32]) {
        self.for_rows(out, CHUNK, |c, o| {
            simd::vectorized(|| {
                for (o, &x) in o.iter_mut().zip(&x[c * CHUNK..]) {
                    *o = 0.5 * x * (1.0 + simd::tanh(GELU_C * (x + GELU_A * x * x * x)));
                }
            })
        });
    }

    pub(crate) fn gelu_backward_impl(&self, dout: &[f32], x: &[f32], dx: &mut [f32]) {
        self.for_rows(dx, CHUNK, |c, o| {
            let off = c * CHUNK;
            simd::vectorized(|| {
                for ((o, &x), &d) in o.iter_mut().zip(&x[off..]).zip(&dout[off..]) {
                    let t = simd::tanh(GELU_C * (x + GELU_A * x * x * x));
                    let dt = GELU_C * (1.0 + 3.0 * GELU_A * x * x);
                    *o = d * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt);
                }
            })
        });
    }
}

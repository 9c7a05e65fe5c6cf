//! SwiGLU (Llama MLP) and GELU-tanh (GPT-2 MLP), fused and threaded.

use super::threads::Threads;
use crate::kernels::float::{sigmoid, tanh, Real};
use crate::kernels::simd::simd_kernel;

const CHUNK: usize = 4096;
const GELU_C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const GELU_A: f64 = 0.044715;

simd_kernel! {
    pub(crate) fn swiglu_forward<T: Real>(threads: &Threads, gate: &[T], up: &[T], out: &mut [T]) {
        threads.for_rows(out, CHUNK, |c, o| {
            let off = c * CHUNK;
            for ((o, &g), &u) in o.iter_mut().zip(&gate[off..]).zip(&up[off..]) {
                *o = g * sigmoid(g) * u;
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn swiglu_backward<T: Real>(
        threads: &Threads,
        dout: &[T],
        gate: &[T],
        up: &[T],
        dgate: &mut [T],
        dup: &mut [T],
    ) {
        threads.for_pairs(dgate, dup, CHUNK, |off, dg, du| {
            let n = dg.len();
            let (gate, up, dout) = (&gate[off..off + n], &up[off..off + n], &dout[off..off + n]);
            for i in 0..n {
                let (g, u, d) = (gate[i], up[i], dout[i]);
                let s = sigmoid(g);
                du[i] = d * g * s;
                dg[i] = d * u * s * (T::ONE + g * (T::ONE - s));
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn gelu_forward<T: Real>(threads: &Threads, x: &[T], out: &mut [T]) {
        let (c, a, half) = (T::of(GELU_C), T::of(GELU_A), T::of(0.5));
        threads.for_rows(out, CHUNK, |i, o| {
            for (o, &x) in o.iter_mut().zip(&x[i * CHUNK..]) {
                *o = half * x * (T::ONE + tanh(c * (x + a * x * x * x)));
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn gelu_backward<T: Real>(threads: &Threads, dout: &[T], x: &[T], dx: &mut [T]) {
        let (c, a, half, three) = (T::of(GELU_C), T::of(GELU_A), T::of(0.5), T::of(3.0));
        threads.for_rows(dx, CHUNK, |i, o| {
            let off = i * CHUNK;
            for ((o, &x), &d) in o.iter_mut().zip(&x[off..]).zip(&dout[off..]) {
                let t = tanh(c * (x + a * x * x * x));
                let dt = c * (T::ONE + three * a * x * x);
                *o = d * (half * (T::ONE + t) + half * x * (T::ONE - t * t) * dt);
            }
        });
    }
}

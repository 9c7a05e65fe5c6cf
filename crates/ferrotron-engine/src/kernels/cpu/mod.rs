//! The CPU backend: the ops of [`Backend`] as threaded, fused loops over rows, the f32 GEMM from the
//! `gemm` crate and our bf16 GEMM. The op files take the threading helper ([`Threads`]) and, where
//! it matters, the products' arithmetic; only this file knows the backend.

mod activation;
mod attention;
#[cfg(test)]
mod attention_materialized;
pub mod bf16_gemm;
mod embedding;
mod exp2_rows;
mod f32_gemm;
#[cfg(test)]
mod finite_difference;
mod linear;
mod loss;
mod nf4_linear;
mod norm;
mod rotate;
pub(crate) mod small_gemm;
mod threads;

pub(crate) use threads::Threads;

use super::{
    bf16_convert, AttnBlock, AttnGradInputs, AttnShape, Backend, LinearShape, Matrix, Qkv,
    QkvGrads, RopeTable,
};
use ferrotron_core::precision::Products;
use rayon::prelude::*;

/// CPU kernels. `threads` is how many cores one device may use: 1 keeps every kernel on the calling
/// thread (several devices in one process, each on its own thread), more spreads work over rayon.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    pub threads: usize,
    /// The arithmetic of the linear layers' and attention's products: f32, or bf16 operands with
    /// f32 accumulation (bf16 mixed precision).
    pub products: Products,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::with_threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl CpuBackend {
    /// Makes the GEMM crate allocate its per-thread workspace (a packing slab the size of the L2
    /// cache, kept for the thread's life) now, on the calling thread: a device calls it under the
    /// `other` memory term, so that the workspace, whose size depends on the CPU, is not counted as
    /// the activations of whatever step first multiplies.
    pub fn reserve_workspace(&self) {
        const N: usize = 256;
        let (a, b) = (vec![0f32; N * N], vec![0f32; N * N]);
        let mut c = vec![0f32; N * N];
        self.matmul(N, N, N, (&a, N, 1), (&b, N, 1), &mut c, N, false);
    }

    pub fn single_threaded() -> Self {
        Self::with_threads(1)
    }

    /// f32 products on `threads` cores.
    pub fn with_threads(threads: usize) -> Self {
        Self {
            threads,
            products: Products::F32,
        }
    }

    /// The products in this arithmetic (see [`bf16_gemm`]).
    pub fn computing(mut self, products: Products) -> Self {
        self.products = products;
        self
    }

    #[inline]
    fn cores(&self) -> Threads {
        Threads::new(self.threads)
    }
}

impl Backend for CpuBackend {
    fn f32_products(&self) -> Box<dyn Backend> {
        Box::new(self.clone().computing(Products::F32))
    }
    fn matmul(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: (&[f32], usize, usize),
        b: (&[f32], usize, usize),
        c: &mut [f32],
        c_rs: usize,
        acc: bool,
    ) {
        f32_gemm::gemm_strided(&self.cores(), m, n, k, a, b, c, c_rs, acc, true)
    }
    fn linear_forward(
        &self,
        s: LinearShape,
        x: &[f32],
        w: Matrix,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) {
        match w {
            Matrix::F32(w) => linear::forward(&self.cores(), self.products, s, x, w, bias, y),
            Matrix::Bf16(w) => linear::forward_bf16(&self.cores(), self.products, s, x, w, bias, y),
            Matrix::Nf4(w) => nf4_linear::forward(&self.cores(), self.products, s, x, w, bias, y),
        }
    }
    fn linear_backward_input(
        &self,
        s: LinearShape,
        dy: &[f32],
        w: Matrix,
        dx: &mut [f32],
        acc: bool,
    ) {
        match w {
            Matrix::F32(w) => {
                linear::backward_input(&self.cores(), self.products, s, dy, w, dx, acc)
            }
            Matrix::Bf16(w) => {
                linear::backward_input_bf16(&self.cores(), self.products, s, dy, w, dx, acc)
            }
            Matrix::Nf4(w) => {
                nf4_linear::backward_input(&self.cores(), self.products, s, dy, w, dx, acc)
            }
        }
    }
    fn linear_backward_weight(
        &self,
        s: LinearShape,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
    ) {
        linear::backward_weight(&self.cores(), self.products, s, dy, x, dw, db)
    }
    fn embedding_forward(
        &self,
        ids: &[u32],
        table: Matrix,
        dim: usize,
        out: &mut [f32],
        acc: bool,
    ) {
        match table {
            Matrix::F32(t) => embedding::forward(&self.cores(), ids, t, dim, out, acc),
            Matrix::Bf16(t) => embedding::forward_bf16(&self.cores(), ids, t, dim, out, acc),
            Matrix::Nf4(_) => unreachable!("embedding tables are never quantized"),
        }
    }
    fn embedding_backward_weight(&self, ids: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]) {
        embedding::backward_weight(ids, dout, dim, dtable)
    }
    fn rmsnorm_forward(&self, x: &[f32], w: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
        norm::rms_forward(&self.cores(), x, w, eps, y, rstd)
    }
    fn rmsnorm_backward_input(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        acc: bool,
    ) {
        norm::rms_backward_input(&self.cores(), dy, x, w, rstd, dx, acc)
    }
    fn rmsnorm_backward_weight(&self, dy: &[f32], x: &[f32], rstd: &[f32], dw: &mut [f32]) {
        norm::rms_backward_weight(dy, x, rstd, dw)
    }
    fn layernorm_forward(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        norm::layer_forward(&self.cores(), x, w, b, eps, y, mean, rstd)
    }
    fn layernorm_backward_input(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        acc: bool,
    ) {
        norm::layer_backward_input(&self.cores(), dy, x, w, mean, rstd, dx, acc)
    }
    fn layernorm_backward_weight(
        &self,
        dy: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) {
        norm::layer_backward_weight(dy, x, mean, rstd, dw, db)
    }
    fn rope_forward(&self, table: &RopeTable, positions: &[u32], heads: usize, x: &mut [f32]) {
        rotate::rotate(&self.cores(), table, positions, heads, x, false)
    }
    fn rope_backward(&self, table: &RopeTable, positions: &[u32], heads: usize, dx: &mut [f32]) {
        rotate::rotate(&self.cores(), table, positions, heads, dx, true)
    }
    fn attention_forward(&self, s: AttnShape, x: Qkv, out: &mut [f32], lse: &mut [f32]) {
        attention::forward(&self.cores(), self.products, s.whole(), x, out, lse)
    }
    fn attention_block_forward(&self, b: AttnBlock, x: Qkv, out: &mut [f32], lse: &mut [f32]) {
        attention::forward(&self.cores(), self.products, b, x, out, lse)
    }
    fn attention_merge(
        &self,
        s: AttnShape,
        out: &mut [f32],
        lse: &mut [f32],
        out_b: &[f32],
        lse_b: &[f32],
    ) {
        attention::merge(&self.cores(), s, out, lse, out_b, lse_b)
    }
    fn attention_block_backward(&self, b: AttnBlock, inputs: AttnGradInputs, grads: QkvGrads) {
        attention::backward_block(&self.cores(), self.products, b, inputs, grads)
    }
    fn attention_backward(&self, s: AttnShape, inputs: AttnGradInputs, grads: QkvGrads) {
        attention::backward(&self.cores(), self.products, s, inputs, grads)
    }
    fn swiglu_forward(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        activation::swiglu_forward(&self.cores(), gate, up, out)
    }
    fn swiglu_backward(
        &self,
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        activation::swiglu_backward(&self.cores(), dout, gate, up, dgate, dup)
    }
    fn gelu_forward(&self, x: &[f32], out: &mut [f32]) {
        activation::gelu_forward(&self.cores(), x, out)
    }
    fn gelu_backward(&self, dout: &[f32], x: &[f32], dx: &mut [f32]) {
        activation::gelu_backward(&self.cores(), dout, x, dx)
    }
    fn cross_entropy(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[Option<u32>],
        scale: f32,
    ) -> f64 {
        loss::cross_entropy(&self.cores(), logits, vocab, targets, scale)
    }
    fn shard_logit_max(&self, logits: &[f32], vocab: usize, valid: usize, max: &mut [f32]) {
        loss::shard_logit_max(&self.cores(), logits, vocab, valid, max)
    }
    fn shard_exp_sums(
        &self,
        logits: &mut [f32],
        vocab: usize,
        valid: usize,
        start: u32,
        targets: &[Option<u32>],
        max: &[f32],
        sums: &mut [f64],
    ) {
        loss::shard_exp_sums(
            &self.cores(),
            logits,
            vocab,
            valid,
            start,
            targets,
            max,
            sums,
        )
    }
    fn shard_softmax_grad(
        &self,
        exp_logits: &mut [f32],
        vocab: usize,
        valid: usize,
        start: u32,
        targets: &[Option<u32>],
        sums: &[f64],
        scale: f32,
    ) {
        loss::shard_softmax_grad(
            &self.cores(),
            exp_logits,
            vocab,
            valid,
            start,
            targets,
            sums,
            scale,
        )
    }
    fn add_assign(&self, y: &mut [f32], x: &[f32]) {
        assert_eq!(y.len(), x.len(), "add_assign: lengths");
        self.cores().for_rows(y, 4096, |c, yc| {
            yc.iter_mut().zip(&x[c * 4096..]).for_each(|(y, x)| *y += x)
        });
    }

    fn rounded_to_bf16(&self, src: &[f32]) -> Vec<half::bf16> {
        // A pass over memory: split over the cores like the zeroing below.
        const CHUNK: usize = 1 << 16;
        if self.threads == 1 || src.len() < 4 * CHUNK {
            return bf16_convert::rounded(src);
        }
        bf16_convert::filled(
            src.len(),
            |d: &mut [std::mem::MaybeUninit<half::bf16>]| {
                d.par_chunks_mut(CHUNK)
                    .zip(src.par_chunks(CHUNK))
                    .for_each(|(d, s)| {
                        // SAFETY: bf16 is a transparent u16; the view is only written.
                        let bits = unsafe {
                            std::slice::from_raw_parts_mut(d.as_mut_ptr().cast(), d.len())
                        };
                        bf16_convert::round_to(s, bits)
                    })
            },
        )
    }
    fn widened_from_bf16(&self, src: &[half::bf16]) -> Vec<f32> {
        const CHUNK: usize = 1 << 16;
        if self.threads == 1 || src.len() < 4 * CHUNK {
            return bf16_convert::widened(src);
        }
        bf16_convert::filled(src.len(), |d| {
            d.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| bf16_convert::widen_to(s, d))
        })
    }
    fn zeros(&self, len: usize) -> Vec<f32> {
        // Freed activation memory stays in the process, so the allocator's zeroing is a memset on the
        // calling thread while the other cores wait; split it instead.
        const CHUNK: usize = 1 << 16;
        if self.threads == 1 || len < 4 * CHUNK {
            return vec![0.0; len];
        }
        let mut v = Vec::with_capacity(len);
        v.spare_capacity_mut()[..len]
            .par_chunks_mut(CHUNK)
            .for_each(|c| {
                c.iter_mut().for_each(|x| {
                    x.write(0.0);
                })
            });
        // SAFETY: every one of the first `len` elements was written just above.
        unsafe { v.set_len(len) };
        v
    }
    unsafe fn overwritten(&self, len: usize, write: &mut dyn FnMut(&mut [f32])) -> Vec<f32> {
        bf16_convert::filled(len, |out| {
            // SAFETY: f32 has no invalid bit patterns, and the caller guarantees that `write`
            // writes every element before reading it.
            write(unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len()) })
        })
    }
}

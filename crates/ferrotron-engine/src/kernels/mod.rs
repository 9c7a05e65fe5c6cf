//! Forward and backward of every op the models use, as explicit functions over flat row-major `f32`
//! buffers. Each op's backward is split into the input-gradient part and the weight-gradient part so
//! zero-bubble pipeline schedules can run them at different times.
//!
//! [`Backend`] is the narrow interface the model executor calls; [`CpuBackend`] implements it with a
//! GEMM crate and fused, threaded element-wise loops. A CUDA backend implements the same trait.

pub mod bf16_convert;
pub mod cpu;
pub mod float;
pub mod nf4;
mod rope;
pub mod simd;

pub use cpu::{bf16_gemm, CpuBackend};
pub use rope::RopeTable;

use ferrotron_core::model::WeightLayout;

/// A token id that selects no row of an embedding table: its output row is zero and it receives no
/// gradient (a vocab-parallel shard's table holds only some of the vocabulary).
pub const MASKED_ID: u32 = u32::MAX;

/// Attention's inputs: Q, K and V, token-major (`[tokens, heads·head_dim]`; K and V with the KV
/// heads).
#[derive(Debug, Clone, Copy)]
pub struct Qkv<'a, T = f32> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
}

/// What attention's backward reads: the output's gradient, the inputs, and the output and
/// log-sum-exp forward kept.
#[derive(Debug, Clone, Copy)]
pub struct AttnGradInputs<'a, T = f32> {
    pub dout: &'a [T],
    pub x: Qkv<'a, T>,
    pub out: &'a [T],
    pub lse: &'a [T],
}

/// Attention's gradients at Q, K and V.
#[derive(Debug)]
pub struct QkvGrads<'a, T = f32> {
    pub dq: &'a mut [T],
    pub dk: &'a mut [T],
    pub dv: &'a mut [T],
}

impl<'a, T> Qkv<'a, T> {
    pub fn new(q: &'a [T], k: &'a [T], v: &'a [T]) -> Self {
        Self { q, k, v }
    }
}

impl<'a, T> AttnGradInputs<'a, T> {
    pub fn new(dout: &'a [T], x: Qkv<'a, T>, out: &'a [T], lse: &'a [T]) -> Self {
        Self { dout, x, out, lse }
    }
}

impl<'a, T> QkvGrads<'a, T> {
    pub fn new(dq: &'a mut [T], dk: &'a mut [T], dv: &'a mut [T]) -> Self {
        Self { dq, dk, dv }
    }
}

impl<T> QkvGrads<'_, T> {
    /// The same gradients, borrowed again (to hand them on and keep them).
    pub fn reborrow(&mut self) -> QkvGrads<'_, T> {
        QkvGrads {
            dq: self.dq,
            dk: self.dk,
            dv: self.dv,
        }
    }
}

/// Shape of one attention call: `batch` sequences of `seq` tokens, `heads` query heads sharing
/// `kv_heads` key/value heads (grouped-query attention), each `head_dim` wide.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a query sees itself and the `window − 1` keys before it
    /// (transformers' `kv_idx > q_idx − window`); `None` sees every earlier key.
    pub window: Option<usize>,
}

impl AttnShape {
    /// The first key that query `i` sees.
    pub fn first_key(&self, i: usize) -> usize {
        self.window.map_or(0, |w| (i + 1).saturating_sub(w))
    }
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// One log-sum-exp per (sequence, head, query): what attention keeps for backward besides
    /// its inputs and output.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// Every query of each sequence against every key of it.
    pub fn whole(&self) -> AttnBlock {
        let all = Span {
            rows: self.seq,
            first: 0,
            len: self.seq,
            position: 0,
        };
        AttnBlock {
            shape: *self,
            q: all,
            k: all,
        }
    }
}

/// Rows of one side of an attention block: in each sequence's `rows` rows of the tensor, the `len`
/// rows from row `first`, which hold the tokens at positions `position..position + len` of the
/// sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub rows: usize,
    pub first: usize,
    pub len: usize,
    pub position: usize,
}

/// Part of an attention: some queries of each sequence against some of its keys (context
/// parallelism computes a device's queries against every device's keys, block by block). `shape`
/// gives the heads and the window (its `seq` is unused); the tensors hold `q.rows` query rows and
/// `k.rows` key/value rows per sequence, and the log-sum-exp `q.rows` entries per (sequence, head).
#[derive(Debug, Clone, Copy)]
pub struct AttnBlock {
    pub shape: AttnShape,
    pub q: Span,
    pub k: Span,
}

impl AttnBlock {
    /// Whether any query of the block sees any of its keys (causal, windowed).
    pub fn any_visible(&self) -> bool {
        let (q, k) = (self.q, self.k);
        q.len > 0
            && k.len > 0
            && k.position < q.position + q.len
            // The first query's window reaches furthest back.
            && self.shape.first_key(q.position) < k.position + k.len
    }
}

/// A linear map `y = x·Wᵀ (+ b)` over `rows` rows, with the weight in either storage layout.
#[derive(Debug, Clone, Copy)]
pub struct LinearShape {
    pub rows: usize,
    pub in_dim: usize,
    pub out_dim: usize,
    pub layout: WeightLayout,
}

/// Largest element offset a strided `rows × cols` view (row stride `rs`, column stride `cs`)
/// touches, plus one: what a slice must hold for the view to lie inside it.
pub(crate) fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// A linear layer's weight as the executor holds it: f32, (bf16 compute) the bf16 compute copy
/// the GEMM reads as it is, or (a QLoRA base) NF4, `[out, in]` whatever the checkpoint's layout,
/// dequantized a panel at a time into the operand the GEMM packs.
#[derive(Clone, Copy)]
pub enum Matrix<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    Nf4(&'a nf4::Nf4Matrix),
}

/// The ops a device must provide. Buffers are row-major; `accumulate` means `+=` instead of `=`.
/// Weight-gradient methods always accumulate, so micro-batches sum into one gradient.
pub trait Backend: Sync {
    /// These kernels with f32 products (operands as they are, 16-bit weights widened): what a
    /// mixture of experts' router computes in under mixed precision, so that which experts a token
    /// takes does not turn on the products' rounding (Megatron-Core's fp32 router, DeepSeek-V3's
    /// gating).
    fn f32_products(&self) -> Box<dyn Backend>;

    /// `c[m×n] (+)= a[m×k] · b[k×n]` with arbitrary row/column strides for `a` and `b`.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: (&[f32], usize, usize),
        b: (&[f32], usize, usize),
        c: &mut [f32],
        c_row_stride: usize,
        accumulate: bool,
    );

    fn linear_forward(
        &self,
        s: LinearShape,
        x: &[f32],
        w: Matrix,
        bias: Option<&[f32]>,
        y: &mut [f32],
    );
    fn linear_backward_input(
        &self,
        s: LinearShape,
        dy: &[f32],
        w: Matrix,
        dx: &mut [f32],
        accumulate: bool,
    );
    fn linear_backward_weight(
        &self,
        s: LinearShape,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
    );

    /// `out[t] (+)= table[ids[t]]`, rows of width `dim`; a [`MASKED_ID`] row is zero (or left as is).
    fn embedding_forward(
        &self,
        ids: &[u32],
        table: Matrix,
        dim: usize,
        out: &mut [f32],
        accumulate: bool,
    );
    /// `dtable[ids[t]] += dout[t]`, skipping [`MASKED_ID`].
    fn embedding_backward_weight(&self, ids: &[u32], dout: &[f32], dim: usize, dtable: &mut [f32]);

    /// RMSNorm; saves the per-row reciprocal RMS for backward.
    fn rmsnorm_forward(&self, x: &[f32], w: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]);
    fn rmsnorm_backward_input(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        accumulate: bool,
    );
    fn rmsnorm_backward_weight(&self, dy: &[f32], x: &[f32], rstd: &[f32], dw: &mut [f32]);

    /// LayerNorm; saves per-row mean and reciprocal standard deviation.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    );
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_input(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        accumulate: bool,
    );
    fn layernorm_backward_weight(
        &self,
        dy: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dw: &mut [f32],
        db: &mut [f32],
    );

    /// Rotates each head of `x` (rows are tokens, `positions[row]` their positions) in place.
    fn rope_forward(&self, table: &RopeTable, positions: &[u32], heads: usize, x: &mut [f32]);
    /// The transpose rotation, applied in place to a gradient.
    fn rope_backward(&self, table: &RopeTable, positions: &[u32], heads: usize, dx: &mut [f32]);

    /// Causal softmax attention, memory-efficient: `lse` keeps each query row's log-sum-exp of its
    /// scaled scores for backward (`s.lse_len()`); no probabilities are kept. Every element of
    /// `out` and `lse` is written, none read.
    fn attention_forward(&self, s: AttnShape, x: Qkv, out: &mut [f32], lse: &mut [f32]);
    /// One block of attention (some queries against some keys): its output rows, normalised over
    /// the block's keys, and their log-sum-exp (−∞ and a zero row for a query that sees none of
    /// them). [`Backend::attention_merge`] combines blocks into the whole.
    fn attention_block_forward(&self, b: AttnBlock, x: Qkv, out: &mut [f32], lse: &mut [f32]);
    /// Folds a block's output and log-sum-exp (`out_b`, `lse_b`) into the running ones (`out`,
    /// `lse`): softmax over the union of their keys. Shapes as `s.whole()`'s.
    fn attention_merge(
        &self,
        s: AttnShape,
        out: &mut [f32],
        lse: &mut [f32],
        out_b: &[f32],
        lse_b: &[f32],
    );
    /// One block's share of attention's backward, given the whole attention's output and
    /// log-sum-exp at the block's queries: adds into `dq` (the block's query rows) and `dk`, `dv`
    /// (its key rows).
    fn attention_block_backward(&self, b: AttnBlock, inputs: AttnGradInputs, grads: QkvGrads);
    /// The gradients at Q, K and V, from forward's output and log-sum-exp (the probabilities are
    /// recomputed tile by tile): every element of `dq`, `dk` and `dv` is written (not accumulated
    /// into), none read before.
    fn attention_backward(&self, s: AttnShape, inputs: AttnGradInputs, grads: QkvGrads);

    /// `out = silu(gate) · up`.
    fn swiglu_forward(&self, gate: &[f32], up: &[f32], out: &mut [f32]);
    fn swiglu_backward(
        &self,
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    );
    /// GPT-2's tanh-approximated GELU.
    fn gelu_forward(&self, x: &[f32], out: &mut [f32]);
    fn gelu_backward(&self, dout: &[f32], x: &[f32], dx: &mut [f32]);

    /// Cross-entropy of each row of `logits` (width `vocab`) against `targets` (`None`: row ignored).
    /// Replaces `logits` with `scale · ∂loss/∂logits` and returns the sum of the row losses.
    fn cross_entropy(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[Option<u32>],
        scale: f32,
    ) -> f64;

    /// Vocab-parallel cross-entropy, first pass over one shard of the vocabulary: rows `vocab` wide,
    /// of which the first `valid` columns are real (the rest is padding). Writes each row's maximum.
    fn shard_logit_max(&self, logits: &[f32], vocab: usize, valid: usize, max: &mut [f32]);
    /// Second pass, given the group's row maxima: replaces the real columns by `exp(x − max)` and
    /// writes per row `[Σ exp, logit[target] − max]`, the second 0 where the target (a global id; this
    /// shard holds ids `start..start + valid`) is elsewhere or the row has none.
    #[allow(clippy::too_many_arguments)]
    fn shard_exp_sums(
        &self,
        logits: &mut [f32],
        vocab: usize,
        valid: usize,
        start: u32,
        targets: &[Option<u32>],
        max: &[f32],
        sums: &mut [f64],
    );
    /// Third pass, given the group's sums: replaces the row by `scale · (softmax − onehot)`; padding
    /// columns and rows without a target get zero.
    #[allow(clippy::too_many_arguments)]
    fn shard_softmax_grad(
        &self,
        exp_logits: &mut [f32],
        vocab: usize,
        valid: usize,
        start: u32,
        targets: &[Option<u32>],
        sums: &[f64],
        scale: f32,
    );

    /// `y += x`.
    fn add_assign(&self, y: &mut [f32], x: &[f32]);

    /// `src` rounded to bf16, to nearest even, in a new buffer (the activation stash under bf16).
    fn rounded_to_bf16(&self, src: &[f32]) -> Vec<half::bf16> {
        bf16_convert::rounded(src)
    }
    /// `src` widened to f32 (exact), in a new buffer.
    fn widened_from_bf16(&self, src: &[half::bf16]) -> Vec<f32> {
        bf16_convert::widened(src)
    }
    /// A new buffer of `len` zeros. The model executor makes its activation and gradient buffers here,
    /// so a backend decides how (the CPU one zeroes large buffers on all its threads).
    fn zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    /// A new buffer of `len` elements that `write` fills: for the outputs of kernels that write
    /// every element of theirs, so that the buffer need not be zeroed first (the CPU backend does
    /// not: a pass over memory as long as the output, 75 MB a block on the benchmark's model).
    ///
    /// # Safety
    /// `write` must write every element of the slice it is given before reading it.
    unsafe fn overwritten(&self, len: usize, write: &mut dyn FnMut(&mut [f32])) -> Vec<f32> {
        let mut v = self.zeros(len);
        write(&mut v);
        v
    }
}

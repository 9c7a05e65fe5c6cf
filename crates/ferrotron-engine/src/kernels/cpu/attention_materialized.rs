//! The materialised attention kernel the engine ran before its memory-efficient one: it writes
//! every head's T×T probabilities, which backward reads. Kept only as the tests' reference for
//! [`super::attention`].

use super::attention::{gemm_raw, on_bf16_gemm, product, product_path, HeadOperand};
use super::small_gemm::Causal;
use super::threads::SendPtr;
use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::simd::{self, simd_kernel};
use crate::kernels::AttnShape;
use ferrotron_core::precision::Products;

/// Row blocks `[r0, r1)` of a `t`-row causal score matrix: blocks of 64 rows, whose products skip
/// the blocks of keys past their last query; on the bf16 GEMM, which skips them tile by tile (and
/// packs each operand once per product), one block of all `t`.
fn row_blocks<T: Real>(products: Products, t: usize) -> impl Iterator<Item = (usize, usize)> {
    let block = if on_bf16_gemm::<T>(products) {
        t.max(1)
    } else {
        64
    };
    (0..t.div_ceil(block)).map(move |b| (b * block, ((b + 1) * block).min(t)))
}

simd_kernel! {
    /// Scaled, causally masked softmax of score row `i` in place over keys `first..=i`: entries
    /// outside become 0 (a sliding window starts at `first`; the products that follow multiply
    /// those zeros, so the row's probabilities and gradients are exactly the windowed ones).
    fn softmax_causal_row<T: Real>(row: &mut [T], first: usize, i: usize, scale: T) {
        row[..first].fill(T::ZERO);
        let visible = &mut row[first..=i];
        visible.iter_mut().for_each(|x| *x *= scale);
        let max = simd::max(visible);
        visible.iter_mut().for_each(|x| *x = (*x - max).exp());
        let inv = T::ONE / simd::sum(visible);
        visible.iter_mut().for_each(|x| *x *= inv);
        row[i + 1..].fill(T::ZERO);
    }
}

simd_kernel! {
    /// dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale over one row's visible part, in place of dP.
    fn softmax_backward_row<T: Real>(dp: &mut [T], p: &[T], scale: T) {
        let dot = simd::dot(dp, p);
        for (x, &p) in dp.iter_mut().zip(p) {
            *x = p * (*x - dot) * scale;
        }
    }
}

/// Every head's T×T probabilities.
pub(crate) fn probs_len(s: AttnShape) -> usize {
    s.batch * s.heads * s.seq * s.seq
}

fn check_lengths(s: AttnShape, q: usize, k: usize, v: usize, out: usize, probs: usize) {
    let rows = s.batch * s.seq;
    assert!(
        s.kv_heads > 0 && s.heads.is_multiple_of(s.kv_heads),
        "attention: heads not divisible by kv heads"
    );
    assert_eq!(q, rows * s.q_width(), "attention: q length");
    assert_eq!(k, rows * s.kv_width(), "attention: k length");
    assert_eq!(v, rows * s.kv_width(), "attention: v length");
    assert_eq!(out, rows * s.q_width(), "attention: output length");
    assert_eq!(probs, probs_len(s), "attention: probs length");
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: Real>(
    threads: &Threads,
    products: Products,
    s: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    probs: &mut [T],
) {
    check_lengths(s, q.len(), k.len(), v.len(), out.len(), probs.len());
    let (t, d, qw, kw) = (s.seq, s.head_dim, s.q_width(), s.kv_width());
    let scale = T::ONE / T::of(d as f64).sqrt();
    let (out_p, probs_p) = (SendPtr(out.as_mut_ptr()), SendPtr(probs.as_mut_ptr()));
    threads.for_tasks(s.batch * s.heads, |task| {
        let (b, h) = (task / s.heads, task % s.heads);
        let kvh = h / (s.heads / s.kv_heads);
        let (qo, ko) = (b * t * qw + h * d, b * t * kw + kvh * d);
        // SAFETY: each task owns head h of sequence b: its T×T block of `probs` and its column
        // block of `out`; lengths were checked above.
        let mut kt = HeadOperand::empty();
        kt.set(product_path::<T>(products), k, (ko, kw), (t, d), true);
        unsafe {
            let p = probs_p.get().add(task * t * t);
            // Row block [r0, r1) attends to keys [0, r1): the masked upper triangle is skipped.
            for (r0, r1) in row_blocks::<T>(products, t) {
                let (m, pb) = (r1 - r0, p.add(r0 * t));
                // S = Q·Kᵀ, then softmax, then O = P·V
                product(
                    (m, r1, d),
                    (q.as_ptr().add(qo + r0 * qw), qw, 1),
                    kt.at(0, 0),
                    (pb, t, 1),
                    false,
                    Causal::Columns(r0),
                    products == Products::Bf16,
                );
                for (i, row) in std::slice::from_raw_parts_mut(pb, m * t)
                    .chunks_exact_mut(t)
                    .enumerate()
                {
                    softmax_causal_row(row, s.first_key(r0 + i), r0 + i, scale);
                }
                gemm_raw(
                    (m, d, r1),
                    (pb, t, 1),
                    (v.as_ptr().add(ko), kw, 1),
                    (out_p.get().add(qo + r0 * qw), qw, 1),
                    false,
                    Causal::DepthUpTo(r0),
                    products == Products::Bf16,
                );
            }
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Real>(
    threads: &Threads,
    products: Products,
    s: AttnShape,
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    probs: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    check_lengths(s, q.len(), k.len(), v.len(), dout.len(), probs.len());
    assert!(
        dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "attention: gradient lengths"
    );
    let (t, d, qw, kw) = (s.seq, s.head_dim, s.q_width(), s.kv_width());
    let group = s.heads / s.kv_heads;
    let scale = T::ONE / T::of(d as f64).sqrt();
    let (dq_p, dk_p, dv_p) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    // One task per (sequence, KV head): the query heads that share a KV head accumulate into its
    // dK/dV one after another, so no two tasks write the same element.
    // dS, a head's T×T scratch, is written where it is read (each row up to the block's last key).
    let scratch = || vec![T::ZERO; t * t];
    threads.for_tasks_with(s.batch * s.kv_heads, scratch, |ds, task| {
        let (b, kvh) = (task / s.kv_heads, task % s.kv_heads);
        let ko = b * t * kw + kvh * d;
        let mut vt = HeadOperand::empty();
        vt.set(product_path::<T>(products), v, (ko, kw), (t, d), true);
        // The first block writes dK and dV at its keys; with several blocks, later ones reach
        // keys it did not: those start from zero.
        let one_block = row_blocks::<T>(products, t).nth(1).is_none();
        if !one_block {
            for r in 0..t {
                // SAFETY: row r of this task's head of dK and dV, inside them (checked above).
                unsafe {
                    std::slice::from_raw_parts_mut(dk_p.get().add(ko + r * kw), d).fill(T::ZERO);
                    std::slice::from_raw_parts_mut(dv_p.get().add(ko + r * kw), d).fill(T::ZERO);
                }
            }
        }
        for j in 0..group {
            let h = kvh * group + j;
            let qo = b * t * qw + h * d;
            let p = &probs[(b * s.heads + h) * t * t..][..t * t];
            for (bi, (r0, r1)) in row_blocks::<T>(products, t).enumerate() {
                let (m, first) = (r1 - r0, j == 0 && bi == 0 && one_block);
                let (dsb, pb) = (&mut ds[r0 * t..r1 * t], &p[r0 * t..r1 * t]);
                let (dor, qr) = (dout[qo + r0 * qw..].as_ptr(), q[qo + r0 * qw..].as_ptr());
                // SAFETY: bounds checked above; this task alone writes dq's head h and the kvh
                // blocks of dk and dv for sequence b. Rows [r0, r1) involve keys [0, r1) only.
                unsafe {
                    // dP = dO·Vᵀ ;  dV += Pᵀ·dO
                    product(
                        (m, r1, d),
                        (dor, qw, 1),
                        vt.at(0, 0),
                        (dsb.as_mut_ptr(), t, 1),
                        false,
                        Causal::Columns(r0),
                        products == Products::Bf16,
                    );
                    gemm_raw(
                        (r1, d, m),
                        (pb.as_ptr(), 1, t),
                        (dor, qw, 1),
                        (dv_p.get().add(ko), kw, 1),
                        !first,
                        Causal::DepthFrom(r0),
                        products == Products::Bf16,
                    );
                }
                // dS = P ⊙ (dP − rowsum(P ⊙ dP)), times the score scale; zero past the diagonal.
                for (i, (dsr, pr)) in dsb.chunks_exact_mut(t).zip(pb.chunks_exact(t)).enumerate() {
                    let last = r0 + i;
                    softmax_backward_row(&mut dsr[..=last], &pr[..=last], scale);
                    dsr[last + 1..r1].fill(T::ZERO);
                }
                unsafe {
                    // dQ = dS·K ;  dK += dSᵀ·Q
                    gemm_raw(
                        (m, d, r1),
                        (dsb.as_ptr(), t, 1),
                        (k.as_ptr().add(ko), kw, 1),
                        (dq_p.get().add(qo + r0 * qw), qw, 1),
                        false,
                        Causal::DepthUpTo(r0),
                        products == Products::Bf16,
                    );
                    gemm_raw(
                        (r1, d, m),
                        (dsb.as_ptr(), 1, t),
                        (qr, qw, 1),
                        (dk_p.get().add(ko), kw, 1),
                        !first,
                        Causal::DepthFrom(r0),
                        products == Products::Bf16,
                    );
                }
            }
        }
    });
}

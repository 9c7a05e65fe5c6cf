//! Causal softmax attention with grouped-query heads. Q, K, V are token-major (`[tokens, heads·d]`);
//! each head is read in place through strides, so no transposes are materialised.

use super::cpu::SendPtr;
use super::float::Real;
use super::{simd, AttnShape, CpuBackend};

/// `c (+)= a·b` on raw pointers with (row, column) strides. Callers guarantee bounds and that
/// concurrent tasks write disjoint elements.
unsafe fn gemm_raw<T: Real>(
    (m, n, k): (usize, usize, usize),
    a: (*const T, usize, usize),
    b: (*const T, usize, usize),
    c: (*mut T, usize, usize),
    accumulate: bool,
) {
    gemm::gemm(
        m,
        n,
        k,
        c.0,
        c.2 as isize,
        c.1 as isize,
        accumulate,
        a.0,
        a.2 as isize,
        a.1 as isize,
        b.0,
        b.2 as isize,
        b.1 as isize,
        T::ONE,
        T::ONE,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// Scaled, causally masked softmax of score row `i` in place: entries past `i` become 0.
fn softmax_causal_row<T: Real>(row: &mut [T], i: usize, scale: T) {
    let visible = &mut row[..=i];
    simd::vectorized(|| {
        let mut max = T::NEG_INFINITY;
        for x in visible.iter_mut() {
            *x *= scale;
            max = max.max(*x);
        }
        let mut sum = T::ZERO;
        for x in visible.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = T::ONE / sum;
        visible.iter_mut().for_each(|x| *x *= inv);
    });
    row[i + 1..].fill(T::ZERO);
}

fn check_lengths(s: AttnShape, q: usize, k: usize, v: usize, out: usize, probs: usize) {
    let rows = s.batch * s.seq;
    assert!(
        s.kv_heads > 0 && s.heads % s.kv_heads == 0,
        "attention: heads not divisible by kv heads"
    );
    assert_eq!(q, rows * s.q_width(), "attention: q length");
    assert_eq!(k, rows * s.kv_width(), "attention: k length");
    assert_eq!(v, rows * s.kv_width(), "attention: v length");
    assert_eq!(out, rows * s.q_width(), "attention: output length");
    assert_eq!(probs, s.probs_len(), "attention: probs length");
}

pub(crate) fn forward<T: Real>(
    be: &CpuBackend,
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
    be.for_tasks(s.batch * s.heads, |task| {
        let (b, h) = (task / s.heads, task % s.heads);
        let kvh = h / (s.heads / s.kv_heads);
        let (qo, ko) = (b * t * qw + h * d, b * t * kw + kvh * d);
        // SAFETY: each task owns head h of sequence b: its T×T block of `probs` and its column
        // block of `out`; lengths were checked above.
        unsafe {
            let p = probs_p.get().add(task * t * t);
            // S = Q·Kᵀ, then softmax, then O = P·V
            gemm_raw(
                (t, t, d),
                (q.as_ptr().add(qo), qw, 1),
                (k.as_ptr().add(ko), 1, kw),
                (p, t, 1),
                false,
            );
            for (i, row) in std::slice::from_raw_parts_mut(p, t * t)
                .chunks_exact_mut(t)
                .enumerate()
            {
                softmax_causal_row(row, i, scale);
            }
            gemm_raw(
                (t, d, t),
                (p, t, 1),
                (v.as_ptr().add(ko), kw, 1),
                (out_p.get().add(qo), qw, 1),
                false,
            );
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Real>(
    be: &CpuBackend,
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
    be.for_tasks(s.batch * s.kv_heads, |task| {
        let (b, kvh) = (task / s.kv_heads, task % s.kv_heads);
        let ko = b * t * kw + kvh * d;
        let mut ds = vec![T::ZERO; t * t];
        for j in 0..group {
            let h = kvh * group + j;
            let qo = b * t * qw + h * d;
            let p = &probs[(b * s.heads + h) * t * t..][..t * t];
            // SAFETY: bounds checked above; this task alone writes dq's head h and the kvh blocks
            // of dk and dv for sequence b.
            unsafe {
                // dP = dO·Vᵀ ;  dV += Pᵀ·dO
                gemm_raw(
                    (t, t, d),
                    (dout.as_ptr().add(qo), qw, 1),
                    (v.as_ptr().add(ko), 1, kw),
                    (ds.as_mut_ptr(), t, 1),
                    false,
                );
                gemm_raw(
                    (t, d, t),
                    (p.as_ptr(), 1, t),
                    (dout.as_ptr().add(qo), qw, 1),
                    (dv_p.get().add(ko), kw, 1),
                    j > 0,
                );
            }
            // dS = P ⊙ (dP − rowsum(P ⊙ dP)), times the score scale
            for (i, (dsr, pr)) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
                let dot: T = dsr[..=i].iter().zip(&pr[..=i]).map(|(&a, &b)| a * b).sum();
                for (x, &pv) in dsr[..=i].iter_mut().zip(&pr[..=i]) {
                    *x = pv * (*x - dot) * scale;
                }
                dsr[i + 1..].fill(T::ZERO);
            }
            unsafe {
                // dQ = dS·K ;  dK += dSᵀ·Q
                gemm_raw(
                    (t, d, t),
                    (ds.as_ptr(), t, 1),
                    (k.as_ptr().add(ko), kw, 1),
                    (dq_p.get().add(qo), qw, 1),
                    false,
                );
                gemm_raw(
                    (t, d, t),
                    (ds.as_ptr(), 1, t),
                    (q.as_ptr().add(qo), qw, 1),
                    (dk_p.get().add(ko), kw, 1),
                    j > 0,
                );
            }
        }
    });
}

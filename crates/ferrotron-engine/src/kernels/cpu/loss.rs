//! Softmax cross-entropy fused with its gradient, row by row.

use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::simd::{self, simd_kernel};
use rayon::prelude::*;

simd_kernel! {
    fn row_loss_and_grad<T: Real>(row: &mut [T], target: Option<u32>, scale: T) -> f64 {
        let Some(target) = target else {
            row.fill(T::ZERO);
            return 0.0;
        };
        let target = target as usize;
        let target_logit = row[target];
        let max = simd::max(row);
        let sum = exp_shifted_sum(row, max);
        let shifted_target = (target_logit - max).to_f64();
        // loss = logsumexp − logit[target] = ln Σexp(x − max) − (logit[target] − max)
        let loss = sum.ln() - shifted_target;
        let inv_scale = T::of(1.0 / sum) * scale;
        row.iter_mut().for_each(|x| *x *= inv_scale);
        row[target] -= scale;
        loss
    }
}

/// Replaces `row` by exp(row − max) and returns its sum: lane sums over short blocks, the blocks summed
/// in f64, accurate for long vocabularies.
#[inline(always)]
fn exp_shifted_sum<T: Real>(row: &mut [T], max: T) -> f64 {
    row.iter_mut().for_each(|x| *x = (*x - max).exp());
    row.chunks(256).map(|b| simd::sum(b).to_f64()).sum::<f64>()
}

simd_kernel! {
    fn row_max<T: Real>(row: &[T]) -> T {
        simd::max(row)
    }
}

simd_kernel! {
    fn row_exp_sum<T: Real>(row: &mut [T], max: T) -> f64 {
        exp_shifted_sum(row, max)
    }
}

simd_kernel! {
    fn row_scale<T: Real>(row: &mut [T], by: T) {
        row.iter_mut().for_each(|x| *x *= by);
    }
}

pub(crate) fn cross_entropy<T: Real>(
    threads: &Threads,
    logits: &mut [T],
    vocab: usize,
    targets: &[Option<u32>],
    scale: T,
) -> f64 {
    assert_eq!(
        logits.len(),
        vocab * targets.len(),
        "cross_entropy: logits length"
    );
    assert!(
        targets.iter().flatten().all(|&t| (t as usize) < vocab),
        "cross_entropy: target beyond vocab"
    );
    let losses: Vec<f64> = if threads.count() > 1 {
        logits
            .par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .map(|(row, &t)| row_loss_and_grad(row, t, scale))
            .collect()
    } else {
        logits
            .chunks_mut(vocab)
            .zip(targets)
            .map(|(row, &t)| row_loss_and_grad(row, t, scale))
            .collect()
    };
    // A fixed summation order: the same loss on every run and every thread count.
    losses.iter().sum()
}

/// The target's column in a shard holding ids `start..start + valid`, if it holds it.
fn local_target(target: u32, start: u32, valid: usize) -> Option<usize> {
    let t = target.checked_sub(start)? as usize;
    (t < valid).then_some(t)
}

/// Runs `f(row, i)` over the rows of `buf`, in parallel when the backend may.
fn each_row<T: Real>(
    threads: &Threads,
    buf: &mut [T],
    width: usize,
    f: impl Fn(&mut [T], usize) + Sync + Send,
) {
    if threads.count() > 1 {
        buf.par_chunks_mut(width)
            .enumerate()
            .for_each(|(i, r)| f(r, i));
    } else {
        buf.chunks_mut(width).enumerate().for_each(|(i, r)| f(r, i));
    }
}

pub(crate) fn shard_logit_max<T: Real>(
    threads: &Threads,
    logits: &[T],
    vocab: usize,
    valid: usize,
    max: &mut [T],
) {
    assert_eq!(
        logits.len(),
        vocab * max.len(),
        "shard_logit_max: logits length"
    );
    each_row(threads, max, 1, |m, i| {
        m[0] = row_max(&logits[i * vocab..][..valid])
    });
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn shard_exp_sums<T: Real>(
    threads: &Threads,
    logits: &mut [T],
    vocab: usize,
    valid: usize,
    start: u32,
    targets: &[Option<u32>],
    max: &[T],
    sums: &mut [f64],
) {
    assert_eq!(
        logits.len(),
        vocab * targets.len(),
        "shard_exp_sums: logits length"
    );
    assert_eq!(
        sums.len(),
        2 * targets.len(),
        "shard_exp_sums: two sums per row"
    );
    let rows: Vec<(&mut [T], &mut [f64])> =
        logits.chunks_mut(vocab).zip(sums.chunks_mut(2)).collect();
    let work = |(i, (row, s)): (usize, (&mut [T], &mut [f64]))| {
        let Some(target) = targets[i] else {
            s.fill(0.0);
            return;
        };
        let real = &mut row[..valid];
        let shifted_target =
            local_target(target, start, valid).map_or(0.0, |t| (real[t] - max[i]).to_f64());
        let sum = row_exp_sum(real, max[i]);
        s[0] = sum;
        s[1] = shifted_target;
    };
    if threads.count() > 1 {
        rows.into_par_iter().enumerate().for_each(work);
    } else {
        rows.into_iter().enumerate().for_each(work);
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn shard_softmax_grad<T: Real>(
    threads: &Threads,
    exp_logits: &mut [T],
    vocab: usize,
    valid: usize,
    start: u32,
    targets: &[Option<u32>],
    sums: &[f64],
    scale: T,
) {
    assert_eq!(
        exp_logits.len(),
        vocab * targets.len(),
        "shard_softmax_grad: logits length"
    );
    each_row(threads, exp_logits, vocab, |row, i| {
        let Some(target) = targets[i] else {
            row.fill(T::ZERO);
            return;
        };
        let inv_scale = T::of(1.0 / sums[2 * i]) * scale;
        row_scale(&mut row[..valid], inv_scale);
        row[valid..].fill(T::ZERO);
        if let Some(t) = local_target(target, start, valid) {
            row[t] -= scale;
        }
    });
}

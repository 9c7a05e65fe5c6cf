//! Softmax cross-entropy fused with its gradient, row by row.

use super::float::Real;
use super::{simd, CpuBackend};
use rayon::prelude::*;

fn row_loss_and_grad<T: Real>(row: &mut [T], target: Option<u32>, scale: T) -> f64 {
    let Some(target) = target else {
        row.fill(T::ZERO);
        return 0.0;
    };
    let target = target as usize;
    let target_logit = row[target];
    let (max, sum) = simd::vectorized(|| {
        let max = simd::max(row);
        row.iter_mut().for_each(|x| *x = (*x - max).exp());
        // Lane sums over short blocks, blocks summed in f64: accurate for long vocabularies.
        (
            max,
            row.chunks(256).map(|b| simd::sum(b).to_f64()).sum::<f64>(),
        )
    });
    let shifted_target = (target_logit - max).to_f64();
    // loss = logsumexp − logit[target] = ln Σexp(x − max) − (logit[target] − max)
    let loss = sum.ln() - shifted_target;
    let inv_scale = T::of(1.0 / sum) * scale;
    simd::vectorized(|| row.iter_mut().for_each(|x| *x *= inv_scale));
    row[target] -= scale;
    loss
}

pub(crate) fn cross_entropy<T: Real>(
    be: &CpuBackend,
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
    let losses: Vec<f64> = if be.threads > 1 {
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

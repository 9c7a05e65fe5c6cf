//! Softmax cross-entropy fused with its gradient, row by row.

use super::{simd, CpuBackend};
use rayon::prelude::*;

fn row_loss_and_grad(row: &mut [f32], target: Option<u32>, scale: f32) -> f64 {
    let Some(target) = target else {
        row.fill(0.0);
        return 0.0;
    };
    let target = target as usize;
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let shifted_target = (row[target] - max) as f64;
    // Eight partial sums vectorise; the f64 total keeps the 8k-term sum accurate.
    let sum = simd::vectorized(|| {
        let mut partial = [0f32; 8];
        for chunk in row.chunks_mut(8) {
            for (x, p) in chunk.iter_mut().zip(partial.iter_mut()) {
                *x = simd::exp(*x - max);
                *p += *x;
            }
        }
        partial.iter().map(|&p| p as f64).sum::<f64>()
    });
    // loss = logsumexp − logit[target] = ln Σexp(x − max) − (logit[target] − max)
    let loss = sum.ln() - shifted_target;
    let inv = (1.0 / sum) as f32;
    let inv_scale = inv * scale;
    simd::vectorized(|| row.iter_mut().for_each(|x| *x *= inv_scale));
    row[target] -= scale;
    loss
}

impl CpuBackend {
    pub(crate) fn cross_entropy_impl(
        &self,
        logits: &mut [f32],
        vocab: usize,
        targets: &[Option<u32>],
        scale: f32,
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
        let losses: Vec<f64> = if self.threads > 1 {
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
}

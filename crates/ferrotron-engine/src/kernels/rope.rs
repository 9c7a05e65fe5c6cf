//! Rotary position embedding in Hugging Face's `rotate_half` convention: dimension i pairs with i + d/2.

use super::float::Real;
use super::simd::simd_kernel;
use super::CpuBackend;

/// cos/sin of every (position, frequency) pair, computed once per model.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub head_dim: usize,
    cos: Vec<f64>,
    sin: Vec<f64>,
}

impl RopeTable {
    pub fn new(head_dim: usize, max_positions: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        // As transformers does it: inverse frequencies and angles rounded to f32, then cos/sin.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        let (mut cos, mut sin) = (
            Vec::with_capacity(max_positions * half),
            Vec::with_capacity(max_positions * half),
        );
        for p in 0..max_positions {
            for &f in &inv_freq {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32 as f64);
                sin.push(angle.sin() as f32 as f64);
            }
        }
        Self { head_dim, cos, sin }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2).max(1)
    }
}

simd_kernel! {
    /// Rotates every head of every row of `x` in place; `inverse` rotates by the opposite angle, which is
    /// the backward of the rotation.
    pub(crate) fn rotate<T: Real>(
        be: &CpuBackend,
        table: &RopeTable,
        positions: &[u32],
        heads: usize,
        x: &mut [T],
        inverse: bool,
    ) {
        assert!(
            positions
                .iter()
                .all(|&p| (p as usize) < table.max_positions()),
            "rope: position beyond the table"
        );
        let (d, half) = (table.head_dim, table.head_dim / 2);
        let sign = if inverse { -T::ONE } else { T::ONE };
        be.for_rows(x, heads * d, |t, row| {
            let p = positions[t] as usize;
            let (c, s) = (
                &table.cos[p * half..(p + 1) * half],
                &table.sin[p * half..(p + 1) * half],
            );
            for head in row.chunks_exact_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2, ci, si) = (a[i], b[i], T::of(c[i]), sign * T::of(s[i]));
                    a[i] = x1 * ci - x2 * si;
                    b[i] = x2 * ci + x1 * si;
                }
            }
        });
    }
}

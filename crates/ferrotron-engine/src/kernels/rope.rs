//! Rotary position embedding in Hugging Face's `rotate_half` convention: dimension i pairs with i + d/2.

use super::CpuBackend;

/// cos/sin of every (position, frequency) pair, computed once per model.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub head_dim: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
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
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { head_dim, cos, sin }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2).max(1)
    }

    fn rotate(&self, positions: &[u32], heads: usize, x: &mut [f32], sign: f32, be: &CpuBackend) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        be.for_rows(x, heads * d, |t, row| {
            let p = positions[t] as usize;
            let (c, s) = (
                &self.cos[p * half..(p + 1) * half],
                &self.sin[p * half..(p + 1) * half],
            );
            for head in row.chunks_exact_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2, si) = (a[i], b[i], sign * s[i]);
                    a[i] = x1 * c[i] - x2 * si;
                    b[i] = x2 * c[i] + x1 * si;
                }
            }
        });
    }
}

impl CpuBackend {
    pub(crate) fn rope_impl(
        &self,
        table: &RopeTable,
        positions: &[u32],
        heads: usize,
        x: &mut [f32],
        inverse: bool,
    ) {
        assert!(
            positions
                .iter()
                .all(|&p| (p as usize) < table.max_positions()),
            "rope: position beyond the table"
        );
        // The backward of a rotation is the rotation by the opposite angle.
        table.rotate(positions, heads, x, if inverse { -1.0 } else { 1.0 }, self);
    }
}

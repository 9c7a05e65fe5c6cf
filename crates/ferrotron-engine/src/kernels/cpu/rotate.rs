//! The rotary embedding applied: every head of every row rotated by its position's angles.

use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::simd::simd_kernel;
use crate::kernels::RopeTable;

simd_kernel! {
    /// Rotates every head of every row of `x` in place; `inverse` rotates by the opposite angle, which is
    /// the backward of the rotation.
    pub(crate) fn rotate<T: Real>(
        threads: &Threads,
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
        threads.for_rows(x, heads * d, |t, row| {
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

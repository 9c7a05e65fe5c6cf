//! The AVX-512 kernel of the attention products: each 4 × 64 tile of `c` lives in 16 registers for
//! the whole depth, fed by one row of `b` and four broadcast elements of `a` per step.

use super::Causal;

/// [`super::gemm_f32`] with 4 × 64 tiles of `c` in 16 registers, fed by one row of `b` (read in
/// place) and four broadcast elements of `a` per step.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    const MR: usize = 4;
    const NC: usize = 4 * LANES;
    let mut i0 = 0;
    while i0 < m {
        let rows = (m - i0).min(MR);
        // The part of the product this row tile needs (the rest is masked or multiplies zeros).
        let (n, depth) = mask.needed(i0, MR, n, k);
        let mut j0 = 0;
        while j0 < n {
            let cols = (n - j0).min(NC);
            let tile = Tile {
                k: depth.len(),
                a: (a.0.add(i0 * a.1 + depth.start * a.2), a.1, a.2),
                b: (b.0.add(depth.start * b.1 + j0), b.1),
                c: (c.0.add(i0 * c.1 + j0), c.1),
                cols,
                accumulate,
            };
            match (rows, cols.div_ceil(LANES)) {
                (4, 4) => tile.run::<4, 4>(),
                (4, 3) => tile.run::<4, 3>(),
                (4, 2) => tile.run::<4, 2>(),
                (4, 1) => tile.run::<4, 1>(),
                (3, 4) => tile.run::<3, 4>(),
                (3, 3) => tile.run::<3, 3>(),
                (3, 2) => tile.run::<3, 2>(),
                (3, 1) => tile.run::<3, 1>(),
                (2, 4) => tile.run::<2, 4>(),
                (2, 3) => tile.run::<2, 3>(),
                (2, 2) => tile.run::<2, 2>(),
                (2, 1) => tile.run::<2, 1>(),
                (1, 4) => tile.run::<1, 4>(),
                (1, 3) => tile.run::<1, 3>(),
                (1, 2) => tile.run::<1, 2>(),
                _ => tile.run::<1, 1>(),
            }
            j0 += NC;
        }
        i0 += MR;
    }
}

const LANES: usize = 16;

/// One block of at most 4 rows × 64 columns of `c`.
struct Tile {
    k: usize,
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    cols: usize,
    accumulate: bool,
}

impl Tile {
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const R: usize, const V: usize>(&self) {
        use std::arch::x86_64::*;
        // Lanes past `cols` in the last vector are masked off: never read, never written.
        let masks: [__mmask16; V] = std::array::from_fn(|v| {
            let live = self.cols.saturating_sub(v * LANES).min(LANES);
            ((1u32 << live) - 1) as __mmask16
        });
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for p in 0..self.k {
            let brow = self.b.0.add(p * self.b.1);
            let bv: [__m512; V] =
                std::array::from_fn(|v| _mm512_maskz_loadu_ps(masks[v], brow.add(v * LANES)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*self.a.0.add(r * self.a.1 + p * self.a.2));
                for v in 0..V {
                    acc[v] = _mm512_fmadd_ps(av, bv[v], acc[v]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let crow = self.c.0.add(r * self.c.1);
            for v in 0..V {
                let dst = crow.add(v * LANES);
                let sum = if self.accumulate {
                    _mm512_add_ps(acc[v], _mm512_maskz_loadu_ps(masks[v], dst))
                } else {
                    acc[v]
                };
                _mm512_mask_storeu_ps(dst, masks[v], sum);
            }
        }
    }
}

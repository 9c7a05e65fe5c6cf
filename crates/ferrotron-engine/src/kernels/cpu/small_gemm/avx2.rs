//! The AVX2+FMA kernel of the attention products. With 16 vector registers a tile of `c` is 6 rows
//! × 16 columns (12 accumulators, two vectors of `b` and a broadcast of `a`): reading a 16-column
//! strip of `b` in place would walk rows 2–16 KiB apart, which alias in L1 and miss; so `b` is
//! packed once per product into 16-column panels, each row of a panel 64 contiguous bytes, zero
//! beyond `n` (or once for many products: [`super::Packed`]). `a` is read in place through its
//! strides (six rows stay in L1 across panels).

use super::Causal;
use std::arch::x86_64::*;
use std::cell::RefCell;

const LANES: usize = 8;
/// Rows of a tile of `c`.
const MR: usize = 6;
/// Columns of a tile of `c` (and of a panel of `b`).
const NR: usize = 2 * LANES;

thread_local! {
    /// The packed panels of `b`, kept per thread so that a product allocates nothing once warm.
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// [`super::gemm_f32`] on AVX2+FMA: `b` packed into this thread's panels, then
/// [`gemm_panels`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    if m == 0 || n == 0 {
        return;
    }
    PANELS.with(|panels| {
        let mut panels = panels.borrow_mut();
        pack(&mut panels, (k, n), (b.0, b.1, 1));
        gemm_panels((m, n, k), a, (panels.as_ptr(), k * NR), c, accumulate, mask);
    });
}

/// `c (+)= a·b` with `b` already packed by [`pack`]: `b.0` at the product's first row and first
/// panel, `b.1` elements from one panel to the next.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm_panels(
    (m, n, k): (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    let mut i0 = 0;
    while i0 < m {
        let rows = (m - i0).min(MR);
        let (n, depth) = mask.needed(i0, MR, n, k);
        let a_tile = (a.0.add(i0 * a.1 + depth.start * a.2), a.1, a.2);
        let mut j0 = 0;
        while j0 < n {
            let tile = Tile {
                k: depth.len(),
                a: a_tile,
                b: b.0.add(j0 / NR * b.1 + depth.start * NR),
                c: (c.0.add(i0 * c.1 + j0), c.1),
                cols: (n - j0).min(NR),
                accumulate,
            };
            match rows {
                6 => tile.run::<6>(),
                5 => tile.run::<5>(),
                4 => tile.run::<4>(),
                3 => tile.run::<3>(),
                2 => tile.run::<2>(),
                _ => tile.run::<1>(),
            }
            j0 += NR;
        }
        i0 += MR;
    }
}

/// The columns of a panel.
pub(super) const PANEL: usize = NR;

/// `b[k×n]` (element `(p, j)` at `b.0 + p·b.1 + j·b.2`) into `panels`: panel `j` holds columns
/// `[16j, 16j + 16)`, row by row, zeros past `n`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pack(
    panels: &mut Vec<f32>,
    (k, n): (usize, usize),
    b: (*const f32, usize, usize),
) {
    let count = n.div_ceil(NR);
    if panels.len() < count * k * NR {
        panels.resize(count * k * NR, 0.0);
    }
    for j in 0..count {
        let (j0, cols) = (j * NR, (n - j * NR).min(NR));
        let panel = &mut panels[j * k * NR..(j + 1) * k * NR];
        if b.2 != 1 {
            // Columns apart (a transposed view): each column's elements down the panel, the
            // source read along its contiguous rows where it has them.
            for col in 0..NR {
                for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
                    row[col] = if col < cols {
                        *b.0.add(p * b.1 + (j0 + col) * b.2)
                    } else {
                        0.0
                    };
                }
            }
            continue;
        }
        for (p, row) in panel.chunks_exact_mut(NR).enumerate() {
            let src = b.0.add(p * b.1 + j0);
            if cols == NR {
                // Two vectors, inline: a call to `memcpy` per 64 bytes costs more than the copy.
                let dst = row.as_mut_ptr();
                _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
                _mm256_storeu_ps(dst.add(LANES), _mm256_loadu_ps(src.add(LANES)));
            } else {
                row[..cols].copy_from_slice(std::slice::from_raw_parts(src, cols));
                row[cols..].fill(0.0);
            }
        }
    }
}

/// One tile of at most 6 rows × 16 columns of `c`.
struct Tile {
    k: usize,
    a: (*const f32, usize, usize),
    /// The tile's panel of `b`, from its first row of depth.
    b: *const f32,
    c: (*mut f32, usize),
    cols: usize,
    accumulate: bool,
}

impl Tile {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run<const R: usize>(&self) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let rows: [*const f32; R] = std::array::from_fn(|r| self.a.0.add(r * self.a.1));
        let mut bp = self.b;
        for p in 0..self.k {
            let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(LANES)));
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let av = _mm256_broadcast_ss(&*row.add(p * self.a.2));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
            bp = bp.add(NR);
        }
        if self.cols == NR {
            for (r, acc) in acc.iter().enumerate() {
                let dst = self.c.0.add(r * self.c.1);
                for (v, &x) in acc.iter().enumerate() {
                    let at = dst.add(v * LANES);
                    let sum = if self.accumulate {
                        _mm256_add_ps(x, _mm256_loadu_ps(at))
                    } else {
                        x
                    };
                    _mm256_storeu_ps(at, sum);
                }
            }
            return;
        }
        // A last, narrower panel: through a row buffer, writing only the live columns.
        for (r, acc) in acc.iter().enumerate() {
            let mut row = [0f32; NR];
            _mm256_storeu_ps(row.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(row.as_mut_ptr().add(LANES), acc[1]);
            let dst = std::slice::from_raw_parts_mut(self.c.0.add(r * self.c.1), self.cols);
            for (d, &x) in dst.iter_mut().zip(&row) {
                *d = if self.accumulate { *d + x } else { x };
            }
        }
    }
}

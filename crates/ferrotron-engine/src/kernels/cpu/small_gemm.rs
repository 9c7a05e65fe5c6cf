//! The per-head products of attention in f32 with AVX-512: `c (+)= a·b` where `b` and `c` have
//! contiguous rows. These are small (64 × 64 × ≤ seq) and many (every row block of every head), the
//! size at which a general GEMM spends more time packing and dispatching than multiplying; here each
//! 4 × 64 tile of `c` lives in 16 registers for the whole depth, fed by one row of `b` and four
//! broadcast elements of `a` per step.

/// Whether [`gemm_f32`] may be called on this CPU.
#[cfg(target_arch = "x86_64")]
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// `c[m×n] (+)= a[m×k]·b[k×n]`. `a` is read element by element through (row, column) strides, so a
/// transposed view is free; `b` and `c` rows are contiguous with row strides `b_rs` and `c_rs`. Each
/// element of `c` is one fused multiply-add chain over `k` in order, so results do not depend on how
/// the work is cut. `mask` skips work in row tiles of 4; columns it skips are left as they were.
///
/// # Safety
/// [`available`] must be true, and every element the views name must lie inside its allocation, with
/// `c` not overlapping `a` or `b`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_f32(
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
        let (n, depth) = match mask {
            Causal::None => (n, 0..k),
            Causal::Columns(diag) => ((i0 + MR + diag).min(n), 0..k),
            Causal::DepthUpTo(diag) => (n, 0..(i0 + MR + diag).min(k)),
            Causal::DepthFrom(diag) => (n, i0.saturating_sub(diag).min(k)..k),
        };
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

#[cfg(target_arch = "x86_64")]
const LANES: usize = 16;

/// Where a causal mask makes part of a product unnecessary, for row `i` of `c`. Skipped depth
/// multiplies exact zeros, so skipping it changes no result; skipped columns are ones the caller
/// masks afterwards.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Causal {
    /// Everything is computed (no mask; the tests' reference).
    None,
    /// Only columns `j ≤ i + diag` are needed (scores, and their gradient, of queries `diag + i`).
    Columns(usize),
    /// Depth `p > i + diag` multiplies zeros (probabilities of queries `diag + i` past the diagonal).
    DepthUpTo(usize),
    /// Depth `p < i − diag` multiplies zeros (row `i` is key `i`; depth `p` is query `diag + p`).
    DepthFrom(usize),
}

/// One block of at most 4 rows × 64 columns of `c`.
#[cfg(target_arch = "x86_64")]
struct Tile {
    k: usize,
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    cols: usize,
    accumulate: bool,
}

#[cfg(target_arch = "x86_64")]
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::Causal;
    use rand::{Rng, SeedableRng};

    /// Odd sizes, tails in both directions, transposed and strided `a`, overwrite and accumulate,
    /// against an f64 product.
    #[test]
    fn matches_a_plain_product() {
        if !super::available() {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (3, 17, 5),
            (4, 64, 64),
            (9, 70, 33),
            (64, 256, 64),
            (7, 129, 1),
        ] {
            for transposed in [false, true] {
                for accumulate in [false, true] {
                    let (a_rs, a_cs) = if transposed { (1, m + 3) } else { (k + 2, 1) };
                    let a: Vec<f32> = (0..(m + 3) * (k + 2))
                        .map(|_| rng.gen_range(-1.0..1.0))
                        .collect();
                    let (b_rs, c_rs) = (n + 5, n + 1);
                    let b: Vec<f32> = (0..k * b_rs).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let c0: Vec<f32> = (0..m * c_rs).map(|_| rng.gen_range(-1.0..1.0)).collect();
                    let mut c = c0.clone();
                    unsafe {
                        super::gemm_f32(
                            (m, n, k),
                            (a.as_ptr(), a_rs, a_cs),
                            (b.as_ptr(), b_rs),
                            (c.as_mut_ptr(), c_rs),
                            accumulate,
                            Causal::None,
                        )
                    };
                    for i in 0..m {
                        for j in 0..c_rs {
                            let got = c[i * c_rs + j] as f64;
                            if j >= n {
                                assert_eq!(got, c0[i * c_rs + j] as f64, "wrote past column {n}");
                                continue;
                            }
                            let mut want = if accumulate {
                                c0[i * c_rs + j] as f64
                            } else {
                                0.0
                            };
                            for p in 0..k {
                                want += a[i * a_rs + p * a_cs] as f64 * b[p * b_rs + j] as f64;
                            }
                            let tol = 1e-6 * (k as f64).sqrt().max(1.0) * 4.0;
                            assert!(
                                (got - want).abs() <= tol,
                                "{m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A causal mask gives the same numbers as the full product wherever the skipped work multiplies
    /// zeros, and leaves skipped columns alone.
    #[test]
    fn causal_masks_skip_only_zeros() {
        if !super::available() {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let (m, n, k, diag) = (13, 40, 40, 21);
        let rand = |rng: &mut rand_chacha::ChaCha8Rng, len| -> Vec<f32> {
            (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
        };
        let run = |a: &[f32], (a_rs, a_cs), b: &[f32], mask| {
            let mut c = vec![7.0f32; m * n];
            unsafe {
                super::gemm_f32(
                    (m, n, k),
                    (a.as_ptr(), a_rs, a_cs),
                    (b.as_ptr(), n),
                    (c.as_mut_ptr(), n),
                    false,
                    mask,
                )
            };
            c
        };
        let b = rand(&mut rng, k * n);
        // Depth up to the diagonal: a[i][p] = 0 for p > i + diag.
        let mut a = rand(&mut rng, m * k);
        (0..m).for_each(|i| {
            (0..k)
                .filter(|&p| p > i + diag)
                .for_each(|p| a[i * k + p] = 0.0)
        });
        assert_eq!(
            run(&a, (k, 1), &b, Causal::DepthUpTo(diag)),
            run(&a, (k, 1), &b, Causal::None)
        );
        // Depth from the diagonal: row i is key i, depth p is query diag' + p, zero where p < i − diag'.
        let d2 = 3;
        let mut a = rand(&mut rng, m * k);
        (0..m).for_each(|i| {
            (0..k)
                .filter(|&p| p + d2 < i)
                .for_each(|p| a[i * k + p] = 0.0)
        });
        assert_eq!(
            run(&a, (k, 1), &b, Causal::DepthFrom(d2)),
            run(&a, (k, 1), &b, Causal::None)
        );
        // Columns: every needed column equals the full product's; the rest keep their old value or
        // equal the full product (row tiles compute up to their last row's limit).
        let a = rand(&mut rng, m * k);
        let (full, part) = (
            run(&a, (k, 1), &b, Causal::None),
            run(&a, (k, 1), &b, Causal::Columns(5)),
        );
        for i in 0..m {
            for j in 0..n {
                let (f, p) = (full[i * n + j], part[i * n + j]);
                assert!(
                    if j <= i + 5 {
                        p == f
                    } else {
                        p == f || p == 7.0
                    },
                    "[{i},{j}]"
                );
            }
        }
    }
}

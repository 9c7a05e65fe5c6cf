//! The exponentials of attention's softmax rows: xᵢ ← 2^(scale·xᵢ − shift) over a row, and their
//! sum. After the products, the most frequent arithmetic of attention (one exponential per score in
//! the forward, one more in the backward).
//!
//! Written element by element, the compiler emits each vector's ~50-cycle chain of dependent steps
//! whole before the next vector's, and the CPU's window holds too few of them to keep its units
//! busy (measured: 3.1 cycles per element on a Zen core, where the instructions need about one).
//! The AVX2 and AVX-512 copies below run each step over four vectors before the next step (the
//! AVX-512 one issues half the instructions for the same elements). The portable copy computes the
//! same operations in the same order (its multiply-adds fused in software), so all give the same
//! bits, sum included: element `i` is added to lane `i % 16` of the sum in every copy.

use crate::kernels::float::{exp2_fused, Real};
use crate::kernels::simd;

/// Lanes of an AVX2 vector of f32.
const LANES: usize = 8;
/// Vectors in flight: enough independent chains for the fused multiply-adds' latency without
/// spilling registers (four × (f, n, p) and two sums of sixteen registers).
const VECTORS: usize = 4;
/// The sum's lanes: element `i` of a row is added to lane `i % SUMS` (two vectors of sums,
/// alternating), then the lanes are added in order.
const SUMS: usize = 2 * LANES;

/// xᵢ ← 2^(scale·xᵢ − shift) in place, returning Σ of the new xᵢ: a softmax row's exponentials
/// (scale and shift in units of log2(e)) and their sum in one pass. The scaled score is one fused
/// multiply-add; then [`exp2_fused`].
pub(super) fn affine_sum<T: Real>(xs: &mut [T], scale: T, shift: T) -> T {
    if let Some(xs) = T::as_f32_mut(xs) {
        let (scale, shift) = (scale.to_f64() as f32, shift.to_f64() as f32);
        return T::of(affine_sum_f32(xs, scale, shift) as f64);
    }
    // f64: the tests' references.
    xs.iter_mut().fold(T::ZERO, |sum, x| {
        *x = (*x * scale - shift).exp2_fused();
        sum + *x
    })
}

/// [`affine_sum`], the new values also rounded to bf16 into `rounded` (one per value, as the
/// AVX512_BF16 conversion rounds them: to nearest even): a softmax row and the left operand of its
/// product with V made in one pass. Only on a CPU with AVX512_BF16 (where that operand is packed).
pub(super) fn affine_sum_rounded<T: Real>(
    xs: &mut [T],
    scale: T,
    shift: T,
    rounded: &mut [u16],
) -> T {
    let xs = T::as_f32_mut(xs).expect("attention: bf16 operands are made from f32 values");
    assert_eq!(
        xs.len(),
        rounded.len(),
        "attention: a row and its rounded copy"
    );
    let (scale, shift) = (scale.to_f64() as f32, shift.to_f64() as f32);
    let mut sums = [0f32; SUMS];
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::bf16_gemm::available() {
        // SAFETY: the CPU has AVX-512 F, BW, VL and BF16 (what `available` checks).
        unsafe { avx512::affine_sums_rounded(xs, scale, shift, &mut sums, rounded) };
        return T::of(total(&sums) as f64);
    }
    panic!("attention: bf16 rounding asked for on a CPU without AVX512_BF16")
}

/// One row of attention's backward in one pass: `p[i] ← 2^(scale2·p[i] − lse2)` (the scores in,
/// the probabilities out, as [`affine_sum`] makes them) and `dp[i] ← p[i]·(dp[i] − delta)·scale`
/// (the probabilities' gradients in, the scores' out), each rounding as those two loops round, so
/// the same bits. On AVX-512 the second is done while the first's vectors are in registers.
pub(super) fn probabilities_and_gradients(
    p: &mut [f32],
    dp: &mut [f32],
    (scale2, lse2): (f32, f32),
    (delta, scale): (f32, f32),
) {
    assert_eq!(p.len(), dp.len(), "attention: a row's scores and gradients");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, checked just above.
        unsafe { avx512::probabilities_and_gradients(p, dp, (scale2, lse2), (delta, scale)) };
        return;
    }
    affine_sum_f32(p, scale2, lse2);
    for (x, &p) in dp.iter_mut().zip(p.iter()) {
        *x = p * (*x - delta) * scale;
    }
}

/// The largest of `xs` (−∞ if empty; NaNs passed over), as [`simd::max`] gives it: the maximum a
/// softmax row's exponentials are taken against. On AVX-512, in sixteen lanes of four registers.
pub(super) fn max<T: Real>(xs: &[T]) -> T {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        if let Some(xs) = T::as_f32(xs) {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return T::of(unsafe { avx512::max(xs) } as f64);
        }
    }
    simd::max(xs)
}

fn affine_sum_f32(xs: &mut [f32], scale: f32, shift: f32) -> f32 {
    let mut sums = [0f32; SUMS];
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F, checked just above.
        unsafe { avx512::affine_sums(xs, scale, shift, &mut sums) };
        return total(&sums);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::simd::has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA, checked just above.
        unsafe { avx2::affine_sums(xs, scale, shift, &mut sums) };
        return total(&sums);
    }
    portable_affine_sums(xs, scale, shift, &mut sums);
    total(&sums)
}

/// Whether the AVX-512 copy may run (cached by the standard library).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// The lanes of a row's sum added in order (every copy).
fn total(sums: &[f32; SUMS]) -> f32 {
    sums.iter().fold(0.0, |s, &x| s + x)
}

/// The portable copy: element by element, the same operations as the AVX2 copy.
fn portable_affine_sums(xs: &mut [f32], scale: f32, shift: f32, sums: &mut [f32; SUMS]) {
    for (i, x) in xs.iter_mut().enumerate() {
        *x = exp2_fused(f32::mul_add(*x, scale, -shift));
        sums[i % SUMS] += *x;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{LANES, SUMS, VECTORS};
    use crate::kernels::float::{EXP2_POLY, EXP2_RANGE, EXP2_ROUND};
    use std::arch::x86_64::*;

    /// [`super::portable_affine_sums`] on AVX2+FMA: blocks of four vectors, each step over all four
    /// before the next; then single vectors, and the last partial one through a padded copy.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn affine_sums(
        xs: &mut [f32],
        scale: f32,
        shift: f32,
        sums: &mut [f32; SUMS],
    ) {
        let (scale, neg_shift) = (_mm256_set1_ps(scale), _mm256_set1_ps(-shift));
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut blocks = xs.chunks_exact_mut(VECTORS * LANES);
        for block in &mut blocks {
            let at = block.as_mut_ptr();
            let x: [__m256; VECTORS] = std::array::from_fn(|v| {
                _mm256_fmadd_ps(_mm256_loadu_ps(at.add(v * LANES)), scale, neg_shift)
            });
            let y = exp2_vectors(x);
            for (v, y) in y.into_iter().enumerate() {
                _mm256_storeu_ps(at.add(v * LANES), y);
                acc[v % 2] = _mm256_add_ps(acc[v % 2], y);
            }
        }
        // Vectors past the last block: element i still goes to lane i % SUMS, and blocks hold an
        // even number of vectors, so the vector after them adds into sums' first half.
        let rest = blocks.into_remainder();
        for (v, chunk) in rest.chunks_mut(LANES).enumerate() {
            let mut lanes = [0f32; LANES];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let x = _mm256_fmadd_ps(_mm256_loadu_ps(lanes.as_ptr()), scale, neg_shift);
            let [y] = exp2_vectors([x]);
            _mm256_storeu_ps(lanes.as_mut_ptr(), y);
            chunk.copy_from_slice(&lanes[..chunk.len()]);
            // Padding lanes add zero (their exponentials are discarded).
            lanes[chunk.len()..].fill(0.0);
            acc[v % 2] = _mm256_add_ps(acc[v % 2], _mm256_loadu_ps(lanes.as_ptr()));
        }
        _mm256_storeu_ps(sums.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(sums.as_mut_ptr().add(LANES), acc[1]);
    }

    /// 2^x of `N` vectors ([`crate::kernels::float::exp2_fused`]'s steps), each step over all
    /// of them before the next.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn exp2_vectors<const N: usize>(x: [__m256; N]) -> [__m256; N] {
        let (lo, hi) = (_mm256_set1_ps(EXP2_RANGE.0), _mm256_set1_ps(EXP2_RANGE.1));
        let round = _mm256_set1_ps(EXP2_ROUND);
        // Clamped; n + 1.5·2²³; f = x − n.
        let x = x.map(|x| _mm256_min_ps(_mm256_max_ps(x, lo), hi));
        let shifted = x.map(|x| _mm256_add_ps(x, round));
        let mut f = x;
        for (f, &s) in f.iter_mut().zip(&shifted) {
            *f = _mm256_sub_ps(*f, _mm256_sub_ps(s, round));
        }
        // 2^f by Horner's rule.
        let mut p = [_mm256_set1_ps(EXP2_POLY[0]); N];
        for &c in &EXP2_POLY[1..] {
            let c = _mm256_set1_ps(c);
            for (p, &f) in p.iter_mut().zip(&f) {
                *p = _mm256_fmadd_ps(*p, f, c);
            }
        }
        // 2^f · 2^n: n·2²³ added to the bits.
        let mut y = p;
        for (y, &s) in y.iter_mut().zip(&shifted) {
            let n = _mm256_slli_epi32::<23>(_mm256_castps_si256(s));
            *y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(*y), n));
        }
        y
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::SUMS;
    use crate::kernels::float::{EXP2_POLY, EXP2_RANGE, EXP2_ROUND};
    use std::arch::x86_64::*;

    /// Lanes of an AVX-512 vector of f32: one vector is the sum's [`SUMS`] lanes.
    const LANES: usize = 16;
    const VECTORS: usize = 4;

    /// The exponentials 2^(scale·xᵢ − shift) of the `n` values from `x`, a vector at a time:
    /// blocks of four vectors, each step over all four before the next ([`exp2_vectors`]), then
    /// the last vectors under a mask. Each is handed to `each(i, y, lanes)`, `i` its first element
    /// and `lanes` those inside the row where it is the last (`None`: all sixteen), after its
    /// values were read (so `each` may overwrite them).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn exponentials(
        x: *const f32,
        n: usize,
        scale: f32,
        shift: f32,
        mut each: impl FnMut(usize, __m512, Option<__mmask16>),
    ) {
        let (scale, neg_shift) = (_mm512_set1_ps(scale), _mm512_set1_ps(-shift));
        let whole = n / (VECTORS * LANES) * (VECTORS * LANES);
        for at in (0..whole).step_by(VECTORS * LANES) {
            let x: [__m512; VECTORS] = std::array::from_fn(|v| {
                _mm512_fmadd_ps(_mm512_loadu_ps(x.add(at + v * LANES)), scale, neg_shift)
            });
            for (v, y) in exp2_vectors(x).into_iter().enumerate() {
                each(at + v * LANES, y, None);
            }
        }
        for at in (whole..n).step_by(LANES) {
            let mask = ((1u32 << (n - at).min(LANES)) - 1) as __mmask16;
            let x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x.add(at)), scale, neg_shift);
            let [y] = exp2_vectors([x]);
            each(at, y, Some(mask));
        }
    }

    /// [`super::portable_affine_sums`] on AVX-512F ([`exponentials`]): every vector added into the
    /// one vector of sums (element `i` into lane `i % 16`, in order; lanes past the row add zero).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn affine_sums(
        xs: &mut [f32],
        scale: f32,
        shift: f32,
        sums: &mut [f32; SUMS],
    ) {
        const { assert!(LANES == SUMS) };
        let mut acc = _mm512_setzero_ps();
        let xp = xs.as_mut_ptr();
        exponentials(xp, xs.len(), scale, shift, |i, y, lanes| match lanes {
            None => {
                _mm512_storeu_ps(xp.add(i), y);
                acc = _mm512_add_ps(acc, y);
            }
            Some(mask) => {
                _mm512_mask_storeu_ps(xp.add(i), mask, y);
                acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, y));
            }
        });
        _mm512_storeu_ps(sums.as_mut_ptr(), acc);
    }

    /// [`super::max`] on AVX-512F: `max(x, m)` is `x > m ? x : m` lane by lane, as the portable
    /// copy compares.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max(xs: &[f32]) -> f32 {
        let lowest = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m = [lowest; VECTORS];
        let mut blocks = xs.chunks_exact(VECTORS * LANES);
        for block in &mut blocks {
            for (v, m) in m.iter_mut().enumerate() {
                *m = _mm512_max_ps(_mm512_loadu_ps(block.as_ptr().add(v * LANES)), *m);
            }
        }
        for chunk in blocks.remainder().chunks(LANES) {
            let mask = ((1u32 << chunk.len()) - 1) as __mmask16;
            let x = _mm512_mask_loadu_ps(lowest, mask, chunk.as_ptr());
            m[0] = _mm512_max_ps(x, m[0]);
        }
        let m = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
        _mm512_reduce_max_ps(m)
    }

    /// [`affine_sums`], each new vector also rounded to bf16 into `rounded`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn affine_sums_rounded(
        xs: &mut [f32],
        scale: f32,
        shift: f32,
        sums: &mut [f32; SUMS],
        rounded: &mut [u16],
    ) {
        let mut acc = _mm512_setzero_ps();
        let (xp, rp) = (xs.as_mut_ptr(), rounded.as_mut_ptr());
        let round = |y: __m512| std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(y));
        exponentials(xp, xs.len(), scale, shift, |i, y, lanes| match lanes {
            None => {
                _mm512_storeu_ps(xp.add(i), y);
                _mm256_storeu_si256(rp.add(i).cast(), round(y));
                acc = _mm512_add_ps(acc, y);
            }
            Some(mask) => {
                _mm512_mask_storeu_ps(xp.add(i), mask, y);
                _mm256_mask_storeu_epi16(rp.add(i).cast(), mask, round(y));
                acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, y));
            }
        });
        _mm512_storeu_ps(sums.as_mut_ptr(), acc);
    }

    /// [`super::probabilities_and_gradients`] on AVX-512F ([`exponentials`]).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn probabilities_and_gradients(
        p: &mut [f32],
        dp: &mut [f32],
        (scale2, lse2): (f32, f32),
        (delta, scale): (f32, f32),
    ) {
        let (delta, scale) = (_mm512_set1_ps(delta), _mm512_set1_ps(scale));
        // dp ← p·(dp − delta)·scale, rounded after each operation as the portable loop rounds.
        let gradient = |p: __m512, dp: __m512| {
            _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp, delta)), scale)
        };
        let (pp, dpp) = (p.as_mut_ptr(), dp.as_mut_ptr());
        exponentials(pp, p.len(), scale2, lse2, |i, y, lanes| match lanes {
            None => {
                _mm512_storeu_ps(pp.add(i), y);
                _mm512_storeu_ps(dpp.add(i), gradient(y, _mm512_loadu_ps(dpp.add(i))));
            }
            Some(mask) => {
                _mm512_mask_storeu_ps(pp.add(i), mask, y);
                let g = gradient(y, _mm512_maskz_loadu_ps(mask, dpp.add(i)));
                _mm512_mask_storeu_ps(dpp.add(i), mask, g);
            }
        });
    }

    /// 2^x of `N` vectors ([`crate::kernels::float::exp2_fused`]'s steps), each step over all
    /// of them before the next.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn exp2_vectors<const N: usize>(x: [__m512; N]) -> [__m512; N] {
        let (lo, hi) = (_mm512_set1_ps(EXP2_RANGE.0), _mm512_set1_ps(EXP2_RANGE.1));
        let round = _mm512_set1_ps(EXP2_ROUND);
        let x = x.map(|x| _mm512_min_ps(_mm512_max_ps(x, lo), hi));
        let shifted = x.map(|x| _mm512_add_ps(x, round));
        let mut f = x;
        for (f, &s) in f.iter_mut().zip(&shifted) {
            *f = _mm512_sub_ps(*f, _mm512_sub_ps(s, round));
        }
        let mut p = [_mm512_set1_ps(EXP2_POLY[0]); N];
        for &c in &EXP2_POLY[1..] {
            let c = _mm512_set1_ps(c);
            for (p, &f) in p.iter_mut().zip(&f) {
                *p = _mm512_fmadd_ps(*p, f, c);
            }
        }
        let mut y = p;
        for (y, &s) in y.iter_mut().zip(&shifted) {
            let n = _mm512_slli_epi32::<23>(_mm512_castps_si512(s));
            *y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(*y), n));
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every copy gives the same bits, every exponential and the sum, at lengths that leave every
    /// kind of tail; and the sum is the sum.
    #[test]
    fn every_copy_agrees_bit_for_bit() {
        for len in [0, 1, 7, 8, 9, 31, 32, 33, 40, 63, 64, 100, 512, 517] {
            let xs: Vec<f32> = (0..len)
                .map(|i| ((i * 37) % 101) as f32 * 0.7 - 40.0)
                .collect();
            let (scale, shift) = (0.18, 3.5);
            let mut fast = xs.clone();
            let fast_sum = affine_sum_f32(&mut fast, scale, shift);
            #[cfg(target_arch = "x86_64")]
            if crate::kernels::simd::has_avx2() {
                // The AVX2 copy, which the dispatch skips where AVX-512 runs.
                let mut avx2 = xs.clone();
                let mut sums = [0f32; SUMS];
                // SAFETY: checked just above.
                unsafe { avx2::affine_sums(&mut avx2, scale, shift, &mut sums) };
                assert_eq!(avx2, fast, "length {len}");
                assert_eq!(total(&sums).to_bits(), fast_sum.to_bits(), "length {len}");
            }
            let mut portable = xs.clone();
            let mut sums = [0f32; SUMS];
            portable_affine_sums(&mut portable, scale, shift, &mut sums);
            let portable_sum = total(&sums);
            assert_eq!(fast, portable, "length {len}");
            assert_eq!(fast_sum.to_bits(), portable_sum.to_bits(), "length {len}");
            for (&x, &y) in xs.iter().zip(&fast) {
                let want = (x as f64 * scale as f64 - shift as f64).exp2();
                assert!(
                    ((y as f64 - want) / want).abs() < 2e-6,
                    "2^({x}·{scale} − {shift})"
                );
            }
            let exact: f64 = fast.iter().map(|&y| y as f64).sum();
            assert!((fast_sum as f64 - exact).abs() <= 1e-6 * exact.max(1e-30));
        }
    }

    /// Rows of the lengths [`every_copy_agrees_bit_for_bit`] tries, values around a softmax's.
    fn rows() -> impl Iterator<Item = Vec<f32>> {
        [0, 1, 15, 16, 17, 63, 64, 65, 100, 512, 517]
            .into_iter()
            .map(|len| (0..len).map(|i| ((i * 37) % 101) as f32 * -0.31).collect())
    }

    /// The backward's one pass gives the bits of its two loops: the exponentials, then dS.
    #[test]
    fn one_pass_backward_rows_equal_the_two_loops() {
        let ((scale2, lse2), (delta, scale)) = ((0.18, 1.5), (0.07, 0.125));
        for p in rows() {
            let dp: Vec<f32> = (0..p.len()).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect();
            let (mut p1, mut dp1) = (p.clone(), dp.clone());
            probabilities_and_gradients(&mut p1, &mut dp1, (scale2, lse2), (delta, scale));
            let (mut p2, mut dp2) = (p.clone(), dp);
            affine_sum_f32(&mut p2, scale2, lse2);
            for (x, &p) in dp2.iter_mut().zip(&p2) {
                *x = p * (*x - delta) * scale;
            }
            assert_eq!(p1, p2, "length {}", p.len());
            assert_eq!(dp1, dp2, "length {}", p.len());
        }
    }

    /// The forward's rounded copy is each new value rounded to the nearest bf16 (ties to even),
    /// and the values and their sum are [`affine_sum`]'s.
    #[test]
    fn rounded_rows_are_the_rows_rounded() {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu::bf16_gemm::available() {
            let (scale, shift) = (0.18f32, 1.5f32);
            for xs in rows() {
                let (mut a, mut b) = (xs.clone(), xs.clone());
                let mut rounded = vec![0u16; xs.len()];
                let sum = affine_sum_rounded(&mut a, scale, shift, &mut rounded);
                assert_eq!(sum.to_bits(), affine_sum(&mut b, scale, shift).to_bits());
                assert_eq!(a, b, "length {}", xs.len());
                for (&x, &r) in b.iter().zip(&rounded) {
                    let bits = x.to_bits();
                    let nearest = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
                    assert_eq!(r as u32, nearest, "{x}");
                }
            }
        }
    }

    /// The row maximum is [`simd::max`]'s, NaNs passed over, at every length of tail.
    #[test]
    fn row_maxima_are_the_portable_ones() {
        for mut xs in rows() {
            assert_eq!(max(&xs).to_bits(), simd::max(&xs).to_bits());
            let middle = xs.len() / 2;
            if let Some(x) = xs.get_mut(middle) {
                *x = f32::NAN;
            }
            assert_eq!(max(&xs).to_bits(), simd::max(&xs).to_bits());
        }
    }
}

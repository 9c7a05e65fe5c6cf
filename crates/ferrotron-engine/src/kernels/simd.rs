//! Helpers that let plain element-wise loops vectorise: lane-wise reductions and `simd_kernel!`, which compiles a kernel function (closures included) a second time for AVX2+FMA and
//! picks that copy at run time when the CPU has them.

use super::float::Real;

const LANES: usize = 16;

/// Maximum of `xs` (−∞ if empty), in 16 independent lanes so that it vectorises.
#[inline(always)]
pub fn max<T: Real>(xs: &[T]) -> T {
    let mut acc = [T::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    tail.iter()
        .chain(acc.iter())
        .fold(T::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Σ xs in 16 independent lanes (a fixed order, so results are reproducible).
#[inline(always)]
pub fn sum<T: Real>(xs: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().chain(tail).fold(T::ZERO, |s, &x| s + x)
}

/// Σ aᵢ·bᵢ in 16 independent lanes.
#[inline(always)]
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(T::ZERO, |s, (&x, &y)| s + x * y);
    for (x, y) in ca.zip(cb) {
        for ((a, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *a += x * y;
        }
    }
    acc.iter().fold(tail, |s, &x| s + x)
}

const F64_LANES: usize = 8;

/// Σ term(i) over `0..n` in 8 independent f64 lanes (a fixed order), so that it vectorises when `term`
/// reads slices at least `n` long.
#[inline(always)]
fn sum_f64_lanes(n: usize, term: impl Fn(usize) -> f64) -> f64 {
    let mut acc = [0f64; F64_LANES];
    let full = n / F64_LANES * F64_LANES;
    for base in (0..full).step_by(F64_LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += term(base + l);
        }
    }
    let tail = (full..n).fold(0.0, |s, i| s + term(i));
    acc.iter().sum::<f64>() + tail
}

/// Σ xᵢ², each square formed in f64.
#[inline(always)]
pub fn sum_sq_f64<T: Real>(x: &[T]) -> f64 {
    sum_f64_lanes(x.len(), |i| x[i].to_f64() * x[i].to_f64())
}

/// Σ (aᵢ·bᵢ)·cᵢ, the product aᵢ·bᵢ in `T` and the rest in f64.
#[inline(always)]
pub fn dot3_f64<T: Real>(a: &[T], b: &[T], c: &[T]) -> f64 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    sum_f64_lanes(n, |i| (a[i] * b[i]).to_f64() * c[i].to_f64())
}

/// Asks for the cache lines of `len` elements from `at` ahead of their use: rows of a wide
/// token-major tensor read (or written, `write`) a head at a time are a short run every few KiB,
/// which the hardware prefetchers do not run ahead of, so each row's lines arrive a memory latency
/// after they are touched. A hint: no fault, no effect on results, nothing off x86_64.
#[inline(always)]
pub fn prefetch<T>(at: *const T, len: usize, write: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        let bytes = len * std::mem::size_of::<T>();
        for line in (0..bytes).step_by(64) {
            let p = at.cast::<i8>().wrapping_add(line);
            // SAFETY: a prefetch never faults, whatever the address; SSE is baseline on x86_64.
            unsafe {
                if write {
                    _mm_prefetch::<_MM_HINT_ET0>(p)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(p)
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len, write);
}

/// Whether the AVX2+FMA copies of `simd_kernel!` functions may run (cached by the standard library).
#[inline(always)]
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines a kernel function whose body is compiled twice: once for AVX2+FMA, taken at run time when
/// the CPU has them, and once for the baseline. Closures written in the body inherit the features, so
/// the row loops handed to the thread pool vectorise 8 lanes wide; helpers they call must be
/// `#[inline(always)]`. Both copies give identical results: Rust never contracts `a * b + c` into a
/// fused multiply-add, and every reduction here has a fixed lane order.
macro_rules! simd_kernel {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$t:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name $(<$t: $bound>)? ($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                $(#[$attr])*
                fn avx2 $(<$t: $bound>)? ($($arg: $ty),*) $(-> $ret)? $body
                if $crate::kernels::simd::has_avx2() {
                    // SAFETY: the CPU has both features, checked just above.
                    return unsafe { avx2 $(::<$t>)? ($($arg),*) };
                }
            }
            $body
        }
    };
}
pub(crate) use simd_kernel;

#[cfg(test)]
mod tests {
    use crate::kernels::float::Real;

    super::simd_kernel! {
        fn exp2_all(xs: &mut [f32]) {
            xs.iter_mut().for_each(|x| *x = x.exp2_fused());
        }
    }

    /// The AVX2 copy of a kernel (vector FMA) and the baseline one (software FMA, one rounding too)
    /// give the same bits.
    #[test]
    fn fused_exp2_is_the_same_in_both_copies() {
        let xs: Vec<f32> = (0..6000).map(|i| -130.0 + i as f32 * 0.0449).collect();
        let mut vector = xs.clone();
        exp2_all(&mut vector);
        let scalar: Vec<f32> = xs
            .iter()
            .map(|&x| crate::kernels::float::exp2_fused(x))
            .collect();
        assert_eq!(vector, scalar);
    }

    /// The largest relative error of `f` against the f64 function `want` at `step`s over `range`.
    fn worst_relative_error(
        f: fn(f32) -> f32,
        want: fn(f64) -> f64,
        (lo, hi): (f32, f32),
        step: f32,
    ) -> f64 {
        let mut worst = 0f64;
        let mut x = lo;
        while x < hi {
            let want = want(x as f64);
            worst = worst.max(((f(x) as f64 - want) / want).abs());
            x += step;
        }
        worst
    }

    #[test]
    fn exp_is_accurate_to_about_one_ulp() {
        use crate::kernels::float::exp;
        let worst = worst_relative_error(exp, f64::exp, (-87.0, 88.0), 0.0137);
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37);
        assert!(exp(88.7).is_finite() && exp(88.7) > 3e38);
    }

    /// 2^x within 1.5 ulp (relative 2^-24 · 1.5) over its range, exact at integers, ~0 below it and
    /// finite above it.
    #[test]
    fn exp2_is_accurate_to_one_and_a_half_ulp() {
        use crate::kernels::float::exp2_fused;
        let worst = worst_relative_error(exp2_fused, f64::exp2, (-125.0, 127.0), 0.001_37);
        assert!(
            worst < 1.5 * 2f64.powi(-24),
            "worst relative error {worst:e}"
        );
        for n in -125..=127 {
            assert_eq!(exp2_fused(n as f32), (n as f32).exp2(), "2^{n}");
        }
        assert!(exp2_fused(-1000.0) < 3e-38);
        assert!(exp2_fused(1000.0).is_finite());
    }

    #[test]
    fn tanh_reaches_its_limits() {
        let tanh = crate::kernels::float::tanh::<f32>;
        assert!((tanh(20.0) - 1.0).abs() < 1e-7 && (tanh(-20.0) + 1.0).abs() < 1e-7);
    }
}

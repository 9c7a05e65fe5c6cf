//! Helpers that let plain element-wise loops vectorise: lane-wise reductions, an `exp` made only of multiplies, adds and bit
//! operations, and a runtime switch that compiles a loop body for AVX2+FMA when the CPU has them.

use super::float::Real;

/// e^x for f32, accurate to about 1 ulp on [-87, 88]; inputs below are flushed to ~0, above to ~inf.
/// Branch-free so that loops calling it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    // x = n·ln2 + r with |r| ≤ ln2/2; rounding to nearest via the 1.5·2²³ trick.
    let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor series of e^r to degree 7: truncation error < 6e-9 relative for |r| ≤ 0.347.
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // Scale by 2^n in two halves so that n = 128 does not overflow the exponent field.
    let n = n as i32;
    let half = n >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((n - half + 127) as u32) << 23);
    p * s1 * s2
}

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

/// Runs `f` compiled for AVX2+FMA when the CPU supports them (the closure is inlined into a function
/// with those target features), else as is. Results are identical: no fused multiply-adds are formed.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            #[target_feature(enable = "avx2")]
            fn run<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the feature was detected just above.
            return unsafe { run(f) };
        }
    }
    f()
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_accurate_to_about_one_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = super::exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) < 1e-37);
        let tanh = crate::kernels::float::tanh::<f32>;
        assert!((tanh(20.0) - 1.0).abs() < 1e-7 && (tanh(-20.0) + 1.0).abs() < 1e-7);
    }
}

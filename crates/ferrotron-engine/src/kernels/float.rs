//! The scalar type the CPU kernels are written over: f32 in training, f64 in the finite-difference
//! tests that check every backward (the same code, monomorphised twice).

use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + std::iter::Sum
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// A constant of this type.
    fn of(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn sqrt(self) -> Self;
    /// e^x; f32 uses the vectorisable polynomial `exp` below.
    fn exp(self) -> Self;
    /// 2^x with fused multiply-adds (f32: `exp2_fused` below), for the attention kernels' hot rows
    /// (their scores scaled by log2(e), so that a softmax's exponential is a power of two):
    /// inside a `simd_kernel!` it vectorises to FMA instructions; elsewhere it is exact-rounded
    /// software FMA, so both copies still agree bit for bit.
    fn exp2_fused(self) -> Self;
    fn max(self, other: Self) -> Self;
    fn cos(self) -> Self;
    fn sin(self) -> Self;

    /// `x` as f32 when this type is f32 (the kernels that only exist for f32, such as bf16 products).
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        (std::any::TypeId::of::<Self>() == std::any::TypeId::of::<f32>())
            // SAFETY: Self is f32.
            .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) })
    }
    fn as_f32_mut(x: &mut [Self]) -> Option<&mut [f32]> {
        (std::any::TypeId::of::<Self>() == std::any::TypeId::of::<f32>())
            // SAFETY: Self is f32.
            .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), x.len()) })
    }
}

macro_rules! impl_real {
    ($t:ty, $exp:path, $exp2_fused:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn of(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn exp2_fused(self) -> Self {
                $exp2_fused(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
        }
    };
}

impl_real!(f32, exp, exp2_fused);
impl_real!(f64, f64::exp, f64::exp2);

/// e^x for f32, accurate to about 1 ulp on [-87, 88]; inputs below are flushed to ~0, above to ~inf.
/// Branch-free so that loops calling it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Multiply-adds unfused: on CPUs without FMA a fused one is a software routine.
    let madd = |a: f32, b: f32, c: f32| a * b + c;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    // x = n·ln2 + r with |r| ≤ ln2/2; rounding to nearest via the 1.5·2²³ trick.
    // The sum's low mantissa bits hold n as an integer: read it from the bits, since a float-to-int
    // `as` cast saturates, which compiles to scalar compares and stops the loop vectorising.
    let shifted = madd(x, LOG2E, 12_582_912.0);
    let n = shifted - 12_582_912.0;
    let n_int = shifted.to_bits() as i32 - 0x4B40_0000;
    let r = madd(-n, LN2_LO, madd(-n, LN2_HI, x));
    // Taylor series of e^r to degree 7: truncation error < 6e-9 relative for |r| ≤ 0.347.
    let p = 1.0 / 5040.0;
    let p = madd(p, r, 1.0 / 720.0);
    let p = madd(p, r, 1.0 / 120.0);
    let p = madd(p, r, 1.0 / 24.0);
    let p = madd(p, r, 1.0 / 6.0);
    let p = madd(p, r, 0.5);
    let p = madd(p, r, 1.0);
    let p = madd(p, r, 1.0);
    // Scale by 2^n in two halves so that n = 128 does not overflow the exponent field.
    let n = n_int;
    let half = n >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((n - half + 127) as u32) << 23);
    p * s1 * s2
}

/// 2^x for f32 with every multiply-add fused (one rounding each), accurate to about 1.4 ulp on
/// [-125, 127]; inputs below give 2^-125 (~0), above 2^127. Half the instructions of [`exp`]: no
/// range reduction by ln 2 (the caller folds log2(e) into its scale), a polynomial of degree 6,
/// and 2^n added to the result's exponent bits in one integer add. Branch-free, so loops calling
/// it vectorise. The vector copy of attention's rows (`cpu/exp2_rows.rs`) runs these same steps.
#[inline(always)]
pub fn exp2_fused(x: f32) -> f32 {
    // n = x rounded to nearest by adding 1.5·2²³; f = x − n exactly, |f| ≤ 1/2.
    let x = x.clamp(EXP2_RANGE.0, EXP2_RANGE.1);
    let shifted = x + EXP2_ROUND;
    let f = x - (shifted - EXP2_ROUND);
    let p = EXP2_POLY[1..]
        .iter()
        .fold(EXP2_POLY[0], |p, &c| f32::mul_add(p, f, c));
    // The sum's low mantissa bits hold n as a two's complement integer, so its bits shifted left by
    // 23 are n·2²³ (the constant's own bits shift out): added to p's bits, p·2^n. Read from the
    // bits, not by a float-to-int cast, which saturates, compiles to scalar compares and stops the
    // loop vectorising. p ∈ [0.7, 1.42] and n ∈ [-125, 127]: the exponent field stays in 1..=254.
    f32::from_bits(p.to_bits().wrapping_add(shifted.to_bits() << 23))
}

/// The inputs [`exp2_fused`] is accurate on; others are clamped to them.
pub const EXP2_RANGE: (f32, f32) = (-125.0, 127.0);

/// 1.5·2²³: adding it rounds an f32 below 2²² in magnitude to an integer.
pub const EXP2_ROUND: f32 = 12_582_912.0;

/// The coefficients of 2^f on [-1/2, 1/2], highest degree first: a degree-6 fit of relative error
/// (Lawson-weighted least squares on Chebyshev points; 1.9e-9 in exact arithmetic, under 1.4 ulp
/// evaluated in f32 by Horner's rule with fused multiply-adds).
pub const EXP2_POLY: [f32; 7] = [
    1.535_086_8e-4,
    1.339_997_3e-3,
    9.618_47e-3,
    5.550_328_6e-2,
    2.402_264_8e-1,
    // The fit lands on ln 2 rounded to f32 (the slope of 2^f at 0).
    std::f32::consts::LN_2,
    1.0,
];

/// 1 / (1 + e^−x)
#[inline(always)]
pub fn sigmoid<T: Real>(x: T) -> T {
    T::ONE / (T::ONE + (-x).exp())
}

/// tanh via e^(2x); exact limits ±1 for large |x|.
#[inline(always)]
pub fn tanh<T: Real>(x: T) -> T {
    T::ONE - T::of(2.0) / ((T::of(2.0) * x).exp() + T::ONE)
}

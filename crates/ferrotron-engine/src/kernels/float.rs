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
    /// e^x; f32 uses the vectorisable polynomial in `simd`.
    fn exp(self) -> Self;
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
    ($t:ty, $exp:path) => {
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

impl_real!(f32, super::simd::exp);
impl_real!(f64, f64::exp);

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

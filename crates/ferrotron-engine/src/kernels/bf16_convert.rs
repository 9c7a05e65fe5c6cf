//! f32 ↔ bf16 over whole buffers, at memory speed: the activation stash, the gradients rounded into
//! 16-bit storage and the compute copy of the weights all pass through here every step.
//!
//! Rounding is to nearest, ties to even, on the bits (NaN stays NaN, quieted), the same values as
//! `half::bf16::from_f32`, denormals included; written as plain integer loops so that they
//! vectorise (AVX2 where present). The `_to` forms write fresh (uninitialised) memory, so that a
//! new buffer is not zeroed first only to be overwritten.

use super::simd::simd_kernel;
use half::bf16;
use std::mem::MaybeUninit;

/// `x` rounded to bf16: its bits.
#[inline(always)]
fn round_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    if nan {
        ((b >> 16) | 0x40) as u16
    } else {
        (rounded >> 16) as u16
    }
}

simd_kernel! {
    /// `dst[i] = bf16(src[i])` (bits).
    pub fn round_to(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        assert_eq!(src.len(), dst.len(), "bf16 round: lengths");
        for (o, &x) in dst.iter_mut().zip(src) {
            o.write(round_bits(x));
        }
    }
}

simd_kernel! {
    /// `dst[i] = f32(src[i])` (exact).
    pub fn widen_to(src: &[bf16], dst: &mut [MaybeUninit<f32>]) {
        assert_eq!(src.len(), dst.len(), "bf16 widen: lengths");
        for (o, h) in dst.iter_mut().zip(src) {
            o.write(f32::from_bits((h.to_bits() as u32) << 16));
        }
    }
}

simd_kernel! {
    /// `acc[i] = bf16(f32(acc[i]) + add[i])`: a gradient accumulated in 16-bit storage.
    pub fn add_into(acc: &mut [bf16], add: &[f32]) {
        assert_eq!(acc.len(), add.len(), "bf16 add: lengths");
        for (s, &x) in acc.iter_mut().zip(add) {
            *s = bf16::from_bits(round_bits(s.to_f32() + x));
        }
    }
}

/// `dst[i] = bf16(src[i])`.
pub fn round_into(src: &[f32], dst: &mut [bf16]) {
    round_to(src, as_uninit_bits(dst))
}

/// `dst[i] = f32(src[i])`.
pub fn widen_into(src: &[bf16], dst: &mut [f32]) {
    // SAFETY: an initialised f32 may be viewed as a possibly uninitialised one; only written.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len()) };
    widen_to(src, dst)
}

/// A bf16 buffer viewed as the bits `round_to` writes.
pub fn as_uninit_bits(dst: &mut [bf16]) -> &mut [MaybeUninit<u16>] {
    // SAFETY: bf16 is a transparent u16, and an initialised value may be viewed as a possibly
    // uninitialised one of the same layout; the view is only written.
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len()) }
}

/// A new buffer of `len` elements filled by `fill` (which must write every element of the slice it
/// is given), with no zeroing first.
pub fn filled<T, F: FnOnce(&mut [MaybeUninit<T>])>(len: usize, fill: F) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` wrote all `len` elements.
    unsafe { out.set_len(len) };
    out
}

/// `src` rounded to bf16, in a new buffer.
pub fn rounded(src: &[f32]) -> Vec<bf16> {
    filled(src.len(), |d: &mut [MaybeUninit<bf16>]| {
        // SAFETY: as in `as_uninit_bits`.
        let bits = unsafe { std::slice::from_raw_parts_mut(d.as_mut_ptr().cast(), d.len()) };
        round_to(src, bits)
    })
}

/// `src` widened to f32, in a new buffer.
pub fn widened(src: &[bf16]) -> Vec<f32> {
    filled(src.len(), |d| widen_to(src, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_half_crate_bit_for_bit() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-41,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            // Ties: halfway between two bf16 values, both parities.
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            xs.push(f32::from_bits(s));
        }
        let got = rounded(&xs);
        for (x, g) in xs.iter().zip(&got) {
            let want = bf16::from_f32(*x);
            if x.is_nan() {
                assert!(g.is_nan(), "{x}");
            } else {
                assert_eq!(g.to_bits(), want.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
        let back = widened(&got);
        for (g, b) in got.iter().zip(&back) {
            assert!(g.to_f32() == *b || b.is_nan());
        }
        let mut acc = got.clone();
        let add: Vec<f32> = xs.iter().map(|x| x * 0.5).collect();
        add_into(&mut acc, &add);
        for ((a, g), d) in acc.iter().zip(&got).zip(&add) {
            let want = bf16::from_f32(g.to_f32() + d);
            assert!(a.to_bits() == want.to_bits() || a.is_nan(), "{g} + {d}");
        }
    }
}

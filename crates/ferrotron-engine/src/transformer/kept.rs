//! A tensor the forward pass keeps for backward: in f32, or under mixed precision in a 16-bit format
//! (the arithmetic stays f32: values are rounded when kept and widened when used), so the stash —
//! activation memory — is 2-byte.

use crate::kernels::Backend;
use ferrotron_core::precision::Half;
use half::slice::HalfFloatSliceExt;
use std::borrow::Cow;

#[derive(Debug, Clone, Default)]
pub(crate) enum Kept {
    #[default]
    Empty,
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl Kept {
    /// Keeps `v` as is, or rounded to `storage` (on `be`'s cores).
    pub fn keep(be: &dyn Backend, v: Vec<f32>, storage: Option<Half>) -> Self {
        match storage {
            None => Self::F32(v),
            Some(Half::Bf16) => Self::Bf16(be.rounded_to_bf16(&v)),
            Some(Half::F16) => {
                let mut out = vec![half::f16::ZERO; v.len()];
                out.convert_from_f32_slice(&v);
                Self::F16(out)
            }
        }
    }

    /// The values in f32 (borrowed when kept in f32; widened on `be`'s cores).
    pub fn get(&self, be: &dyn Backend) -> Cow<'_, [f32]> {
        match self {
            Self::Empty => Cow::Borrowed(&[]),
            Self::F32(v) => Cow::Borrowed(v),
            Self::Bf16(v) => Cow::Owned(be.widened_from_bf16(v)),
            Self::F16(v) => Cow::Owned(v.to_f32_vec()),
        }
    }

    /// The values in f32, taking them (no copy when kept in f32).
    pub fn into_f32(self, be: &dyn Backend) -> Vec<f32> {
        match self {
            Self::F32(v) => v,
            other => other.get(be).into_owned(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Empty => 0,
            Self::F32(v) => 4 * v.len(),
            Self::Bf16(v) => 2 * v.len(),
            Self::F16(v) => 2 * v.len(),
        }
    }
}

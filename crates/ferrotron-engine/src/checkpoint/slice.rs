//! Slice arithmetic: which elements two stored slices of one tensor share.

use crate::error::{EngineError, Result};
use crate::parallel::tensor::{one, Slice};
use std::ops::Range;

/// Whether `s` keeps the whole tensor (one range over the whole cut dimension, no padding).
fn is_whole(s: &Slice, shape: &[usize]) -> bool {
    s.pad == 0 && s.ranges.len() == 1 && s.ranges[0] == (0..shape[s.dim])
}

/// `s` expressed as a cut along `dim` (possible when it is along `dim` already, or whole).
fn along(s: &Slice, shape: &[usize], dim: usize) -> Option<Slice> {
    if s.dim == dim {
        Some(s.clone())
    } else if is_whole(s, shape) {
        Some(Slice {
            dim,
            ranges: one(0..shape[dim]),
            pad: 0,
        })
    } else {
        None
    }
}

/// A slice spanning the whole of a tensor of `shape`.
pub fn whole(shape: &[usize]) -> Slice {
    Slice {
        dim: 0,
        ranges: one(0..shape.first().copied().unwrap_or(1)),
        pad: 0,
    }
}

/// The elements a stored array (part `src_flat` of the flattened shard `src` of a tensor of global
/// `shape`) shares with a wanted one (part `dst_flat` of shard `dst`), as contiguous spans
/// `(offset in the stored array, offset in the wanted array, length)`. Padding is in neither.
pub fn overlap_spans(
    shape: &[usize],
    src: &Slice,
    src_flat: Range<usize>,
    dst: &Slice,
    dst_flat: Range<usize>,
) -> Result<Vec<(usize, usize, usize)>> {
    let shape: Vec<usize> = if shape.is_empty() {
        vec![1]
    } else {
        shape.to_vec()
    };
    let dim = if is_whole(src, &shape) {
        dst.dim
    } else {
        src.dim
    };
    let (Some(s), Some(t)) = (along(src, &shape, dim), along(dst, &shape, dim)) else {
        return Err(EngineError::Invalid(format!(
            "slices cut along different dimensions ({} and {}) of a tensor of shape {shape:?}",
            src.dim, dst.dim
        )));
    };
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let kept = |sl: &Slice| sl.ranges.iter().map(Range::len).sum::<usize>() + sl.pad;
    let (ks, kt) = (kept(&s), kept(&t));
    let mut spans = Vec::new();
    let mut s_at = 0;
    for rs in &s.ranges {
        let mut t_at = 0;
        for rt in &t.ranges {
            let (g0, g1) = (rs.start.max(rt.start), rs.end.min(rt.end));
            if g0 < g1 {
                for o in 0..outer {
                    let ss = (o * ks + s_at + g0 - rs.start) * inner;
                    let ts = (o * kt + t_at + g0 - rt.start) * inner;
                    let n = (g1 - g0) * inner;
                    // Offsets u in 0..n with ss+u in src_flat and ts+u in dst_flat.
                    let lo = src_flat
                        .start
                        .saturating_sub(ss)
                        .max(dst_flat.start.saturating_sub(ts));
                    let hi = n
                        .min(src_flat.end.saturating_sub(ss))
                        .min(dst_flat.end.saturating_sub(ts));
                    if lo < hi {
                        spans.push((ss + lo - src_flat.start, ts + lo - dst_flat.start, hi - lo));
                    }
                }
            }
            t_at += rt.len();
        }
        s_at += rs.len();
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(dim: usize, ranges: &[(usize, usize)], pad: usize) -> Slice {
        Slice {
            dim,
            ranges: ranges.iter().map(|&(a, b)| a..b).collect(),
            pad,
        }
    }

    /// Element-by-element reference: the global index of each element of a stored array.
    fn global_indices(shape: &[usize], s: &Slice, flat: Range<usize>) -> Vec<Option<usize>> {
        let outer: usize = shape[..s.dim].iter().product();
        let inner: usize = shape[s.dim + 1..].iter().product();
        let len = shape[s.dim];
        let mut all = Vec::new();
        for o in 0..outer {
            for r in &s.ranges {
                for g in r.clone() {
                    for i in 0..inner {
                        all.push(Some((o * len + g) * inner + i));
                    }
                }
            }
            all.extend(std::iter::repeat_n(None, s.pad * inner));
        }
        all[flat].to_vec()
    }

    #[test]
    fn spans_match_an_element_by_element_mapping() {
        let shape = [6, 4];
        let slices = [
            (cut(0, &[(0, 6)], 0), 0..24),
            (cut(0, &[(0, 3)], 1), 0..16),
            (cut(0, &[(3, 6)], 1), 5..13),
            (cut(1, &[(0, 1), (2, 3)], 0), 0..12),
            (cut(1, &[(1, 2), (3, 4)], 0), 3..9),
            (cut(0, &[(2, 5)], 0), 4..12),
        ];
        for (a, fa) in &slices {
            for (b, fb) in &slices {
                if a.dim != b.dim && !is_whole(a, &shape) && !is_whole(b, &shape) {
                    assert!(overlap_spans(&shape, a, fa.clone(), b, fb.clone()).is_err());
                    continue;
                }
                let src = global_indices(&shape, a, fa.clone());
                let dst = global_indices(&shape, b, fb.clone());
                let mut got = vec![None; dst.len()];
                for (so, to, n) in overlap_spans(&shape, a, fa.clone(), b, fb.clone()).unwrap() {
                    got[to..to + n].copy_from_slice(&src[so..so + n]);
                }
                for (k, (g, d)) in got.iter().zip(&dst).enumerate() {
                    match d {
                        Some(d) if src.contains(&Some(*d)) => assert_eq!(g, &Some(*d), "{k}"),
                        _ => assert_eq!(g, &None, "{a:?} {fa:?} → {b:?} {fb:?} at {k}"),
                    }
                }
            }
        }
    }
}

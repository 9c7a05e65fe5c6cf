//! How a tensor is cut for a device: the slice of one dimension it keeps, and the flat runs of
//! elements that makes. The tensor-parallel split decides the slices (`tensor.rs`); sources of
//! weights and checkpoints read them (`weights.rs`, `checkpoint/`).

use std::ops::Range;

/// How a tensor is cut: along `dim`, this device keeps the concatenation of `ranges`, then `pad`
/// zero rows (the vocabulary's padding). A tensor kept whole has one range covering `dim` 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub dim: usize,
    pub ranges: Vec<Range<usize>>,
    pub pad: usize,
}

impl Slice {
    /// The elements of a tensor of `shape` this slice keeps, in the shard's order: ranges of flat
    /// indices, each followed by the zeros of padding that come after it.
    pub fn runs(&self, shape: &[usize]) -> Vec<(Range<usize>, usize)> {
        if shape.is_empty() {
            return vec![(0..1, 0)];
        }
        let (outer, len, inner) = dims(shape, self.dim);
        let mut runs = Vec::with_capacity(outer * self.ranges.len());
        for o in 0..outer {
            for (k, r) in self.ranges.iter().enumerate() {
                let pad = if k + 1 == self.ranges.len() {
                    self.pad * inner
                } else {
                    0
                };
                runs.push(((o * len + r.start) * inner..(o * len + r.end) * inner, pad));
            }
        }
        runs
    }
}

/// One contiguous range, as a slice's list of ranges.
pub(crate) fn one(r: Range<usize>) -> Vec<Range<usize>> {
    std::iter::once(r).collect()
}

/// A shape seen as `[outer, len, inner]` around `dim`.
pub(crate) fn dims(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

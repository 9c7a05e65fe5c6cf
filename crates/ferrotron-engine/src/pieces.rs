//! The geometry of a tensor cut over `dp` data-parallel ranks: rank r's piece is the r-th of `dp`
//! equal parts of the tensor padded to a multiple of `dp`; what it owns is that piece without the
//! padding. ZeRO's state, its 16-bit stores and the checkpoint code all cut tensors this way.

use std::ops::Range;

/// This rank's piece of a tensor of `len` elements padded to a multiple of `dp`.
pub(crate) fn piece(len: usize, dp: usize, rank: usize) -> Range<usize> {
    let n = len.div_ceil(dp);
    rank * n..(rank + 1) * n
}

/// The part of a tensor of `len` elements a rank owns (its piece without the padding).
pub(crate) fn owned(len: usize, dp: usize, rank: usize) -> Range<usize> {
    let r = piece(len, dp, rank);
    let end = r.end.min(len);
    r.start.min(end)..end
}

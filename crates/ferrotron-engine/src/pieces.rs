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

/// A rank's padded piece of `t` (what it keeps and sends; zeros past the end of the tensor).
pub(crate) fn padded_piece<T: Copy + Default>(t: &[T], dp: usize, rank: usize) -> Vec<T> {
    let mut p = Vec::with_capacity(piece(t.len(), dp, rank).len());
    push_padded_piece(&mut p, t, dp, rank);
    p
}

/// Appends a rank's padded piece of `t` to `out` (buffers of several tensors' pieces, sized once).
pub(crate) fn push_padded_piece<T: Copy + Default>(
    out: &mut Vec<T>,
    t: &[T],
    dp: usize,
    rank: usize,
) {
    let own = owned(t.len(), dp, rank);
    let pad = piece(t.len(), dp, rank).len() - own.len();
    out.extend_from_slice(&t[own]);
    out.resize(out.len() + pad, T::default());
}

/// A tensor of `len` elements out of an all-gather whose every rank contributed a block of `block`
/// elements holding this tensor's padded piece at offset `at`: the pieces in rank order, the
/// padding dropped.
pub(crate) fn from_gathered<T: Copy>(
    all: &[T],
    dp: usize,
    block: usize,
    at: usize,
    len: usize,
) -> Vec<T> {
    let n = piece(len, dp, 0).len();
    let mut t = Vec::with_capacity(n * dp);
    for k in 0..dp {
        t.extend_from_slice(&all[k * block + at..k * block + at + n]);
    }
    t.truncate(len);
    t
}

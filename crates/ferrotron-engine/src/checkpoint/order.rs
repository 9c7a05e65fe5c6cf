//! The order a piece's elements are stored in. The runtime holds a shard row-major; a tensor cut
//! along a dimension other than the first (a row-parallel weight's input columns) is stored
//! cut-major instead: its elements sorted by their index along the cut, then row-major. A reader on
//! another split wants a range of that dimension, which is then one contiguous range of the file;
//! row-major it would be a strided set touching every byte range (and every hash block) of the
//! array. A ZeRO piece (a flat part of the row-major shard) is sorted the same way.

use std::ops::Range;

/// How a piece's elements lie in its rank file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoredOrder {
    /// The runtime's order (a tensor cut along its first dimension, or kept whole along it).
    #[default]
    RowMajor,
    /// Sorted by the index along the cut dimension, then row-major.
    CutMajor,
}

impl StoredOrder {
    /// The order of a piece of a shard cut along `dim`.
    pub fn for_cut(dim: usize) -> Self {
        if dim > 0 {
            StoredOrder::CutMajor
        } else {
            StoredOrder::RowMajor
        }
    }

    pub fn is_row_major(&self) -> bool {
        *self == StoredOrder::RowMajor
    }
}

/// Elements `flat` of a row-major shard of shape `[outer, len, inner]` around its cut dimension,
/// stored cut-major: the elements at cut index `k` are stored at `starts[k]..starts[k + 1]`, in
/// row-major order among themselves.
pub struct CutMajor {
    len: usize,
    inner: usize,
    flat: Range<usize>,
    starts: Vec<usize>,
}

impl CutMajor {
    pub fn new(shard_shape: &[usize], dim: usize, flat: Range<usize>) -> Self {
        let len = shard_shape.get(dim).copied().unwrap_or(1).max(1);
        let inner: usize = shard_shape.get(dim + 1..).map_or(1, |s| s.iter().product());
        let inner = inner.max(1);
        // Elements below flat index x at cut index k: whole rows of `len × inner`, then the part
        // of the last row's group k below x.
        let below = |x: usize, k: usize| {
            let row = len * inner;
            (x / row) * inner + (x % row).saturating_sub(k * inner).min(inner)
        };
        let mut starts = Vec::with_capacity(len + 1);
        starts.push(0);
        for k in 0..len {
            let here = below(flat.end, k) - below(flat.start, k);
            starts.push(starts[k] + here);
        }
        Self {
            len,
            inner,
            flat,
            starts,
        }
    }

    /// Visits the piece a run at a time, calling `f(row-major offset, stored offset, length, cut
    /// index)` for each run of elements contiguous on both sides (one row's `inner` elements at one
    /// cut index), in tiles of 256 rows (rows of the shard around its cut: `len × inner` elements)
    /// by 16 cut indices, so that both sides are touched in cache- and page-sized runs (a plain
    /// transpose walks one side with a stride of the whole array). Each cut index's elements are
    /// visited in row-major order, which is their stored order.
    fn walk(&self, mut f: impl FnMut(usize, usize, usize, usize)) {
        const TILE_ROWS: usize = 256;
        const TILE_CUTS: usize = 16;
        let (len, inner, flat) = (self.len, self.inner, &self.flat);
        let row = len * inner;
        let (first, last) = (flat.start / row, flat.end.div_ceil(row));
        let mut next = self.starts[..len].to_vec();
        for tile in (first..last).step_by(TILE_ROWS) {
            let rows = tile..(tile + TILE_ROWS).min(last);
            for block in (0..len).step_by(TILE_CUTS) {
                let cuts = block..(block + TILE_CUTS).min(len);
                for o in rows.clone() {
                    for k in cuts.clone() {
                        let lo = ((o * len + k) * inner).max(flat.start);
                        let hi = ((o * len + k + 1) * inner).min(flat.end);
                        if lo < hi {
                            f(lo - flat.start, next[k], hi - lo, k);
                            next[k] += hi - lo;
                        }
                    }
                }
            }
        }
    }

    /// The cut indices the row-major offsets `spans` (start, length) touch.
    pub fn touched(&self, spans: impl Iterator<Item = (usize, usize)>) -> Vec<bool> {
        let mut need = vec![false; self.len];
        for (start, n) in spans {
            if n >= self.len * self.inner {
                need.fill(true);
                break;
            }
            let first = (self.flat.start + start) / self.inner;
            let last = (self.flat.start + start + n).div_ceil(self.inner);
            for row in first..last {
                need[row % self.len] = true;
            }
        }
        need
    }

    /// The stored element ranges holding the cut indices `need` (runs of them merged).
    pub fn stored_ranges(&self, need: &[bool]) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for k in (0..self.len).filter(|&k| need[k]) {
            let r = self.starts[k]..self.starts[k + 1];
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }

    /// Row-major values → stored order.
    pub fn store<T: Copy + Default>(&self, row_major: &[T]) -> Vec<T> {
        let mut out = vec![T::default(); row_major.len()];
        self.walk(|at, stored, n, _| {
            if n == 1 {
                out[stored] = row_major[at];
            } else {
                out[stored..stored + n].copy_from_slice(&row_major[at..at + n]);
            }
        });
        out
    }

    /// Stored elements (`size` bytes each) → row-major, at the cut indices `need` only (the rest
    /// left zero).
    pub fn load_bytes(&self, stored: &[u8], size: usize, need: &[bool]) -> Vec<u8> {
        let mut out = vec![0u8; stored.len()];
        self.walk(|at, s, n, k| {
            if need[k] {
                out[size * at..size * (at + n)].copy_from_slice(&stored[size * s..size * (s + n)]);
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece of a few shards, every cut index: stored then loaded gives back the values; the
    /// stored ranges of a cut index hold exactly its elements.
    #[test]
    fn stored_order_round_trips_and_groups_by_cut_index() {
        for (shape, dim) in [
            (vec![4, 6], 1),
            (vec![3, 5, 2], 1),
            (vec![2, 3, 4], 2),
            (vec![5, 3], 0),
        ] {
            let n: usize = shape.iter().product();
            let (len, inner) = (shape[dim], shape[dim + 1..].iter().product::<usize>());
            for flat in [0..n, 1..n - 1, 3..7.min(n), n / 2..n] {
                let piece = CutMajor::new(&shape, dim, flat.clone());
                let values: Vec<u32> = flat.clone().map(|f| f as u32).collect();
                let stored = piece.store(&values);
                let bytes: Vec<u8> = stored.iter().flat_map(|v| v.to_le_bytes()).collect();
                let all = vec![true; len];
                let back = piece.load_bytes(&bytes, 4, &all);
                let back: Vec<u32> = back
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(back, values, "{shape:?} cut {dim}, flat {flat:?}");
                for k in 0..len {
                    let mut need = vec![false; len];
                    need[k] = true;
                    let held: Vec<u32> = piece
                        .stored_ranges(&need)
                        .into_iter()
                        .flat_map(|r| stored[r].to_vec())
                        .collect();
                    let want: Vec<u32> = flat
                        .clone()
                        .filter(|f| (f / inner) % len == k)
                        .map(|f| f as u32)
                        .collect();
                    assert_eq!(held, want, "{shape:?} cut {dim}, flat {flat:?}, index {k}");
                    let spans = (0..flat.len())
                        .filter(|&at| ((flat.start + at) / inner) % len == k)
                        .map(|at| (at, 1));
                    need[k] = !want.is_empty();
                    assert_eq!(piece.touched(spans), need, "{shape:?} {flat:?} {k}");
                }
            }
        }
    }
}

//! Token (and learned position) embedding lookup and its scatter-add gradient.

use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::MASKED_ID;

pub(crate) fn forward<T: Real>(
    threads: &Threads,
    ids: &[u32],
    table: &[T],
    dim: usize,
    out: &mut [T],
    acc: bool,
) {
    lookup(threads, ids, table.len(), dim, out, acc, |id, o| {
        let src = &table[id * dim..][..dim];
        if acc {
            o.iter_mut().zip(src).for_each(|(o, &s)| *o += s);
        } else {
            o.copy_from_slice(src);
        }
    });
}

/// [`forward`] from a bf16 table (the compute copy under bf16 mixed precision), rows widened.
pub(crate) fn forward_bf16(
    threads: &Threads,
    ids: &[u32],
    table: &[half::bf16],
    dim: usize,
    out: &mut [f32],
    acc: bool,
) {
    lookup(threads, ids, table.len(), dim, out, acc, |id, o| {
        let src = &table[id * dim..][..dim];
        if acc {
            o.iter_mut().zip(src).for_each(|(o, s)| *o += s.to_f32());
        } else {
            super::bf16_convert::widen_into(src, o);
        }
    });
}

/// Row `t` of `out` from row `ids[t]` of a table of `table_len` elements (`row`), or zero (or
/// unchanged, accumulating) for a masked id.
fn lookup<T: Real>(
    threads: &Threads,
    ids: &[u32],
    table_len: usize,
    dim: usize,
    out: &mut [T],
    acc: bool,
    row: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    let rows = table_len / dim.max(1);
    assert!(
        ids.iter().all(|&i| (i as usize) < rows || i == MASKED_ID),
        "embedding: id beyond the table"
    );
    threads.for_rows(out, dim, |t, o| {
        if ids[t] == MASKED_ID {
            if !acc {
                o.fill(T::ZERO);
            }
            return;
        }
        row(ids[t] as usize, o)
    });
}

pub(crate) fn backward_weight<T: Real>(ids: &[u32], dout: &[T], dim: usize, dtable: &mut [T]) {
    // Serial: ids repeat, and a fixed order keeps the sum deterministic.
    for (t, &id) in ids.iter().enumerate().filter(|&(_, &id)| id != MASKED_ID) {
        let dst = &mut dtable[id as usize * dim..][..dim];
        dst.iter_mut()
            .zip(&dout[t * dim..][..dim])
            .for_each(|(d, &g)| *d += g);
    }
}

//! Token (and learned position) embedding lookup and its scatter-add gradient.

use super::float::Real;
use super::{CpuBackend, MASKED_ID};

pub(crate) fn forward<T: Real>(
    be: &CpuBackend,
    ids: &[u32],
    table: &[T],
    dim: usize,
    out: &mut [T],
    acc: bool,
) {
    let rows = table.len() / dim.max(1);
    assert!(
        ids.iter().all(|&i| (i as usize) < rows || i == MASKED_ID),
        "embedding: id beyond the table"
    );
    be.for_rows(out, dim, |t, o| {
        if ids[t] == MASKED_ID {
            if !acc {
                o.fill(T::ZERO);
            }
            return;
        }
        let src = &table[ids[t] as usize * dim..][..dim];
        if acc {
            o.iter_mut().zip(src).for_each(|(o, &s)| *o += s);
        } else {
            o.copy_from_slice(src);
        }
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

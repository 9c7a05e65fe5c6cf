//! Token (and learned position) embedding lookup and its scatter-add gradient.

use super::CpuBackend;

impl CpuBackend {
    pub(crate) fn embedding_forward_impl(
        &self,
        ids: &[u32],
        table: &[f32],
        dim: usize,
        out: &mut [f32],
        acc: bool,
    ) {
        let rows = table.len() / dim.max(1);
        assert!(
            ids.iter().all(|&i| (i as usize) < rows),
            "embedding: id beyond the table"
        );
        self.for_rows(out, dim, |t, o| {
            let src = &table[ids[t] as usize * dim..][..dim];
            if acc {
                o.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            } else {
                o.copy_from_slice(src);
            }
        });
    }

    pub(crate) fn embedding_backward_weight_impl(
        &self,
        ids: &[u32],
        dout: &[f32],
        dim: usize,
        dtable: &mut [f32],
    ) {
        // Serial: ids repeat, and a fixed order keeps the sum deterministic.
        for (t, &id) in ids.iter().enumerate() {
            let dst = &mut dtable[id as usize * dim..][..dim];
            dst.iter_mut()
                .zip(&dout[t * dim..][..dim])
                .for_each(|(d, g)| *d += g);
        }
    }
}

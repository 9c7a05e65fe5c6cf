//! A right operand rounded and packed once for the many products that read parts of it: attention's
//! K, V, Q and dO of one head, which every tile of the head multiplies (packed per product, the
//! same head was laid out again for each of its tiles). The AVX512_BF16 path's panels of `NR`
//! columns, each over the operand's whole depth; a product reads the panels of its columns from the
//! pair of its first row on.

use super::avx512::{Avx512, NR};
use super::blocked::{aligned, rows_against, BPanels};
use super::pack::pack;
use super::{best_path, Operand, Path};
use crate::kernels::cpu::small_gemm::{Causal, PackedFrom};

/// `b[k×n]` packed for the AVX512_BF16 micro-kernel; see the module's doc.
pub(crate) struct PackedB {
    data: Vec<u32>,
    /// Where in `data` the panels start (its first cache line, as [`aligned`] gave it).
    start: usize,
    k: usize,
    n: usize,
    /// The view last laid out.
    source: PackedFrom,
}

impl PackedB {
    /// Whether products on packed right operands run here: the AVX512_BF16 path is this machine's
    /// fastest (AMX lays out its panels by tiles, and keeps packing per product).
    pub(crate) fn available() -> bool {
        best_path() == Path::Avx512Bf16
    }

    pub(crate) fn new() -> Self {
        Self {
            data: Vec::new(),
            start: 0,
            k: 0,
            n: 0,
            source: PackedFrom(None),
        }
    }

    /// Whether the last [`PackedB::pack`] laid out this very view ([`PackedFrom::holds`]).
    pub(crate) fn holds(&self, shape: (usize, usize), b: (*const f32, usize, usize)) -> bool {
        self.source.holds(shape, b)
    }

    /// The view last laid out, from row `row0` and column `col0` on: `(pointer, row stride,
    /// column stride)`, for a product its panels cannot serve.
    pub(crate) fn view_at(&self, row0: usize, col0: usize) -> (*const f32, usize, usize) {
        let (_, (at, rs, cs)) = self.source.0.expect("bf16 gemm: an empty packed operand");
        (
            (at as *const f32).wrapping_add(row0 * rs + col0 * cs),
            rs,
            cs,
        )
    }

    /// Lays out `b[k×n]`, element `(p, j)` at `b.0 + p·b.1 + j·b.2`, rounded to bf16, reusing this
    /// operand's buffer.
    ///
    /// # Safety
    /// Every element the view names lies inside its allocation; [`PackedB::available`] holds.
    pub(crate) unsafe fn pack(&mut self, (k, n): (usize, usize), b: (*const f32, usize, usize)) {
        (self.k, self.n) = (k, n);
        self.source.set((k, n), b);
        let kp = k.div_ceil(2);
        let len = n.div_ceil(NR) * kp * NR;
        let values = std::slice::from_raw_parts(b.0, crate::kernels::extent(k, n, b.1, b.2));
        let x = Operand::F32(values, b.1, b.2);
        let o = aligned(&mut self.data, len);
        let start = o.as_ptr() as usize;
        pack(x, b.2, b.1, 0, n, n, 0, k, kp, NR, o);
        self.start = (start - self.data.as_ptr() as usize) / std::mem::size_of::<u32>();
    }

    fn panels(&self) -> BPanels {
        BPanels {
            at: self.data[self.start..].as_ptr(),
            pairs: self.k.div_ceil(2),
        }
    }
}

/// `c[m×n] (+)= a[m×k]·b[row0.., col0..]` on this thread with `b` [packed](PackedB), operands
/// rounded to bf16 and products summed in f32, skipping what `mask` says tile by tile (as
/// [`super::gemm_into`]). Returns `false`, doing nothing, where the product does not start on a
/// panel (`col0` a multiple of `NR`, `row0` even) or would end inside a pair another row of `b`
/// fills: then the caller multiplies the view ([`PackedB::view_at`]).
///
/// # Safety
/// `c` must be valid for reads and writes of the `m × n` view with row stride `c_rs`, which no one
/// else touches meanwhile; `a` must lie inside its slice; the CPU runs the AVX512_BF16 path.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_packed_b(
    (m, n, k): (usize, usize, usize),
    a: Operand,
    (b, row0, col0): (&PackedB, usize, usize),
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
    mask: Causal,
) -> bool {
    assert!(
        row0 + k <= b.k && col0 + n <= b.n,
        "bf16 gemm: a product outside its packed operand"
    );
    let whole_pairs = k.is_multiple_of(2) || row0 + k == b.k;
    if !(row0.is_multiple_of(2) && col0.is_multiple_of(NR) && whole_pairs) || k == 0 {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    assert!(
        super::extent(m, k, a.strides()) <= a.len(),
        "bf16 gemm: lhs view out of bounds"
    );
    let whole = b.panels();
    let panels = BPanels {
        at: whole.at.add((col0 / NR * whole.pairs + row0 / 2) * NR),
        pairs: whole.pairs,
    };
    let kp = k.div_ceil(2);
    rows_against::<Avx512>(
        a,
        0..m,
        m,
        (0, kp, k),
        panels,
        (0, n, n),
        c,
        c_rs,
        accumulate,
        mask,
    );
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A product on part of a packed operand gives the bits of the same product packing that part
    /// itself ([`super::super::gemm_into`]): any panel's columns, any even row, depths odd at the
    /// operand's end, causal masks, accumulating or not; and a product off the panels' edges is
    /// refused, for the caller to run on the view.
    #[test]
    fn parts_of_a_packed_operand_multiply_as_the_parts_themselves() {
        if !PackedB::available() {
            eprintln!("not the AVX512_BF16 path here: nothing to test");
            return;
        }
        let (kb, nb) = (301, 200);
        let (b, _) = super::super::tests::random_operand(kb * nb, 21);
        let (a, _) = super::super::tests::random_operand(90 * 320, 22);
        let mut packed = PackedB::new();
        // SAFETY: the view is the whole of `b`; the path runs here (checked above).
        unsafe { packed.pack((kb, nb), (b.as_ptr(), nb, 1)) };
        assert!(packed.holds((kb, nb), (b.as_ptr(), nb, 1)));
        let masks = [
            Causal::None,
            Causal::Columns(3),
            Causal::DepthUpTo(5),
            Causal::DepthFrom(2),
        ];
        for &(m, n, k, row0, col0) in &[
            (37, 64, 64, 0, 0),
            (90, 200, 300, 0, 0),
            (28, 40, 101, 200, 96),
            (15, 168, 37, 264, 32),
        ] {
            for mask in masks {
                for accumulate in [false, true] {
                    let av = Operand::F32(&a, k, 1);
                    let init: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 * 0.25).collect();
                    let (mut got, mut want) = (init.clone(), init);
                    let view = Operand::F32(&b[row0 * nb + col0..], nb, 1);
                    // SAFETY: every view lies in its vector; `c` is the test's own.
                    unsafe {
                        let part = (&packed, row0, col0);
                        let ok = gemm_packed_b(
                            (m, n, k),
                            av,
                            part,
                            got.as_mut_ptr(),
                            n,
                            accumulate,
                            mask,
                        );
                        assert!(ok, "m {m} n {n} k {k} at ({row0}, {col0}) refused");
                        super::super::gemm_into(
                            m,
                            n,
                            k,
                            av,
                            view,
                            want.as_mut_ptr(),
                            n,
                            accumulate,
                            mask,
                        );
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "m {m} n {n} k {k} at ({row0}, {col0}) {mask:?} accumulate {accumulate}"
                    );
                }
            }
        }
        let mut c = vec![0f32; 8 * 32];
        for (k, row0, col0) in [(4, 1, 0), (4, 0, 16), (5, 0, 0)] {
            // SAFETY: as above; a refused product writes nothing.
            let ok = unsafe {
                let av = Operand::F32(&a, k, 1);
                gemm_packed_b(
                    (8, 32, k),
                    av,
                    (&packed, row0, col0),
                    c.as_mut_ptr(),
                    32,
                    false,
                    Causal::None,
                )
            };
            assert!(!ok, "k {k} at ({row0}, {col0}) is off the panels' edges");
        }
    }
}

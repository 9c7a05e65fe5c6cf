//! Operands packed before their products, on the AVX512_BF16 path:
//! - a right operand rounded and packed once for the many products that read parts of it:
//!   attention's K, V, Q and dO of one head, which every tile of the head multiplies (packed per
//!   product, the same head was laid out again for each of its tiles). Panels of `NR` columns,
//!   each over the operand's whole depth; a product reads the panels of its columns from the pair
//!   of its first row on;
//! - a left operand packed as the kernel that computes it writes it, a row or a depth pair at a
//!   time: attention's probabilities and score gradients, rounded and laid out while each row is
//!   still in L1 (packed per product, a tile larger than L2 was read back from L3 for each).

use super::avx512::{Avx512, MR, NR};
use super::blocked::{aligned, rows_against, APanels, BPanels, Left};
use super::pack::{pack, pack_depth_pair, round_row};
use super::{best_path, APanel, Operand, Path};
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

/// Pairs added to a row of a [`PackedA`] laid out row by row: its 14 rows, read together at each
/// pair, would otherwise lie a power of two apart (a 512-key tile's row is 1 KiB) and share a few
/// cache sets.
const ROW_PAD_PAIRS: usize = 16;

/// `a[m×k]` rounded to bf16 and laid out in the AVX512_BF16 micro-kernel's panels of `MR` rows
/// before its products ([`gemm_packed_ab`]), filled by the kernel that computes it: row by row
/// ([`PackedA::by_rows`], for a left operand whose rows are produced one at a time, such as
/// attention's P in P·V), or a depth pair at a time ([`PackedA::by_depth_pairs`], for the transpose
/// of such a tile, Pᵀ in Pᵀ·dO).
pub(crate) struct PackedA {
    data: Vec<u32>,
    /// Where in `data` the panels start (its first cache line, as [`aligned`] gave it).
    start: usize,
    m: usize,
    k: usize,
    layout: APanel,
    /// Pairs from one panel to the next.
    panel: usize,
}

impl PackedA {
    pub(crate) fn new() -> Self {
        Self {
            data: Vec::new(),
            start: 0,
            m: 0,
            k: 0,
            layout: APanel { row: 0, pair: 0 },
            panel: 0,
        }
    }

    /// Makes room for `m × k` (whole panels, reusing the buffer) laid out as `layout`, a panel
    /// `panel` pairs; the values are whatever the buffer held until set.
    fn lay_out(&mut self, (m, k): (usize, usize), layout: APanel, panel: usize) {
        assert!(
            PackedB::available(),
            "bf16 gemm: a packed left operand off the AVX512_BF16 path"
        );
        (self.m, self.k, self.layout, self.panel) = (m, k, layout, panel);
        let o = aligned(&mut self.data, m.div_ceil(MR) * panel);
        let start = o.as_ptr() as usize;
        self.start = (start - self.data.as_ptr() as usize) / std::mem::size_of::<u32>();
    }

    /// Lays out `m × k`, to be set row by row ([`PackedA::set_row`]).
    pub(crate) fn by_rows(&mut self, m: usize, k: usize) {
        let row = k.div_ceil(2) + ROW_PAD_PAIRS;
        self.lay_out((m, k), APanel { row, pair: 1 }, MR * row);
    }

    /// Row `i`: the `k` values of `row`, rounded.
    pub(crate) fn set_row(&mut self, i: usize, row: &[f32]) {
        assert!(
            self.layout.pair == 1 && i < self.m && row.len() == self.k,
            "bf16 gemm: row {i} of a packed left operand ({} × {})",
            self.m,
            self.k
        );
        let at = self.start + i * self.layout.row;
        let o = &mut self.data[at..at + self.k.div_ceil(2)];
        // SAFETY: `row` holds the k values read; the path runs here (checked when laid out).
        unsafe { round_row(Operand::F32(row, self.k, 1), 0, self.k, o) };
    }

    /// Row `i`'s values as bf16, for a kernel that rounds them itself: `k` rounded up to whole
    /// pairs (value `2j` the low half of pair `j`), every one to be written (a last odd value's
    /// pair holds zero above it).
    pub(crate) fn row_bf16_mut(&mut self, i: usize) -> &mut [u16] {
        assert!(
            self.layout.pair == 1 && i < self.m,
            "bf16 gemm: row {i} of a packed left operand ({} × {})",
            self.m,
            self.k
        );
        let at = self.start + i * self.layout.row;
        let pairs = &mut self.data[at..at + self.k.div_ceil(2)];
        // SAFETY: two u16 in each u32, less aligned; on little-endian x86-64 (the only CPUs with
        // this path) the first is the low half.
        unsafe { std::slice::from_raw_parts_mut(pairs.as_mut_ptr().cast(), 2 * pairs.len()) }
    }

    /// Lays out `m × k`, to be set a depth pair at a time ([`PackedA::set_depth_pair`]).
    pub(crate) fn by_depth_pairs(&mut self, m: usize, k: usize) {
        let kp = k.div_ceil(2);
        self.lay_out((m, k), APanel { row: 1, pair: MR }, MR * kp);
    }

    /// Depths `2p` and `2p + 1` of every row: `first` and `second` (`m` values each; no `second` at
    /// an odd depth's last pair), rounded.
    pub(crate) fn set_depth_pair(&mut self, p: usize, first: &[f32], second: Option<&[f32]>) {
        let kp = self.k.div_ceil(2);
        assert!(
            self.layout.pair == MR
                && p < kp
                && first.len() == self.m
                && second.is_some() == (2 * p + 1 < self.k),
            "bf16 gemm: depth pair {p} of a packed left operand ({} × {})",
            self.m,
            self.k
        );
        let o = &mut self.data[self.start..self.start + self.m.div_ceil(MR) * self.panel];
        // SAFETY: the lengths are checked there; the path runs here (checked when laid out).
        unsafe { pack_depth_pair((first, second), p, (kp, MR), o) };
    }

    fn panels(&self) -> APanels {
        APanels {
            at: self.data[self.start..].as_ptr(),
            panel: self.panel,
            layout: self.layout,
        }
    }
}

/// The panels of a [`PackedB`] a product on `k` of its rows from `row0` and its columns from
/// `col0` reads, or `None` where the product does not start on a panel (`col0` a multiple of
/// `NR`, `row0` even) or would end inside a pair another row of `b` fills.
fn panels_from(b: &PackedB, k: usize, n: usize, (row0, col0): (usize, usize)) -> Option<BPanels> {
    assert!(
        row0 + k <= b.k && col0 + n <= b.n,
        "bf16 gemm: a product outside its packed operand"
    );
    let whole_pairs = k.is_multiple_of(2) || row0 + k == b.k;
    if !(row0.is_multiple_of(2) && col0.is_multiple_of(NR) && whole_pairs) || k == 0 {
        return None;
    }
    let whole = b.panels();
    Some(BPanels {
        at: whole
            .at
            .wrapping_add((col0 / NR * whole.pairs + row0 / 2) * NR),
        pairs: whole.pairs,
    })
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
        super::extent(m, k, a.strides()) <= a.len(),
        "bf16 gemm: lhs view out of bounds"
    );
    against_packed_b(
        Left::View(a),
        (m, n, k),
        (b, row0, col0),
        c,
        c_rs,
        accumulate,
        mask,
    )
}

/// The product of [`gemm_packed_b`] and [`gemm_packed_ab`] once their left operand is checked.
///
/// # Safety
/// As [`gemm_packed_b`].
unsafe fn against_packed_b(
    a: Left,
    (m, n, k): (usize, usize, usize),
    (b, row0, col0): (&PackedB, usize, usize),
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
    mask: Causal,
) -> bool {
    let Some(panels) = panels_from(b, k, n, (row0, col0)) else {
        return false;
    };
    if m > 0 && n > 0 {
        let depth = (0, k.div_ceil(2), k);
        rows_against::<Avx512>(
            a,
            0..m,
            m,
            depth,
            panels,
            (0, n, n),
            c,
            c_rs,
            accumulate,
            mask,
        );
    }
    true
}

/// [`gemm_packed_b`] with `a` [packed](PackedA) too, all of it (its rows and depth are the
/// product's): the same products, in the same order, as `a` packed by the product itself. Returns
/// `false`, doing nothing, where `b`'s part is off its panels' edges (as [`gemm_packed_b`]).
///
/// # Safety
/// As [`gemm_packed_b`]; every row of `a` set since it was laid out.
pub(crate) unsafe fn gemm_packed_ab(
    (m, n, k): (usize, usize, usize),
    a: &PackedA,
    (b, row0, col0): (&PackedB, usize, usize),
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
    mask: Causal,
) -> bool {
    assert!(
        m == a.m && k == a.k,
        "bf16 gemm: a {m} × {k} product on a packed {} × {} left operand",
        a.m,
        a.k
    );
    let left = Left::Packed(a.panels());
    against_packed_b(left, (m, n, k), (b, row0, col0), c, c_rs, accumulate, mask)
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
    /// A left operand packed as it is made ([`PackedA`], row by row or a depth pair at a time)
    /// gives the bits of the same product packing the operand's view itself: odd rows and depths,
    /// causal masks, accumulating or not, a packed operand reused for a smaller product; and
    /// denormal and tiny values among them (attention's probabilities far below the row's
    /// maximum), which the rounding must treat alike.
    #[test]
    fn left_operands_packed_as_made_multiply_as_their_views() {
        if !PackedB::available() {
            eprintln!("not the AVX512_BF16 path here: nothing to test");
            return;
        }
        let (b, _) = super::super::tests::random_operand(301 * 96, 31);
        let mut packed_b = PackedB::new();
        let masks = [
            Causal::None,
            Causal::Columns(3),
            Causal::DepthUpTo(5),
            Causal::DepthFrom(2),
        ];
        let (mut rows, mut pairs) = (PackedA::new(), PackedA::new());
        for &(m, n, k) in &[(256, 96, 301), (37, 64, 64), (15, 32, 33), (3, 96, 1)] {
            // `a` (m × k) row-major, its transpose `at` (k × m) row-major.
            let (mut a, _) = super::super::tests::random_operand(m * k, 32 + m as u64);
            for (i, x) in a.iter_mut().enumerate().step_by(7) {
                *x *= [1e-39, 1e-41, 3e-30][i % 3];
            }
            let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            // SAFETY: the view lies in `b`; the path runs here (checked above).
            unsafe { packed_b.pack((k, n), (b.as_ptr(), n, 1)) };
            rows.by_rows(m, k);
            for i in 0..m {
                rows.set_row(i, &a[i * k..(i + 1) * k]);
            }
            pairs.by_depth_pairs(m, k);
            for p in 0..k.div_ceil(2) {
                let second = (2 * p + 1 < k).then(|| &at[(2 * p + 1) * m..(2 * p + 2) * m]);
                pairs.set_depth_pair(p, &at[2 * p * m..(2 * p + 1) * m], second);
            }
            for mask in masks {
                for accumulate in [false, true] {
                    let init: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 * 0.5).collect();
                    let mut want = init.clone();
                    // SAFETY: every view lies in its vector; `c` is the test's own.
                    unsafe {
                        let (c, b) = (want.as_mut_ptr(), (&packed_b, 0, 0));
                        let view = Operand::F32(&a, k, 1);
                        assert!(gemm_packed_b((m, n, k), view, b, c, n, accumulate, mask));
                    }
                    for (name, packed) in [("rows", &rows), ("depth pairs", &pairs)] {
                        let mut got = init.clone();
                        // SAFETY: as above; every row of `packed` is set.
                        let ok = unsafe {
                            let (c, b) = (got.as_mut_ptr(), (&packed_b, 0, 0));
                            gemm_packed_ab((m, n, k), packed, b, c, n, accumulate, mask)
                        };
                        assert!(ok, "{name}: m {m} n {n} k {k} refused");
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert!(
                            bits(&got) == bits(&want),
                            "{name}: m {m} n {n} k {k} {mask:?} accumulate {accumulate}"
                        );
                    }
                }
            }
        }
    }
}

//! The AVX512_BF16 path (Zen 4/5, Cooper Lake and later Xeons): its blocking and its `MR × NR`
//! micro-kernel of `vdpbf16ps`, 28 accumulators held in registers down k.

use super::pack::{pack, pack_rows};
use super::{APanel, Operand, Tiles};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of a micro-tile (one broadcast pair each).
pub(super) const MR: usize = 14;

/// Columns of a micro-tile (two vectors of 16 lanes).
pub(super) const NR: usize = 32;

/// Rows of `a` packed at a time (a multiple of `MR`; the packed block stays in L2).
pub(super) const MC: usize = MR * 10;

/// Columns of `b` packed at a time (a multiple of `NR`).
pub(super) const NC: usize = NR * 32;

/// Most k-pairs packed at a time. The A panel (14 rows × 512 pairs, 28 KiB) stays in L1 while
/// the B panels stream past it from L2; C is read and written once per block of k, so deeper
/// blocks move less of it (256 pairs measured 8–10% slower on the 2048³ product, 128 slower still,
/// 1024 no faster).
pub(super) const MAX_KC_PAIRS: usize = 512;

/// The AVX512_BF16 path.
pub(super) struct Avx512;

impl Tiles for Avx512 {
    const MR: usize = MR;
    const NR: usize = NR;
    const MC: usize = MC;
    const NC: usize = NC;
    /// One A panel runs along its row of C blocks, the panel resident in L1 (the other order, a B
    /// panel against every A panel of the block, measured 3–5% slower).
    const A_PANEL_OUTER: bool = true;
    fn block_pairs(kpairs: usize) -> usize {
        kpairs.div_ceil(kpairs.div_ceil(MAX_KC_PAIRS))
    }
    /// Row by row where k is contiguous (activations, attention's probabilities and scores: each
    /// row rounded in place of a 16 × 16 transposition per 32 values, the micro-kernel's
    /// broadcasts reading 14 rows' runs instead of one), pair by pair otherwise.
    fn a_panel(a: Operand, kp: usize) -> APanel {
        if a.strides().1 == 1 {
            APanel { row: kp, pair: 1 }
        } else {
            APanel { row: 1, pair: MR }
        }
    }
    fn pack_a(
        a: Operand,
        t0: usize,
        rows: usize,
        tn: usize,
        k0: usize,
        kn: usize,
        kp: usize,
        out: &mut [u32],
    ) {
        let (rs, cs) = a.strides();
        if Self::a_panel(a, kp).pair == 1 {
            pack_rows(a, rs, t0, rows, tn, k0, kn, kp, out);
        } else {
            pack(a, rs, cs, t0, rows, tn, k0, kn, kp, MR, out);
        }
    }
    /// Masked stores: attention's blocks of 64 rows end in a part panel every time.
    const PART_BLOCKS: bool = true;
    /// Panels are `[pair][MR]` and `[pair][NR]`: pairs `s..e` are a run of each.
    const DEPTH_RANGES: bool = true;
    /// Measured on Zen 4: 14% fewer elements packed a step, the step no slower (the AMX path keeps
    /// a packing per thread: sharing measured 2–18% slower on its host, see docs/performance.md).
    const SHARED_B: bool = true;
    unsafe fn micro(
        kp: usize,
        a: *const u32,
        a_panel: APanel,
        b: *const u32,
        c: *mut f32,
        c_rs: usize,
        add: bool,
        rows: usize,
        cols: usize,
    ) {
        if a_panel.pair == 1 {
            micro_kernel::<true>(kp, (a, a_panel.row), b, c, c_rs, add, rows, cols)
        } else {
            micro_kernel::<false>(kp, (a, 0), b, c, c_rs, add, rows, cols)
        }
    }
}

/// `c[MR×NR] (+)= a_panel · b_panel` over `kp` k-pairs, of which the first `rows × cols` are
/// stored (masked stores: nothing outside them is touched). The panel of `a` is row by row
/// (`ROWS`: row `r` from `a + r·a_rs`) or pair by pair (`[pair][MR]`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn micro_kernel<const ROWS: bool>(
    kp: usize,
    (a, a_rs): (*const u32, usize),
    b: *const u32,
    c: *mut f32,
    c_rs: usize,
    add: bool,
    rows: usize,
    cols: usize,
) {
    // The block of c is read (or written) only after the whole depth: asked for now, its lines
    // (rows a row stride apart, which the prefetchers do not follow) arrive meanwhile. Measured
    // 4–6% faster GEMMs; prefetching the B panel ahead as well added nothing.
    for r in 0..rows {
        let row = c.wrapping_add(r * c_rs);
        _mm_prefetch::<_MM_HINT_T0>(row as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(16) as *const i8);
    }
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kp {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
        for (r, acc) in acc.iter_mut().enumerate() {
            let at = if ROWS {
                a.add(r * a_rs + p)
            } else {
                a.add(p * MR + r)
            };
            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(*at as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], pair, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], pair, b1);
        }
    }
    let lanes = |n: usize| ((1u32 << n.min(16)) - 1) as __mmask16;
    let (m0, m1) = (lanes(cols), lanes(cols.saturating_sub(16)));
    // Masked lanes are neither read nor written (nor fault); a row's second half may lie past `c`
    // when it is masked off entirely, hence the wrapping address.
    for (r, acc) in acc.iter().enumerate() {
        if r == rows {
            break;
        }
        let row = c.wrapping_add(r * c_rs);
        let (mut v0, mut v1) = (acc[0], acc[1]);
        if add {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, row));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, row.wrapping_add(16)));
        }
        _mm512_mask_storeu_ps(row, m0, v0);
        _mm512_mask_storeu_ps(row.wrapping_add(16), m1, v1);
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn micro_kernel<const ROWS: bool>(
    _: usize,
    _: (*const u32, usize),
    _: *const u32,
    _: *mut f32,
    _: usize,
    _: bool,
    _: usize,
    _: usize,
) {
    unreachable!("available() is false off x86_64")
}

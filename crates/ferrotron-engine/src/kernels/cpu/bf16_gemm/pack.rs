//! Packing: blocks of an operand rounded to bf16 and laid out as k-pairs in the panels a path's
//! micro-kernel reads — where k is contiguous 16 rows × 16 pairs at a time transposed in
//! registers, where the rows are pair by pair across the block's width — with the padding zeroed.

use super::Operand;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Writes the panels of rows `t0..t0 + rows` of an operand over all of `o`, `w` rows a panel (the
/// last one zero-padded), each `kp` k-pairs deep and laid out `[pair][w]`: element `(p, t)` of a
/// panel holds the bf16 bits of `x(t, k0 + 2p)` (low half) and `x(t, k0 + 2p + 1)` (high half) for
/// its row `t`, where `x(t, kk)` is the operand's element at `t·ts + kk·ks`; zero beyond `tn` and
/// `kn`.
///
/// The whole block is packed in one pass rather than panel by panel, so that the source is read in
/// long runs: where k is contiguous, 16 rows × 16 pairs at a time, transposed in registers; where
/// the rows are, pair by pair across the block's full width.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack(
    x: Operand,
    ts: usize,
    ks: usize,
    t0: usize,
    rows: usize,
    tn: usize,
    k0: usize,
    kn: usize,
    kp: usize,
    w: usize,
    o: &mut [u32],
) {
    assert_eq!(
        o.len(),
        rows.div_ceil(w) * kp * w,
        "bf16 gemm: packed block's size"
    );
    let tmax = tn.saturating_sub(t0).min(rows);
    let kmax = kn.saturating_sub(k0).min(2 * kp);
    let row_at = |t: usize| (t / w) * kp * w + t % w;
    let at = |p: usize, t: usize| row_at(t) + p * w;
    // SAFETY (both fast paths): the caller checked the view; `available()` holds on this path.
    if ks == 1 {
        unsafe { pack_along_k(x, ts, t0, tmax, k0, kmax, kp, w, o) };
    } else if ts == 1 {
        unsafe { pack_across_k(x, ks, t0, tmax, k0, kmax, row_at, |p| p * w, 1, w, o) };
    } else {
        for p in 0..kmax.div_ceil(2) {
            for t in 0..tmax {
                let at_k = |kk: usize| (t0 + t) * ts + (k0 + kk) * ks;
                let lo = x.bits(at_k(2 * p)) as u32;
                let hi = if 2 * p + 1 < kmax {
                    x.bits(at_k(2 * p + 1)) as u32
                } else {
                    0
                };
                o[at(p, t)] = lo | hi << 16;
            }
        }
    }
    zero_padding(o, rows.div_ceil(w) * w, tmax, kp, kmax.div_ceil(2), at);
}

/// Writes the panels of rows `t0..t0 + rows` of an operand whose k is contiguous (row stride `ts`)
/// over all of `o` (panels of rows, the last one zero-padded), each `kp` k-pairs deep and laid
/// out row by row (`[rows][kp]`): pair `p` of row `t` of a panel at `t·kp + p` holds `x(t, k0 + 2p)`
/// (low half) and `x(t, k0 + 2p + 1)`; zero beyond `tn` and `kn`. Each row is 32 values rounded
/// and stored at a time, nothing transposed.
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_rows(
    x: Operand,
    ts: usize,
    t0: usize,
    rows: usize,
    tn: usize,
    k0: usize,
    kn: usize,
    kp: usize,
    o: &mut [u32],
) {
    if kp == 0 {
        return;
    }
    // Panels of rows one after the other are rows one after the other: row `t` at `t·kp`.
    let padded_rows = o.len() / kp;
    assert!(
        o.len() == padded_rows * kp && padded_rows >= rows,
        "bf16 gemm: packed block's size"
    );
    let tmax = tn.saturating_sub(t0).min(rows);
    let kmax = kn.saturating_sub(k0).min(2 * kp);
    let pairs = kmax.div_ceil(2);
    for t in 0..padded_rows {
        let row = &mut o[t * kp..(t + 1) * kp];
        if t >= tmax {
            row.fill(0);
            continue;
        }
        // SAFETY: the caller checked the view; `available()` holds on this path.
        unsafe { round_row(x, (t0 + t) * ts + k0, kmax, &mut row[..pairs]) };
        row[pairs..].fill(0);
    }
}

/// `kmax` consecutive values from `start`, rounded to bf16, as `kmax.div_ceil(2)` pairs over all of
/// `o` (a last odd value pairs with zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn round_row(x: Operand, start: usize, kmax: usize, o: &mut [u32]) {
    for (i, run) in o.chunks_mut(16).enumerate() {
        let values = (kmax - 32 * i).min(32);
        let v = load_pairs(x, start + 32 * i, values);
        let mask = ((1u32 << run.len()) - 1) as __mmask16;
        _mm512_mask_storeu_epi32(run.as_mut_ptr().cast(), mask, v);
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn round_row(_: Operand, _: usize, _: usize, _: &mut [u32]) {
    unreachable!("available() is false off x86_64")
}

/// Zeroes what a packing leaves unwritten in a block of `rows` padded rows × `kp` pairs, pair `p` of
/// row `t` at `at(p, t)`: the rows from `tmax` on and the pairs from `pairs` on (the buffers are
/// reused, not cleared: zero pairs add nothing, and the padded rows' results are never stored).
pub(super) fn zero_padding(
    o: &mut [u32],
    rows: usize,
    tmax: usize,
    kp: usize,
    pairs: usize,
    at: impl Fn(usize, usize) -> usize,
) {
    for p in 0..kp {
        let first = if p < pairs { tmax } else { 0 };
        for t in first..rows {
            o[at(p, t)] = 0;
        }
    }
}

/// [`pack`] where k is contiguous (a row of the operand is a run of memory): 16 rows of a panel
/// and 16 pairs of each at a time (32 values of a row, rounded in one conversion), transposed in
/// registers into 16 vectors of one pair each and stored as runs. (Scattering each row's pairs `w`
/// apart instead costs a scatter per 16 values, several times slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_along_k(
    x: Operand,
    ts: usize,
    t0: usize,
    tmax: usize,
    k0: usize,
    kmax: usize,
    kp: usize,
    w: usize,
    o: &mut [u32],
) {
    let pairs = kmax.div_ceil(2);
    for panel in (0..tmax).step_by(w) {
        for g in (panel..(panel + w).min(tmax)).step_by(16) {
            let lanes = 16.min(panel + w - g).min(tmax - g);
            // The next group's rows, while this one's are transposed.
            for r in g + 16..(g + 32).min(tmax) {
                prefetch(x, (t0 + r) * ts + k0, kmax);
            }
            let lane_mask: __mmask16 = (((1u32 << lanes) - 1) & 0xffff) as u16;
            // Where pair `p` of this group's first row lies.
            let first = |p: usize| (panel / w) * kp * w + p * w + (g - panel);
            for pc in (0..pairs).step_by(16) {
                let values = (kmax - 2 * pc).min(32);
                let mut v = [_mm512_setzero_si512(); 16];
                for (r, v) in v.iter_mut().enumerate().take(lanes) {
                    *v = load_pairs(x, (t0 + g + r) * ts + k0 + 2 * pc, values);
                }
                transpose_16x16(&mut v);
                let np = 16.min(pairs - pc);
                // The stores are raw: their last lane is checked against `o`.
                assert!(
                    first(pc + np - 1) + lanes <= o.len(),
                    "bf16 gemm: packed panel out of bounds"
                );
                for (j, v) in v.iter().enumerate().take(np) {
                    _mm512_mask_storeu_epi32(
                        o.as_mut_ptr().add(first(pc + j)).cast(),
                        lane_mask,
                        *v,
                    );
                }
            }
        }
    }
}

/// `values` (at most 32) consecutive elements from `start`, rounded to bf16, as 16 pairs; zero
/// past them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn load_pairs(x: Operand, start: usize, values: usize) -> __m512i {
    match x {
        Operand::F32(s, ..) => {
            let p = s.as_ptr().add(start);
            let (lo, hi) = if values == 32 {
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            } else {
                // Masked lanes are not read; the second half's address may lie past the operand
                // when all of it is masked, hence the wrapping address.
                let mask = |n: usize| ((1u32 << n.min(16)) - 1) as __mmask16;
                (
                    _mm512_maskz_loadu_ps(mask(values), p),
                    _mm512_maskz_loadu_ps(mask(values.saturating_sub(16)), p.wrapping_add(16)),
                )
            };
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
        }
        Operand::Bf16(s, ..) => {
            let mask: __mmask32 = if values == 32 {
                u32::MAX
            } else {
                (1u32 << values) - 1
            };
            _mm512_maskz_loadu_epi16(mask, s.as_ptr().add(start).cast())
        }
    }
}

/// Transposes 16 vectors of 16 dwords: afterwards `v[c]` lane `r` is what `v[r]` lane `c` was.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_16x16(v: &mut [__m512i; 16]) {
    // Within 128-bit lanes: pairs of rows interleaved by dwords, then by qwords, so that vector
    // `4i + j` holds rows 4i..4i+4 of columns j, 4 + j, 8 + j, 12 + j (one column per lane)…
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for i in 0..4 {
        v[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        v[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        v[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // …then the 128-bit lanes of each column's four vectors transposed.
    for j in 0..4 {
        let (u0, u1, u2, u3) = (v[j], v[4 + j], v[8 + j], v[12 + j]);
        let a = _mm512_shuffle_i32x4::<0x44>(u0, u1);
        let b = _mm512_shuffle_i32x4::<0xee>(u0, u1);
        let c = _mm512_shuffle_i32x4::<0x44>(u2, u3);
        let d = _mm512_shuffle_i32x4::<0xee>(u2, u3);
        t[j] = _mm512_shuffle_i32x4::<0x88>(a, c);
        t[4 + j] = _mm512_shuffle_i32x4::<0xdd>(a, c);
        t[8 + j] = _mm512_shuffle_i32x4::<0x88>(b, d);
        t[12 + j] = _mm512_shuffle_i32x4::<0xdd>(b, d);
    }
    *v = t;
}

/// [`pack`] where the panel's width is contiguous and k strided (two rows make a pair): pair by
/// pair, each pair's two source rows read in runs across the whole block, 16 values of each
/// converted, interleaved and stored as 16 pairs. Pair `p` of panel rows `t..t + 16` lands from
/// `o[row_at(t) + pair_at(p)]`, `lanes_apart` apart (1: a run; the AMX tiles: one tile row
/// apart); a run of 16 never crosses a multiple of `segment` (where `row_at` jumps: a panel's or a
/// tile's edge). The offsets are separable so that the address arithmetic (divisions by a
/// panel's width) is done once per run of rows, not once per store. `o` is zero where nothing is
/// stored.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_across_k(
    x: Operand,
    ks: usize,
    t0: usize,
    tmax: usize,
    k0: usize,
    kmax: usize,
    row_at: impl Fn(usize) -> usize,
    pair_at: impl Fn(usize) -> usize,
    lanes_apart: usize,
    segment: usize,
    o: &mut [u32],
) {
    let scatter = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lanes_apart as i32),
    );
    // The runs of rows: (first row, rows, where its pair 0 lands, lane mask).
    let mut runs = Vec::with_capacity(tmax.div_ceil(16) + tmax.div_ceil(segment));
    let mut t = 0;
    while t < tmax {
        let left = (tmax - t).min(16).min(segment - t % segment);
        runs.push((t, left, row_at(t), ((1u32 << left) - 1) as __mmask16));
        t += left;
    }
    let pairs = kmax.div_ceil(2);
    if pairs == 0 {
        return;
    }
    // The stores are raw: each run's furthest lane at the last pair (the offsets grow with the
    // pair) is checked against `o`.
    let last = pair_at(pairs - 1);
    assert!(
        runs.iter()
            .all(|&(_, left, at, _)| at + last + (left - 1) * lanes_apart < o.len()),
        "bf16 gemm: packed panel out of bounds"
    );
    for p in 0..pairs {
        let r0 = (k0 + 2 * p) * ks + t0;
        // Rows some pairs ahead: where k is a token-major tensor's rows (a head of V or dO),
        // each pair's rows lie a whole row of the tensor apart.
        if 2 * (p + PAIRS_AHEAD) + 1 < kmax {
            let ahead = r0 + 2 * PAIRS_AHEAD * ks;
            prefetch(x, ahead, tmax);
            prefetch(x, ahead + ks, tmax);
        }
        let second = 2 * p + 1 < kmax;
        let r1 = if second { r0 + ks } else { r0 };
        let pair = pair_at(p);
        for &(t, _, at, mask) in &runs {
            let v = match x {
                Operand::F32(s, ..) => {
                    let a = _mm512_maskz_loadu_ps(mask, s.as_ptr().add(r0 + t));
                    let b = if second {
                        _mm512_maskz_loadu_ps(mask, s.as_ptr().add(r1 + t))
                    } else {
                        _mm512_setzero_ps()
                    };
                    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a))
                }
                Operand::Bf16(s, ..) => {
                    let a = _mm256_maskz_loadu_epi16(mask, s.as_ptr().add(r0 + t).cast());
                    let b = if second {
                        _mm256_maskz_loadu_epi16(mask, s.as_ptr().add(r1 + t).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
                }
            };
            let v = interleaved(v);
            let dst = o.as_mut_ptr().add(at + pair);
            if lanes_apart == 1 {
                _mm512_mask_storeu_epi32(dst.cast(), mask, v);
            } else {
                _mm512_mask_i32scatter_epi32::<4>(dst.cast(), mask, scatter, v);
            }
        }
    }
}

/// Pairs of rows [`pack_across_k`] asks for ahead of the one in hand.
const PAIRS_AHEAD: usize = 4;

/// Runs of an operand's rows this long or shorter are asked for ahead of their packing: a head of a
/// token-major tensor (64–128 values every few KiB), which the hardware prefetchers do not follow.
/// Longer runs (a linear layer's rows) they do, and asking would only add instructions.
const SHORT_RUN: usize = 256;

/// Asks for `len` elements of an operand from `at` ahead of their packing ([`simd::prefetch`]),
/// where they are a [short run](SHORT_RUN).
fn prefetch(x: Operand, at: usize, len: usize) {
    if len > SHORT_RUN {
        return;
    }
    use crate::kernels::simd;
    match x {
        Operand::F32(v, ..) => simd::prefetch(v.as_ptr().wrapping_add(at), len, false),
        Operand::Bf16(v, ..) => simd::prefetch(v.as_ptr().wrapping_add(at), len, false),
    }
}

/// 16 bf16 values of one row (the low half of `v`) and 16 of the next (the high half) as 16 pairs:
/// `[a0..a16, b0..b16]` → `[a0, b0, a1, b1, …]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn interleaved(v: __m512i) -> __m512i {
    let order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    _mm512_permutexvar_epi16(order, v)
}

/// Pair `p` of every row of a block of panels `w` rows wide and `kp` pairs deep (`[panel][pair][w]`,
/// as [`pack`] lays them out): row `t`'s pair holds `first[t]` (low half) and `second[t]`, rounded
/// to bf16 (zero without `second`), for the `first.len()` rows. One depth pair of a left operand
/// whose depth is produced a row at a time (attention's probabilities, as the left operand Pᵀ):
/// packed while those two rows are still in L1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn pack_depth_pair(
    (first, second): (&[f32], Option<&[f32]>),
    p: usize,
    (kp, w): (usize, usize),
    o: &mut [u32],
) {
    let t_end = first.len();
    assert!(
        second.is_none_or(|s| s.len() == t_end) && p < kp && w <= 16,
        "bf16 gemm: a depth pair's rows"
    );
    assert!(
        t_end.div_ceil(w) * kp * w <= o.len(),
        "bf16 gemm: packed panel out of bounds"
    );
    // Each panel's `w` rows are one run (a panel is at most 16 wide).
    let mut at = p * w;
    for t in (0..t_end).step_by(w) {
        let mask = ((1u32 << w.min(t_end - t)) - 1) as __mmask16;
        let lo = _mm512_maskz_loadu_ps(mask, first.as_ptr().add(t));
        let hi = match second {
            Some(s) => _mm512_maskz_loadu_ps(mask, s.as_ptr().add(t)),
            None => _mm512_setzero_ps(),
        };
        let halves = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_mask_storeu_epi32(o.as_mut_ptr().add(at).cast(), mask, interleaved(halves));
        at += kp * w;
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn pack_depth_pair(
    _: (&[f32], Option<&[f32]>),
    _: usize,
    _: (usize, usize),
    _: &mut [u32],
) {
    unreachable!("available() is false off x86_64")
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_along_k(
    _: Operand,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: &mut [u32],
) {
    unreachable!("available() is false off x86_64")
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_across_k(
    _: Operand,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: usize,
    _: impl Fn(usize) -> usize,
    _: impl Fn(usize) -> usize,
    _: usize,
    _: usize,
    _: &mut [u32],
) {
    unreachable!("available() is false off x86_64")
}

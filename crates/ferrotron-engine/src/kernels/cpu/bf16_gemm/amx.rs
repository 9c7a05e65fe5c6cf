//! The AMX-BF16 path: a 32×16 block of `c` in two f32 accumulator tiles (tmm0–1), two tiles of
//! `a` (tmm4–5: 16 rows × 16 k-pairs each) and one of `b` (tmm6: 16 k-pairs × 16 columns) per 32
//! values of k, two `tdpbf16ps` between the loads.
//!
//! Why two accumulators and five tiles, not the four accumulators of a 32×32 block: on this VM's
//! cores (shared with other tenants), whenever the core's tile unit is busy elsewhere `tdpbf16ps`
//! into four independent accumulators runs at half the rate of the same instructions into one or
//! two (0.97 against 1.98 TFLOP/s, one core, no loads), and a kernel in L1 slows with the tiles it
//! holds (32×32 at 25% of the one-accumulator rate, 32×16 at 49%); when the unit is free every
//! arrangement runs at the full rate. The operand traffic per product is the same for both blocks
//! (half a KiB of `b` from L2 per `tdpbf16ps`, the A panel resident in L1).
//!
//! `b` is packed `[pair][16 columns]`, so a tile of it is 1 KiB of consecutive lines. `a` is packed
//! tile by tile, `[kp / 16 steps][2 halves of 16 rows][16 rows][16 pairs]`: each tile is 1 KiB of
//! consecutive lines too, so a panel is read front to back (rows of k-pairs one panel depth apart
//! put the 16 lines of a tile in a few L1 sets). Depths are padded to whole tiles with zero pairs,
//! which add nothing.
//!
//! The tile registers are not known to the compiler, so nothing but this file touches them; each
//! call configures them and releases them before it returns.

use super::pack::pack;
use super::{Operand, Tiles};
use std::arch::asm;

/// Rows of a micro-tile (two accumulator tiles down).
const MR: usize = 32;
/// Columns of a micro-tile (one accumulator tile across).
const NR: usize = 16;
/// Rows of `a` packed at a time (the block stays in L2).
const MC: usize = MR * 8;
/// Columns of `b` packed at a time (512 measured no faster).
const NC: usize = NR * 64;
/// k-pairs packed at a time (the A panel: 32 KiB, resident in L1; 128, 192, 384 and 512 measured no
/// faster).
const KC_PAIRS: usize = 256;
/// k-pairs in one tile row.
const TILE_PAIRS: usize = 16;

/// Asks Linux for the tile state (once per process); whether AMX-BF16 may be used.
pub(super) fn request() -> bool {
    // CPUID.(7,0):EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
    // SAFETY: cpuid is present on every x86_64 CPU.
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain Linux system call with two integer arguments; it changes only whether this
    // process may use the tile state.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// The tile configuration: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut bytes_per_row = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        bytes_per_row[t] = 64;
        rows[t] = 16;
        t += 1;
    }
    TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row,
        rows,
    }
};

/// The AMX path of [`super::serial`].
pub(super) struct Amx;

impl Tiles for Amx {
    const MR: usize = MR;
    const NR: usize = NR;
    const MC: usize = MC;
    const NC: usize = NC;
    /// One A panel's blocks of `c` run along its rows: consecutive tile stores fill neighbouring
    /// lines of the same rows (down a column of blocks, each lands 32 rows further on).
    const A_PANEL_OUTER: bool = true;
    /// Blocks of equal depth, each a whole number of tiles.
    fn block_pairs(kpairs: usize) -> usize {
        let blocks = kpairs.div_ceil(KC_PAIRS);
        kpairs.div_ceil(blocks).div_ceil(TILE_PAIRS) * TILE_PAIRS
    }
    /// Depths are padded to whole tiles with zero pairs, which add nothing.
    fn padded(kp: usize) -> usize {
        kp.div_ceil(TILE_PAIRS) * TILE_PAIRS
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
        let tmax = tn.saturating_sub(t0).min(rows);
        let kmax = kn.saturating_sub(k0).min(2 * kp);
        // tile_index(p, t) = tile_index(0, t) + tile_index(p, 0): separable, as the packer
        // wants it (a test below checks it).
        let row_at = |t: usize| (t / MR) * MR * kp + tile_index(0, t % MR);
        let pair_at = |p: usize| tile_index(p, 0);
        if rs == 1 {
            // The rows contiguous (the weight gradient's dyᵀ): pair by pair across the whole
            // block, so that each pair's two source rows are read in runs of the block's width (a
            // panel at a time reads 128 bytes of each of `2 · kp` rows, which the prefetchers do
            // not follow), 16 rows converted at a time and scattered one tile row apart.
            // SAFETY: the caller checked the view; AVX512_BF16 is present where AMX is.
            unsafe {
                super::pack::pack_across_k(
                    a, cs, t0, tmax, k0, kmax, row_at, pair_at, TILE_PAIRS, 16, out,
                )
            };
        } else {
            for (ir, o) in out.chunks_exact_mut(MR * kp).enumerate() {
                pack_rows(a, t0 + ir * MR, tn, k0, kn, kp, o);
            }
        }
        let at = |p: usize, t: usize| row_at(t) + pair_at(p);
        super::pack::zero_padding(out, rows.div_ceil(MR) * MR, tmax, kp, kmax.div_ceil(2), at);
    }
    unsafe fn begin() {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
    }
    unsafe fn end() {
        asm!("tilerelease", options(nostack, nomem));
    }
    /// Whole blocks only (tile stores have no masks; part blocks go through a scratch tile).
    unsafe fn micro(
        kp: usize,
        a: *const u32,
        _: super::APanel,
        b: *const u32,
        c: *mut f32,
        c_rs: usize,
        add: bool,
        rows: usize,
        cols: usize,
    ) {
        debug_assert!(
            rows == MR && cols == NR,
            "AMX: a part block reached the tiles"
        );
        micro_kernel(kp, a, b, c, c_rs, add)
    }
}

/// A tile-sized buffer, aligned for tile loads.
#[repr(C, align(64))]
struct Tile([f32; 16 * 16]);

/// Values of a tile: 16 rows × 16 pairs.
const TILE: usize = 16 * TILE_PAIRS;

/// Where pair `p` of row `t` of a panel lies in the tile-by-tile layout.
fn tile_index(p: usize, t: usize) -> usize {
    (p / TILE_PAIRS) * 2 * TILE + (t / 16) * TILE + (t % 16) * TILE_PAIRS + p % TILE_PAIRS
}

/// Writes `MR` rows of `a` from row `t0`, tile by tile (see the module's doc), over `o`: pair `p`
/// of row `t` holds `a(t0 + t, k0 + 2p)` (low half) and `a(t0 + t, k0 + 2p + 1)`, for the rows
/// before `tn` and the pairs before `kn` (the caller zeroes the rest). `kp` is a whole number of
/// tiles.
fn pack_rows(a: Operand, t0: usize, tn: usize, k0: usize, kn: usize, kp: usize, o: &mut [u32]) {
    let (rs, cs) = a.strides();
    if cs == 1 {
        // k contiguous: each row's 16 pairs of a tile are 32 consecutive values, once rounded.
        let tmax = tn.saturating_sub(t0).min(MR);
        let kmax = kn.saturating_sub(k0).min(2 * kp);
        for t in 0..tmax {
            let start = (t0 + t) * rs + k0;
            // SAFETY: the caller checked the view; AVX512_BF16 is present where AMX is.
            unsafe { round_pairs(a, start, kmax, &mut o[tile_index(0, t)..]) };
        }
        return;
    }
    // k strided: pack as the other panels (pair-major), then place each pair in its tile.
    let mut pair_major = vec![0; MR * kp];
    pack(a, rs, cs, t0, MR, tn, k0, kn, kp, MR, &mut pair_major);
    for p in 0..kp {
        for t in 0..MR {
            o[tile_index(p, t)] = pair_major[p * MR + t];
        }
    }
}

/// `kmax` values of a k-contiguous row from `start`, rounded, as pairs into one row of a panel's
/// tiles from its first (`o` starts there; 16 pairs to a tile row, tiles of a row `2 · TILE` apart;
/// the pairs past them are the caller's to zero).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn round_pairs(x: Operand, start: usize, kmax: usize, o: &mut [u32]) {
    use std::arch::x86_64::*;
    let at = |kk: usize| (kk / 2 / TILE_PAIRS) * 2 * TILE + kk / 2 % TILE_PAIRS;
    let mut kk = 0;
    while kk + 32 <= kmax {
        let v = match x {
            Operand::F32(s, ..) => {
                let p = s.as_ptr().add(start + kk);
                let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
            }
            Operand::Bf16(s, ..) => _mm512_loadu_si512(s.as_ptr().add(start + kk).cast()),
        };
        let row = &mut o[at(kk)..at(kk) + TILE_PAIRS];
        _mm512_storeu_si512(row.as_mut_ptr().cast(), v);
        kk += 32;
    }
    while kk < kmax {
        let lo = x.bits(start + kk) as u32;
        let hi = if kk + 1 < kmax {
            x.bits(start + kk + 1) as u32
        } else {
            0
        };
        o[at(kk)] = lo | hi << 16;
        kk += 2;
    }
}

/// `c[32×16] (+)= a_panel · b_panel` over `kp` k-pairs (a multiple of 16).
///
/// # Safety
/// The tiles are configured as [`CONFIG`]; `a` holds `32 × kp` pairs tile by tile, `b` `kp × 16`,
/// `c` the block.
unsafe fn micro_kernel(
    kp: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    c_rs: usize,
    add: bool,
) {
    let cs = c_rs * 4;
    let (c0, c1) = (c, c.add(16 * c_rs));
    if add {
        asm!(
            "tileloadd tmm0, [{c0} + {cs}*1]",
            "tileloadd tmm1, [{c1} + {cs}*1]",
            c0 = in(reg) c0, c1 = in(reg) c1, cs = in(reg) cs,
            options(nostack, readonly),
        );
    } else {
        asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
    }
    // Every tile row is 64 bytes of consecutive memory.
    let rs = TILE_PAIRS * 4;
    for step in 0..kp / TILE_PAIRS {
        let a0 = a.add(step * 2 * TILE);
        asm!(
            "tileloadd tmm6, [{b0} + {rs}*1]",
            "tileloadd tmm4, [{a0} + {rs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {rs}*1]",
            "tdpbf16ps tmm1, tmm5, tmm6",
            a0 = in(reg) a0, a1 = in(reg) a0.add(TILE), b0 = in(reg) b.add(step * TILE),
            rs = in(reg) rs,
            options(nostack, readonly),
        );
    }
    asm!(
        "tilestored [{c0} + {cs}*1], tmm0",
        "tilestored [{c1} + {cs}*1], tmm1",
        c0 = in(reg) c0, c1 = in(reg) c1, cs = in(reg) cs,
        options(nostack),
    );
}

/// FLOP done by `iters` rounds of four `tdpbf16ps` into one accumulator (the instruction's peak:
/// no loads). One accumulator, not independent ones: back-to-back products into the same tile are
/// the fastest arrangement here, and independent accumulators run at half its rate whenever the
/// core's tile unit is shared (see the module's doc).
pub(super) fn peak_chains(iters: usize) -> f64 {
    let zeros = Tile([0f32; 16 * 16]);
    // SAFETY: the caller checked `amx_available`; the tiles are configured, loaded from a buffer
    // of 1 KiB rows (16 rows × 64 bytes) and released here.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
        asm!(
            "tileloadd tmm4, [{p} + {s}*1]",
            "tileloadd tmm5, [{p} + {s}*1]",
            "tileloadd tmm6, [{p} + {s}*1]",
            "tileloadd tmm7, [{p} + {s}*1]",
            "tilezero tmm0",
            p = in(reg) zeros.0.as_ptr(), s = in(reg) 64usize,
            options(nostack, readonly),
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm0, tmm4, tmm7",
                "tdpbf16ps tmm0, tmm5, tmm6",
                "tdpbf16ps tmm0, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    // 16 × 16 outputs, 32 products each, per instruction.
    (iters * 4 * 16 * 16 * 32 * 2) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packing of `a` into tiles needs AVX512_BF16, not AMX, so its layout is checked on every
    /// machine with the former: pair `p` of row `t` of panel `i` at `i·32·kp + tile_index(p, t)`,
    /// bit for bit, for each of the three ways `a` is read (rows contiguous, k contiguous, neither),
    /// with a partial panel at the operand's edge, k cut short and a depth padded past the data.
    #[test]
    fn a_panels_hold_each_pair_where_its_tile_reads_it() {
        if !super::super::available() {
            eprintln!("no AVX512_BF16 here: the AMX packing is not used");
            return;
        }
        let (r_all, c_all) = (75, 140);
        let (xf, xb) = super::super::tests::random_operand(r_all * c_all, 5);
        // (rows stride, k stride, rows of the operand, its k)
        for &(rs, cs, tn, kn) in &[
            (c_all, 1, r_all, c_all),
            (1, c_all, c_all, r_all),
            (2, 2 * c_all, 30, 37),
        ] {
            // A block is whole panels, or ends where the operand does (as the blocking cuts it).
            for &(t0, rows, k0) in &[(0, 64, 0), (7, tn - 7, 5), (20, 32, 30)] {
                let kp = Amx::padded(35);
                for a in [Operand::F32(&xf, rs, cs), Operand::Bf16(&xb, rs, cs)] {
                    // Garbage where it packs: the packing writes every element.
                    let mut got = vec![0xdead_beef; rows.div_ceil(MR) * MR * kp];
                    Amx::pack_a(a, t0, rows, tn, k0, kn, kp, &mut got);
                    let mut want = vec![0u32; rows.div_ceil(MR) * MR * kp];
                    for t in 0..rows.min(tn.saturating_sub(t0)) {
                        for p in 0..kp {
                            let at = |kk: usize| (t0 + t) * rs + kk * cs;
                            want[(t / MR) * MR * kp + tile_index(p, t % MR)] =
                                super::super::tests::pair_bits(a, at, k0 + 2 * p, kn);
                        }
                    }
                    assert!(
                        got == want,
                        "rs {rs} cs {cs} t0 {t0} rows {rows} k0 {k0}: first difference at {:?}",
                        got.iter().zip(&want).position(|(a, b)| a != b)
                    );
                }
            }
        }
    }
}

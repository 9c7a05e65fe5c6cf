//! bf16 GEMM with f32 accumulation, on the best of the CPU's bf16 instructions found at run time:
//! - AMX-BF16 (Intel Sapphire Rapids and later): `tdpbf16ps` multiplies a 16×32 bf16 tile by a
//!   32×16 one into a 16×16 f32 tile, 16,384 FLOP an instruction (about 12× the f32 FMA rate of a
//!   core);
//! - AVX512_BF16 (Zen 4/5, Cooper Lake and later Xeons): `vdpbf16ps`, a 16-lane dot product of bf16
//!   pairs added into f32 lanes, 64 FLOP an instruction (about 1.8× the f32 FMA rate on Zen 4/5).
//!
//! `c[m×n] (+)= a[m×k]·b[k×n]`, operands f32 (rounded to bf16, nearest-even, as they are packed) or
//! bf16, any strides: the three products of a linear layer (forward, input gradient, weight
//! gradient) are all this one call with different strides. The structure is the usual one
//! (Goto/BLIS): blocks of `b` packed into panels of `NR` columns and blocks of `a` into panels of
//! `MR` rows, both as k-pairs (the two bf16 values one lane multiplies), and an `MR × NR`
//! micro-kernel that keeps its 28 accumulators in registers while it runs down k. The AMX path packs
//! `b` the same way in 16-column panels (a k-pair panel row is a tile row) and `a` as rows of
//! k-pairs (a tile's rows), and its micro-kernel is a 32×16 block of `c` held in two accumulator
//! tiles.
//!
//! Without either, the operands are rounded to bf16 and multiplied by the f32 GEMM: the same
//! products (a product of two bf16 values is exact in f32), summed in another order, at the f32
//! speed; that is said once on stderr.
//!
//! This file is the entry (operands, the path chosen, the products' calls, the fallback) and the
//! contract a path keeps ([`Tiles`]); `blocked.rs` the blocking, the threads of one product and
//! their claims on `c`; `pack.rs` the packing; `packed.rs` a right operand packed once for many
//! products; `avx512.rs` and `amx.rs` the two paths.

mod avx512;
mod blocked;
mod pack;
mod packed;
#[cfg(test)]
mod tests;

use super::small_gemm::Causal;
use avx512::Avx512;
use blocked::blocked;
use half::bf16;
pub(crate) use packed::{gemm_packed_ab, gemm_packed_b, PackedA, PackedB};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(not(target_arch = "x86_64"))]
mod amx {
    use super::{Operand, Tiles};
    pub(super) struct Amx;
    impl Tiles for Amx {
        const MR: usize = 32;
        const NR: usize = 16;
        const MC: usize = 32;
        const NC: usize = 16;
        fn block_pairs(kpairs: usize) -> usize {
            kpairs
        }
        #[allow(clippy::too_many_arguments)]
        fn pack_a(
            _: Operand,
            _: usize,
            _: usize,
            _: usize,
            _: usize,
            _: usize,
            _: usize,
            _: &mut [u32],
        ) {
            unreachable!("no AMX off x86_64")
        }
        #[allow(clippy::too_many_arguments)]
        unsafe fn micro(
            _: usize,
            _: *const u32,
            _: super::APanel,
            _: *const u32,
            _: *mut f32,
            _: usize,
            _: bool,
            _: usize,
            _: usize,
        ) {
            unreachable!("no AMX off x86_64")
        }
    }
    pub(super) fn request() -> bool {
        false
    }
    pub(super) fn peak_chains(_: usize) -> f64 {
        unreachable!("no AMX off x86_64")
    }
}

/// One operand: its elements and its (row, column) strides.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    F32(&'a [f32], usize, usize),
    Bf16(&'a [bf16], usize, usize),
}

impl Operand<'_> {
    fn len(&self) -> usize {
        match self {
            Operand::F32(x, ..) => x.len(),
            Operand::Bf16(x, ..) => x.len(),
        }
    }
    fn strides(&self) -> (usize, usize) {
        match *self {
            Operand::F32(_, r, c) | Operand::Bf16(_, r, c) => (r, c),
        }
    }
    /// The element at `i` rounded to bf16 (its bits).
    fn bits(&self, i: usize) -> u16 {
        match self {
            Operand::F32(x, ..) => bf16::from_f32(x[i]).to_bits(),
            Operand::Bf16(x, ..) => x[i].to_bits(),
        }
    }
    /// The element at `i`, rounded to bf16, as f32.
    fn rounded(&self, i: usize) -> f32 {
        bf16::from_bits(self.bits(i)).to_f32()
    }
}

/// The instructions a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// AMX-BF16 tiles (the AVX512_BF16 packing routines included).
    Amx,
    /// AVX512_BF16 vectors.
    Avx512Bf16,
    /// The f32 GEMM on bf16-rounded operands.
    F32Gemm,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Amx => "AMX-BF16 (tdpbf16ps)",
            Path::Avx512Bf16 => "AVX512_BF16 (vdpbf16ps)",
            Path::F32Gemm => "f32 GEMM on bf16-rounded operands (no bf16 instructions)",
        }
    }
}

/// Whether this CPU has the AVX512_BF16 instructions (the packing routines need them too).
pub fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether this CPU has AMX-BF16 and the kernel lets this process use the tiles (Linux asks a
/// process to request the tile state once: `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`).
pub fn amx_available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| available() && amx::request())
}

/// The fastest path this machine has, or the one `FERROTRON_BF16_PATH` (`amx`, `avx512`, `f32`)
/// names where it runs here (to compare the paths, or to test a slower one on a faster machine).
pub fn best_path() -> Path {
    use std::sync::OnceLock;
    static CHOSEN: OnceLock<Path> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let fastest = if amx_available() {
            Path::Amx
        } else if available() {
            Path::Avx512Bf16
        } else {
            Path::F32Gemm
        };
        let Ok(asked) = std::env::var("FERROTRON_BF16_PATH") else {
            return fastest;
        };
        let named = match asked.as_str() {
            "amx" => Some(Path::Amx),
            "avx512" => Some(Path::Avx512Bf16),
            "f32" => Some(Path::F32Gemm),
            _ => None,
        };
        match named {
            Some(p) if runs_here(p) => p,
            _ => {
                eprintln!(
                    "note: FERROTRON_BF16_PATH={asked} is not a path this CPU runs (amx, avx512, f32): using {}",
                    fastest.name()
                );
                fastest
            }
        }
    })
}

/// FLOP done by `iters` rounds of chains of `path`'s instruction: its peak, with no
/// memory traffic. `None` where the path has no bf16 instruction or does not run here.
pub fn peak_chains(path: Path, iters: usize) -> Option<f64> {
    if !runs_here(path) {
        return None;
    }
    match path {
        Path::Amx => Some(amx::peak_chains(iters / 16)),
        // SAFETY: the path runs here (checked above).
        Path::Avx512Bf16 => Some(unsafe { dot_chains(iters) }),
        Path::F32Gemm => None,
    }
}

/// FLOP done by `iters` rounds of 12 independent `vdpbf16ps`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_chains(iters: usize) -> f64 {
    let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3f80_3f80)));
    let mut acc: [__m512; 12] =
        std::array::from_fn(|i| _mm512_set1_ps(std::hint::black_box(i as f32)));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_dpbf16_ps(*a, pair, pair);
        }
    }
    std::hint::black_box(acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum::<f32>());
    // 16 lanes, two products each.
    (iters * 12 * 16 * 2 * 2) as f64
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot_chains(_: usize) -> f64 {
    unreachable!("available() is false off x86_64")
}

/// Whether `path` runs here.
pub fn runs_here(path: Path) -> bool {
    match path {
        Path::Amx => amx_available(),
        Path::Avx512Bf16 => available(),
        Path::F32Gemm => true,
    }
}

/// [`crate::kernels::extent`] of an operand's view.
fn extent(rows: usize, cols: usize, (rs, cs): (usize, usize)) -> usize {
    crate::kernels::extent(rows, cols, rs, cs)
}

/// `c[m×n] (+)= a[m×k]·b[k×n]` with the operands rounded to bf16 and the products summed in f32;
/// `threads` > 1 splits `c` into that many blocks computed in parallel.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: &mut [f32],
    c_rs: usize,
    accumulate: bool,
    threads: usize,
) {
    gemm_on(best_path(), m, n, k, a, b, c, c_rs, accumulate, threads)
}

/// [`gemm`] on `path` (which must [run here](runs_here)).
#[allow(clippy::too_many_arguments)]
pub fn gemm_on(
    path: Path,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: &mut [f32],
    c_rs: usize,
    accumulate: bool,
    threads: usize,
) {
    assert!(
        runs_here(path),
        "bf16 gemm: {} does not run here",
        path.name()
    );
    if m == 0 || n == 0 {
        return;
    }
    check_operands(m, n, k, a, b);
    assert!(
        extent(m, n, (c_rs, 1)) <= c.len(),
        "bf16 gemm: dst view out of bounds"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                c[r * c_rs..r * c_rs + n].fill(0.0);
            }
        }
        return;
    }
    let Some(blocked) = kernel_of(path) else {
        return fallback(m, n, k, a, b, c, c_rs, accumulate);
    };
    let threads = threads_for(m, n, k, threads);
    // SAFETY: the views lie inside their slices (checked above); `c` is exclusively borrowed.
    unsafe {
        blocked(
            m,
            n,
            k,
            a,
            b,
            c.as_mut_ptr(),
            c_rs,
            accumulate,
            Causal::None,
            threads,
        )
    }
}

/// The views of `a` (`m × k`) and `b` (`k × n`) must lie inside their slices: this is what makes
/// the raw-pointer kernels sound.
fn check_operands(m: usize, n: usize, k: usize, a: Operand, b: Operand) {
    assert!(
        extent(m, k, a.strides()) <= a.len(),
        "bf16 gemm: lhs view out of bounds"
    );
    assert!(
        extent(k, n, b.strides()) <= b.len(),
        "bf16 gemm: rhs view out of bounds"
    );
}

/// Threads for a product: one below ~4 MFLOP, where the fork/join costs more than it saves.
fn threads_for(m: usize, n: usize, k: usize, threads: usize) -> usize {
    if threads > 1 && 2 * m * n * k >= 1 << 22 {
        threads
    } else {
        1
    }
}

/// [`gemm`] on this thread into a raw `c`, on the fastest bf16 instructions here; `false` (nothing
/// done) where there are none, so that the caller keeps its own f32 product. For kernels whose
/// concurrent tasks write disjoint elements of one buffer (attention's heads).
///
/// # Safety
/// `c` must be valid for reads and writes of the `m × n` view with row stride `c_rs`, which no one
/// else touches meanwhile; the operands' views must lie inside their slices.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
    mask: Causal,
) -> bool {
    let Some(blocked) = kernel_of(best_path()) else {
        return false;
    };
    if m == 0 || n == 0 || k == 0 {
        return false;
    }
    check_operands(m, n, k, a, b);
    blocked(m, n, k, a, b, c, c_rs, accumulate, mask, 1);
    true
}

/// A path's blocked GEMM (see [`blocked`]).
type Blocked =
    unsafe fn(usize, usize, usize, Operand, Operand, *mut f32, usize, bool, Causal, usize);

/// A bf16 path's blocked GEMM; `None` for the f32 fallback.
fn kernel_of(path: Path) -> Option<Blocked> {
    match path {
        Path::Amx => Some(blocked::<amx::Amx>),
        Path::Avx512Bf16 => Some(blocked::<Avx512>),
        Path::F32Gemm => None,
    }
}

impl<'a> Operand<'a> {
    /// The view starting `r` rows down.
    fn offset_rows(self, r: usize) -> Self {
        match self {
            Operand::F32(x, rs, cs) => Operand::F32(&x[r * rs..], rs, cs),
            Operand::Bf16(x, rs, cs) => Operand::Bf16(&x[r * rs..], rs, cs),
        }
    }
    /// The view starting `c` columns in.
    fn offset_cols(self, c: usize) -> Self {
        match self {
            Operand::F32(x, rs, cs) => Operand::F32(&x[c * cs..], rs, cs),
            Operand::Bf16(x, rs, cs) => Operand::Bf16(&x[c * cs..], rs, cs),
        }
    }
}

/// What the blocking needs of a path: its micro-tile, block sizes, how deep a block of k-pairs is
/// and how the `a` panels are laid out; and the micro-kernel.
pub(super) trait Tiles {
    /// Rows and columns of a micro-tile (at most 32 × 32).
    const MR: usize;
    const NR: usize;
    /// Rows of `a` and columns of `b` packed at a time (multiples of `MR`, `NR`).
    const MC: usize;
    const NC: usize;
    /// Whether the micro-kernels of one panel of `a` run one after the other (over every panel of
    /// `b` in the block) rather than those of one panel of `b`.
    const A_PANEL_OUTER: bool = false;
    /// Whether the threads of a product share each packed block of `b` (taking rows of `c`), or
    /// each takes a part of `c` along its longer side and packs its own panels of both operands.
    const SHARED_B: bool = false;
    /// The k-pairs of one block, out of `kpairs` (equal blocks), and a block's depth as packed.
    fn block_pairs(kpairs: usize) -> usize;
    fn padded(kp: usize) -> usize {
        kp
    }
    /// Writes the panels of `rows` rows of `a` from row `t0` (of `tn`; `MR` rows a panel, zero
    /// past `tn`), k-pairs from `k0` (of `kn` values), `kp` deep, in the layout the micro-kernel
    /// reads, over all of `out` (`rows.div_ceil(MR) · MR · kp` elements).
    #[allow(clippy::too_many_arguments)]
    fn pack_a(
        a: Operand,
        t0: usize,
        rows: usize,
        tn: usize,
        k0: usize,
        kn: usize,
        kp: usize,
        out: &mut [u32],
    );
    /// Where [`Tiles::pack_a`] puts pair `p` of row `r` of a panel `kp` pairs deep of `a` (pair by
    /// pair unless a path lays some operands out otherwise).
    fn a_panel(_a: Operand, _kp: usize) -> APanel {
        APanel {
            row: 1,
            pair: Self::MR,
        }
    }
    /// Before and after a thread's blocks (the tiles' configuration).
    ///
    /// # Safety
    /// The path's instructions must be present.
    unsafe fn begin() {}
    /// # Safety
    /// As [`Tiles::begin`].
    unsafe fn end() {}
    /// Whether a panel's k-pairs may be packed and multiplied from any pair to any other (the
    /// packed layout is pair by pair): then a [depth mask](Causal) skips the pairs that multiply
    /// zeros. Where not, the whole depth is computed (the same result).
    const DEPTH_RANGES: bool = false;
    /// Whether [`Tiles::micro`] stores a part block (one that overhangs `c`) in place; where not,
    /// such a block goes through a scratch tile, and `micro` only ever sees whole ones.
    const PART_BLOCKS: bool = false;
    /// `c (+)= a_panel · b_panel` over `kp` k-pairs, the first `rows × cols` of the `MR × NR`
    /// block stored (all of it unless [`Tiles::PART_BLOCKS`]); `a_panel` says where the panel of
    /// `a` holds each pair ([`Tiles::a_panel`]).
    ///
    /// # Safety
    /// The panels hold `kp` pairs of `MR` rows and `NR` columns; `c` holds the `rows × cols` part.
    #[allow(clippy::too_many_arguments)]
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
    );
}

/// Where a packed panel of `a` holds pair `p` of its row `r`: `r·row + p·pair` (in pairs) from the
/// panel's start. Pair by pair (`[pair][MR]`: row 1, pair `MR`) suits the micro-kernels' reading
/// order; row by row (`[MR][kp]`: row `kp`, pair 1) makes packing a k-contiguous operand a plain
/// rounding of each row, with no transposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct APanel {
    pub row: usize,
    pub pair: usize,
}

/// Without the instruction: the operands rounded to bf16, multiplied by the f32 GEMM.
#[allow(clippy::too_many_arguments)]
fn fallback(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: &mut [f32],
    c_rs: usize,
    acc: bool,
) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "note: bf16 products run on the f32 GEMM on bf16-rounded operands (same values, f32 speed): this CPU has no AVX512_BF16 or AMX-BF16, or FERROTRON_BF16_PATH=f32 asked for it"
        )
    });
    let dense = |x: Operand, rows: usize, cols: usize| -> Vec<f32> {
        let (rs, cs) = x.strides();
        (0..rows * cols)
            .map(|i| x.rounded((i / cols) * rs + (i % cols) * cs))
            .collect()
    };
    let (a, b) = {
        // Workspace, as the fast paths' packing buffers are.
        let _other = crate::memory::scope(crate::memory::Term::Other);
        (dense(a, m, k), dense(b, k, n))
    };
    let one = super::threads::Threads::new(1);
    super::f32_gemm::gemm_strided(&one, m, n, k, (&a, k, 1), (&b, n, 1), c, c_rs, acc, false);
}

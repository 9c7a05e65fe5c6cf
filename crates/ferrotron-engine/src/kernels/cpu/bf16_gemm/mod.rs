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

use half::bf16;
use std::cell::RefCell;

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

/// Rows of a micro-tile (one broadcast pair each).
const MR: usize = 14;
/// Columns of a micro-tile (two vectors of 16 lanes).
const NR: usize = 32;
/// Rows of `a` packed at a time (a multiple of `MR`; the packed block stays in L2).
const MC: usize = MR * 10;
/// Columns of `b` packed at a time (a multiple of `NR`).
const NC: usize = NR * 32;
/// Most k-pairs packed at a time. The A panel (14 rows × 512 pairs, 28 KiB) stays in L1 while
/// the B panels stream past it from L2; C is read and written once per block of k, so deeper
/// blocks move less of it (256 pairs measured 8–10% slower on the 2048³ product, 128 slower still,
/// 1024 no faster).
const MAX_KC_PAIRS: usize = 512;

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

thread_local! {
    /// Each thread's packing buffers, kept between calls (allocating them per call costs fresh
    /// pages from the kernel every time): the panels of `a` it packs for itself, and the panels of
    /// `b` it packs with the other threads of a call it makes.
    static PACKED_A: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static PACKED_B: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `len` elements of a packing buffer from its first cache line (a tile row or vector that
/// straddles two lines is loaded twice, which costs the AMX path half its speed). The buffer only
/// grows, and is not cleared: a packing writes every element of what it is given.
fn aligned(buffer: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if buffer.len() < len + 16 {
        // Workspace, not the step's activations.
        let _other = crate::memory::scope(crate::memory::Term::Other);
        buffer.resize(len + 16, 0);
    }
    let line = (64 - buffer.as_ptr() as usize % 64) % 64 / 4;
    &mut buffer[line..line + len]
}

/// `f(0..parts)`, in parallel when there is more than one.
fn for_each_part(parts: usize, f: impl Fn(usize) + Sync + Send) {
    if parts > 1 {
        use rayon::prelude::*;
        (0..parts).into_par_iter().for_each(f);
    } else if parts == 1 {
        f(0)
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
    /// block stored (all of it unless [`Tiles::PART_BLOCKS`]).
    ///
    /// # Safety
    /// The panels hold `kp` pairs of `MR` rows and `NR` columns; `c` holds the `rows × cols` part.
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro(
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        c_rs: usize,
        add: bool,
        rows: usize,
        cols: usize,
    );
}

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
        pack(a, rs, cs, t0, rows, tn, k0, kn, kp, MR, out);
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
        b: *const u32,
        c: *mut f32,
        c_rs: usize,
        add: bool,
        rows: usize,
        cols: usize,
    ) {
        micro_kernel(kp, a, b, c, c_rs, add, rows, cols)
    }
}

/// A micro-tile's result when it overhangs `c`, aligned for the tile stores.
#[repr(C, align(64))]
struct EdgeTile([f32; 32 * 32]);

/// The GEMM into `c` (row stride `c_rs`) on path `P`, on `threads` threads: blocks of `b` packed
/// into panels of `NR` columns and blocks of `a` into panels of `MR` rows, then a micro-kernel per
/// tile. Where the path [shares b](Tiles::SHARED_B), the threads take rows of `c` and share each
/// packed block of `b`: every thread packs a part of it, then runs its rows against all of it (a
/// thread packing the whole block for itself would pack it once per thread; on the weight
/// gradients that is an activation each time). Otherwise, or with too few rows for that, each
/// thread takes a part of `c` along its longer side, with its own panels.
///
/// # Safety
/// `c` must hold the `m × n` view, which no one else touches meanwhile; the operands' views must
/// lie in their slices; the CPU must have the path's instructions.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked<P: Tiles>(
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
    mask: Causal,
    threads: usize,
) {
    let (mr, nr) = (P::MR, P::NR);
    let c = super::threads::SendPtr(c);
    let shared = P::SHARED_B && (m >= n || m >= 4 * threads * mr);
    if threads > 1 && !shared {
        // Each thread its own part of `c` along the longer side, and its own panels of both.
        assert!(
            matches!(mask, Causal::None),
            "bf16 gemm: a causal mask on a product split this way"
        );
        let split_rows = m >= n;
        let (len, tile) = if split_rows { (m, mr) } else { (n, nr) };
        let per = len.div_ceil(threads).div_ceil(tile) * tile;
        // SAFETY: the parts write disjoint rows (or columns) of `c`, all inside it.
        for_each_part(len.div_ceil(per), |t| unsafe {
            let (lo, hi) = (t * per, ((t + 1) * per).min(len));
            if split_rows {
                let (a, c) = (a.offset_rows(lo), c.get().add(lo * c_rs));
                blocked::<P>(hi - lo, n, k, a, b, c, c_rs, accumulate, mask, 1)
            } else {
                let (b, c) = (b.offset_cols(lo), c.get().add(lo));
                blocked::<P>(m, hi - lo, k, a, b, c, c_rs, accumulate, mask, 1)
            }
        });
        return;
    }
    let kpairs = k.div_ceil(2);
    let kc = P::block_pairs(kpairs);
    let parts = threads.min(m.div_ceil(mr));
    let (rs, cs) = b.strides();
    let mut own = Vec::new();
    PACKED_B.with(|buffer| {
        // A call made while this thread's buffer is in use (by a call that waits on its threads)
        // packs into a buffer of its own.
        let mut held = buffer.try_borrow_mut();
        let buffer = match held {
            Ok(ref mut b) => &mut **b,
            Err(_) => &mut own,
        };
        for jc in (0..n).step_by(P::NC) {
            let nc = P::NC.min(n - jc);
            let panels = nc.div_ceil(nr);
            for pc in (0..kpairs).step_by(kc) {
                let kp = P::padded(kc.min(kpairs - pc));
                let panel = kp * nr;
                let pb = aligned(buffer, panels * panel);
                let add = accumulate || pc > 0;
                // b's panels (t = column, k along rows) in runs that the threads take as they
                // come; then, once all are packed, rows of `c` likewise.
                let group = panels.div_ceil(4 * parts);
                let groups = panels.div_ceil(group);
                let (taken, packed, next_row) = (
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                );
                let pb_ptr = super::threads::SendPtr(pb.as_mut_ptr());
                for_each_part(parts, |_| unsafe {
                    loop {
                        let g = taken.fetch_add(1, Ordering::Relaxed);
                        if g >= groups {
                            break;
                        }
                        let t0 = g * group * nr;
                        let cols = (nc - t0).min(group * nr);
                        // SAFETY: group `g`'s panels, taken by this thread alone.
                        let o = std::slice::from_raw_parts_mut(
                            pb_ptr.get().add(g * group * panel),
                            cols.div_ceil(nr) * panel,
                        );
                        pack(b, cs, rs, jc + t0, cols, n, 2 * pc, k, kp, nr, o);
                        packed.fetch_add(1, Ordering::Release);
                    }
                    // The runs still being packed are short: wait for them.
                    let mut spins = 0u32;
                    while packed.load(Ordering::Acquire) < groups {
                        spins += 1;
                        if spins.is_multiple_of(64) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    // SAFETY: every panel is written (above) and no longer written.
                    let pb = std::slice::from_raw_parts(pb_ptr.get(), panels * panel);
                    // SAFETY: the threads write disjoint rows of `c`, all inside it.
                    while let Some(rows) = claim_rows(&next_row, m, mr, parts) {
                        rows_against::<P>(
                            a,
                            rows,
                            m,
                            (pc, kp, k),
                            pb,
                            (jc, nc, n),
                            c.get(),
                            c_rs,
                            add,
                            mask,
                        );
                    }
                });
            }
        }
    });
}

/// The next run of rows of an `m`-row product for a thread to take, from `next` (the first row
/// not yet taken), or `None` when all are taken: whole panels of `mr` rows, about half of what is
/// left shared among `parts` threads (guided: large runs first, one panel at the end), so that a
/// thread that starts late, or is slowed, takes less instead of keeping the others waiting.
fn claim_rows(
    next: &AtomicUsize,
    m: usize,
    mr: usize,
    parts: usize,
) -> Option<std::ops::Range<usize>> {
    let mut lo = next.load(Ordering::Relaxed);
    loop {
        if lo >= m {
            return None;
        }
        let run = ((m - lo) / (2 * parts)).div_ceil(mr).max(1) * mr;
        let hi = (lo + run).min(m);
        match next.compare_exchange_weak(lo, hi, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(lo..hi),
            Err(now) => lo = now,
        }
    }
}

/// The part of a block that the micro-tile at row `i` (of `rows` rows) needs under `mask`: the
/// columns before the returned bound, and the block's pairs in the returned range (relative to the
/// block's first pair `pc`, of `kp`; all of them unless the path [skips depth](Tiles::DEPTH_RANGES)).
/// The pairs skipped multiply zeros (both values of a pair are past the mask's edge), and the
/// columns skipped are ones the caller does not read.
fn needed<P: Tiles>(
    mask: Causal,
    i: usize,
    rows: usize,
    (pc, kp, k): (usize, usize, usize),
) -> (usize, std::ops::Range<usize>) {
    let (last, all) = (i + rows - 1, 0..kp);
    let within = |from: usize, to: usize| from.clamp(pc, pc + kp) - pc..to.clamp(pc, pc + kp) - pc;
    match mask {
        Causal::None => (usize::MAX, all),
        Causal::Columns(diag) => (last + diag + 1, all),
        _ if !P::DEPTH_RANGES => (usize::MAX, all),
        // Row `r` needs depth `r + diag` and before: up to the pair holding the last row's.
        Causal::DepthUpTo(diag) => (usize::MAX, within(0, (last + diag + 1).min(k).div_ceil(2))),
        // Row `r` needs depth `r − diag` and after: from the pair holding the first row's.
        Causal::DepthFrom(diag) => (usize::MAX, within(i.saturating_sub(diag) / 2, usize::MAX)),
    }
}

/// `c[rows, jc..jc + nc] (+)= a[rows, pairs] · b-block` on this thread: `pb` is the block of `b`
/// packed (`kp` pairs from pair `pc`, of `k` values), the rows' blocks of `a` packed here. Under a
/// causal `mask`, the micro-tiles past its edge are skipped, and those along it run over the pairs
/// they need (packed alone, panel by panel).
///
/// # Safety
/// As [`blocked`]; no one else touches these rows of `c`.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_against<P: Tiles>(
    a: Operand,
    rows: std::ops::Range<usize>,
    m: usize,
    (pc, kp, k): (usize, usize, usize),
    pb: &[u32],
    (jc, nc, n): (usize, usize, usize),
    c: *mut f32,
    c_rs: usize,
    add: bool,
    mask: Causal,
) {
    let (mr, nr) = (P::MR, P::NR);
    let depth_masked =
        P::DEPTH_RANGES && matches!(mask, Causal::DepthUpTo(_) | Causal::DepthFrom(_));
    P::begin();
    PACKED_A.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        let mut tile: Option<Box<EdgeTile>> = None;
        for ic in rows.clone().step_by(P::MC) {
            let mc = P::MC.min(rows.end - ic);
            let pa = aligned(&mut buffer, mc.div_ceil(mr) * mr * kp);
            let (panels_a, panels_b) = (mc.div_ceil(mr), nc.div_ceil(nr));
            let panel_rows = |im: usize| mr.min(m - (ic + im * mr));
            if depth_masked {
                // Each panel's pairs alone: a panel is `[pair][MR]`, so pairs `s..e` are a run.
                for im in 0..panels_a {
                    let (_, pairs) = needed::<P>(mask, ic + im * mr, panel_rows(im), (pc, kp, k));
                    let run = &mut pa[(im * kp + pairs.start) * mr..(im * kp + pairs.end) * mr];
                    let k0 = 2 * (pc + pairs.start);
                    P::pack_a(a, ic + im * mr, mr, m, k0, k, pairs.len(), run);
                }
            } else {
                P::pack_a(a, ic, mc, m, 2 * pc, k, kp, pa);
            }
            for block in 0..panels_a * panels_b {
                let (im, jn) = if P::A_PANEL_OUTER {
                    (block / panels_b, block % panels_b)
                } else {
                    (block % panels_a, block / panels_a)
                };
                let (i, j) = (ic + im * mr, jc + jn * nr);
                let (rows, cols) = (panel_rows(im), nr.min(n - j));
                let (columns, pairs) = needed::<P>(mask, i, rows, (pc, kp, k));
                if j >= columns || (pairs.is_empty() && add) {
                    continue;
                }
                let bp = pb.as_ptr().add((jn * kp + pairs.start) * nr);
                let ap = pa.as_ptr().add((im * kp + pairs.start) * mr);
                let dst = c.add(i * c_rs + j);
                if (rows == mr && cols == nr) || P::PART_BLOCKS {
                    P::micro(pairs.len(), ap, bp, dst, c_rs, add, rows, cols);
                } else {
                    let tile = tile.get_or_insert_with(|| Box::new(EdgeTile([0.0; 32 * 32])));
                    P::micro(pairs.len(), ap, bp, tile.0.as_mut_ptr(), nr, false, mr, nr);
                    for r in 0..rows {
                        for q in 0..cols {
                            let d = dst.add(r * c_rs + q);
                            let v = tile.0[r * nr + q];
                            *d = if add { *d + v } else { v };
                        }
                    }
                }
            }
        }
    });
    P::end();
}

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
fn pack(
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

use super::small_gemm::Causal;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// [`pack`] where k is contiguous (a row of the operand is a run of memory): 16 rows of a panel
/// and 16 pairs of each at a time (32 values of a row, rounded in one conversion), transposed in
/// registers into 16 vectors of one pair each and stored as runs. (Scattering each row's pairs `w`
/// apart instead costs a scatter per 16 values, several times slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_along_k(
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
unsafe fn load_pairs(x: Operand, start: usize, values: usize) -> __m512i {
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
unsafe fn transpose_16x16(v: &mut [__m512i; 16]) {
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
    // [row0 0..16, row1 0..16] → [row0 0, row1 0, row0 1, row1 1, …]
    let interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
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
            let v = _mm512_permutexvar_epi16(interleave, v);
            let dst = o.as_mut_ptr().add(at + pair);
            if lanes_apart == 1 {
                _mm512_mask_storeu_epi32(dst.cast(), mask, v);
            } else {
                _mm512_mask_i32scatter_epi32::<4>(dst.cast(), mask, scatter, v);
            }
        }
    }
}

/// `c[MR×NR] (+)= a_panel · b_panel` over `kp` k-pairs, of which the first `rows × cols` are
/// stored (masked stores: nothing outside them is touched).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_kernel(
    kp: usize,
    a: *const u32,
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
            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
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
unsafe fn pack_along_k(
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
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_kernel(
    _: usize,
    _: *const u32,
    _: *const u32,
    _: *mut f32,
    _: usize,
    _: bool,
    _: usize,
    _: usize,
) {
    unreachable!("available() is false off x86_64")
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The exact sum of the bf16-rounded products, in f64.
    fn reference(m: usize, n: usize, k: usize, a: Operand, b: Operand) -> Vec<f64> {
        let ((ars, acs), (brs, bcs)) = (a.strides(), b.strides());
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        a.rounded(i * ars + p * acs) as f64 * b.rounded(p * brs + j * bcs) as f64
                    })
                    .sum();
            }
        }
        c
    }

    /// An operand of `len` values in [-2, 2), in f32 and rounded to bf16.
    pub(super) fn random_operand(len: usize, seed: u64) -> (Vec<f32>, Vec<bf16>) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let xf: Vec<f32> = (0..len).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let xb = xf.iter().map(|&v| bf16::from_f32(v)).collect();
        (xf, xb)
    }

    /// The packed pair of k-values `kk` and `kk + 1` of one row (`at(kk)`: where value `kk` lies),
    /// zero past `kn`: what a panel must hold there.
    pub(super) fn pair_bits(x: Operand, at: impl Fn(usize) -> usize, kk: usize, kn: usize) -> u32 {
        let bits = |kk: usize| if kk < kn { x.bits(at(kk)) as u32 } else { 0 };
        bits(kk) | bits(kk + 1) << 16
    }

    /// The vectorised packings (k contiguous: transposed in registers; rows contiguous: pair by
    /// pair across the block) lay out exactly the bits of the definition, for the panel widths of
    /// both paths (14 and 32 for AVX512_BF16, 16 and 32 for AMX), partial panels, rows and k cut
    /// short by the operand's edge, odd k, depths padded past the data, f32 and bf16 operands, and
    /// the general strided case. Exact equality: packing only moves and rounds bits. This is what
    /// keeps the AMX path's panels right on machines without AMX.
    #[test]
    fn packed_panels_hold_exactly_the_operand_s_pairs() {
        if !available() {
            eprintln!("no AVX512_BF16 here: the packing routines are not used");
            return;
        }
        let (rows_all, cols_all) = (83, 157);
        let (xf, xb) = random_operand(rows_all * cols_all, 11);
        for &w in &[14, 16, 32] {
            for &(t0, rows, k0, kp) in &[
                (0, 64, 0, 40),
                (5, 45, 3, 70),
                (60, 40, 100, 35),
                (0, 1, 0, 1),
            ] {
                // (ts, ks, tn, kn): k contiguous, rows contiguous, neither.
                for &(ts, ks, tn, kn) in &[
                    (cols_all, 1, rows_all, cols_all),
                    (1, cols_all, cols_all, rows_all),
                    (2, 2 * cols_all, 40, 40),
                ] {
                    for x in [
                        Operand::F32(&xf, cols_all, 1),
                        Operand::Bf16(&xb, cols_all, 1),
                    ] {
                        // Garbage where it packs (the packing writes every element), and
                        // around it.
                        let size = usize::div_ceil(rows, w) * kp * w;
                        let mut got = vec![0xdead_beef_u32; size + 6];
                        pack(
                            x,
                            ts,
                            ks,
                            t0,
                            rows,
                            tn,
                            k0,
                            kn,
                            kp,
                            w,
                            &mut got[3..size + 3],
                        );
                        // Panel i's pair p of row t at i·kp·w + p·w + t: zero past the rows,
                        // k and the data.
                        let mut want = vec![0u32; rows.div_ceil(w) * kp * w];
                        for t in 0..rows.min(tn.saturating_sub(t0)) {
                            for p in 0..kp {
                                let at = |kk: usize| (t0 + t) * ts + kk * ks;
                                want[(t / w) * kp * w + p * w + t % w] =
                                    pair_bits(x, at, k0 + 2 * p, kn);
                            }
                        }
                        let around = [&got[..3], &got[size + 3..]];
                        assert!(around == [[0xdead_beef; 3]; 2], "written outside its block");
                        assert!(
                            got[3..size + 3] == want[..],
                            "w {w} t0 {t0} rows {rows} k0 {k0} kp {kp} ts {ts} ks {ks}: first difference at {:?}",
                            got[3..].iter().zip(&want).position(|(a, b)| a != b)
                        );
                    }
                }
            }
        }
    }

    /// The bf16 instruction paths this machine runs (the f32 fallback has its own test).
    fn paths_here() -> Vec<Path> {
        let paths: Vec<Path> = [Path::Amx, Path::Avx512Bf16]
            .into_iter()
            .filter(|&p| runs_here(p))
            .collect();
        eprintln!("bf16 paths tested here: {paths:?}");
        paths
    }

    /// Every stride pattern of the three linear products, odd sizes (partial tiles, an odd k), f32
    /// and bf16 operands, one and two threads, with and without accumulation. Against the exact sum
    /// of the rounded products the only error is f32 accumulation over k terms: bounded by
    /// k·2⁻²⁴·Σ|aᵢbᵢ| (Higham's γ_k), far below one bf16 rounding of the inputs (2⁻⁸ relative),
    /// which a wrong packing or a missed pair would exceed.
    #[test]
    fn every_layout_of_the_three_products_sums_the_rounded_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(m, n, k) in &[
            (29, 70, 67),
            (64, 33, 128),
            (3, 5, 1),
            (150, 40, 301),
            (15, 1030, 9),
            // Past one block of rows, of columns and of depth on every path.
            (270, 1060, 530),
            // Too few rows to share the packed b: threads split the columns.
            (20, 3000, 70),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            // a: row-major (k contiguous) or its transpose's view (m contiguous);
            // b: [k×n] row-major (n contiguous) or [n×k] viewed transposed (k contiguous).
            let a_views = [
                Operand::F32(&x, k, 1),
                Operand::F32(&x, 1, m),
                Operand::Bf16(&xb, k, 1),
                Operand::Bf16(&xb, 1, m),
            ];
            let b_views = [
                Operand::F32(&w, n, 1),
                Operand::F32(&w, 1, k),
                Operand::Bf16(&wb, n, 1),
                Operand::Bf16(&wb, 1, k),
            ];
            // The large shape with f32 operands only (the small ones cover bf16 operands).
            let views = if m * n * k > 10_000_000 { 2 } else { 4 };
            for a in a_views.into_iter().take(views) {
                for b in b_views.into_iter().take(views) {
                    let want = reference(m, n, k, a, b);
                    let bound: Vec<f64> = {
                        let ((ars, acs), (brs, bcs)) = (a.strides(), b.strides());
                        (0..m * n)
                            .map(|ij| {
                                let (i, j) = (ij / n, ij % n);
                                let s: f64 = (0..k)
                                    .map(|p| {
                                        (a.rounded(i * ars + p * acs) as f64
                                            * b.rounded(p * brs + j * bcs) as f64)
                                            .abs()
                                    })
                                    .sum();
                                k as f64 * 2f64.powi(-24) * s + 1e-30
                            })
                            .collect()
                    };
                    for (path, threads, accumulate) in paths_here()
                        .into_iter()
                        .flat_map(|p| [(p, 1, false), (p, 2, false), (p, 1, true), (p, 2, true)])
                    {
                        {
                            let mut c = vec![0.5f32; m * n];
                            gemm_on(path, m, n, k, a, b, &mut c, n, accumulate, threads);
                            for ij in 0..m * n {
                                let expect = want[ij] + if accumulate { 0.5 } else { 0.0 };
                                let err = (c[ij] as f64 - expect).abs();
                                assert!(
                                    err <= bound[ij] + 2f64.powi(-24) * expect.abs(),
                                    "{m}x{n}x{k} {path:?} threads {threads} acc {accumulate}: c[{ij}] = {} vs {expect} (bound {:e})",
                                    c[ij],
                                    bound[ij]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Without accumulation the GEMM writes every element of its output and reads none (the
    /// executor hands it buffers that were not zeroed, `Backend::overwritten`): into a buffer of
    /// NaN it is bit for bit what it is into one of 7s, on one thread and two, where the threads
    /// share the packed b and where they split the columns, and with k = 0.
    #[test]
    fn without_accumulation_the_gemm_writes_every_element() {
        for &(m, n, k) in &[(29, 70, 67), (270, 1060, 530), (20, 3000, 70), (5, 9, 0)] {
            let (x, _) = random_operand(m * k, 1);
            let (w, _) = random_operand(k * n, 2);
            let (a, b) = (Operand::F32(&x, k, 1), Operand::F32(&w, 1, k));
            for threads in [1, 2] {
                let mut want = vec![7.0f32; m * n];
                gemm(m, n, k, a, b, &mut want, n, false, threads);
                let mut got = vec![f32::NAN; m * n];
                gemm(m, n, k, a, b, &mut got, n, false, threads);
                assert!(
                    got.iter()
                        .map(|v| v.to_bits())
                        .eq(want.iter().map(|v| v.to_bits())),
                    "{m}x{n}x{k} on {threads} threads"
                );
            }
        }
    }

    #[test]
    fn a_causal_mask_changes_nothing_the_caller_reads() {
        if best_path() == Path::F32Gemm {
            // gemm_into is the bf16 paths' product; without AVX512_BF16 or AMX there is none (the
            // callers fall back to the f32 GEMM, whose mask `small_gemm`'s tests check).
            eprintln!("skipped: this CPU has no bf16 GEMM path (no AVX512_BF16, no AMX)");
            return;
        }
        for &(m, n, k) in &[(64, 64, 64), (256, 64, 256), (47, 33, 95), (300, 70, 1100)] {
            for mask in [
                Causal::Columns(0),
                Causal::Columns(5),
                Causal::DepthUpTo(0),
                Causal::DepthUpTo(3),
                Causal::DepthFrom(0),
                Causal::DepthFrom(7),
            ] {
                let zero = |i: usize, p: usize| match mask {
                    Causal::DepthUpTo(d) => p > i + d,
                    Causal::DepthFrom(d) => p + d < i,
                    _ => false,
                };
                let (mut x, _) = random_operand(m * k, 5);
                for (ip, v) in x.iter_mut().enumerate() {
                    if zero(ip / k, ip % k) {
                        *v = 0.0;
                    }
                }
                let xt: Vec<f32> = (0..k * m).map(|pi| x[(pi % m) * k + pi / m]).collect();
                let (w, _) = random_operand(k * n, 6);
                let a_views = [Operand::F32(&x, k, 1), Operand::F32(&xt, 1, m)];
                let b_views = [Operand::F32(&w, n, 1), Operand::F32(&w, 1, k)];
                for (a, b) in a_views.into_iter().zip(b_views) {
                    for accumulate in [false, true] {
                        let mut want = vec![0.5f32; m * n];
                        let mut got = want.clone();
                        // SAFETY: both views lie in their slices; `c` holds m × n.
                        unsafe {
                            let c = want.as_mut_ptr();
                            assert!(gemm_into(m, n, k, a, b, c, n, accumulate, Causal::None));
                            let c = got.as_mut_ptr();
                            assert!(gemm_into(m, n, k, a, b, c, n, accumulate, mask));
                        }
                        for i in 0..m {
                            for j in 0..n {
                                if let Causal::Columns(d) = mask {
                                    if j > i + d {
                                        continue;
                                    }
                                }
                                assert!(
                                    got[i * n + j] == want[i * n + j],
                                    "{m}x{n}x{k} {mask:?} acc {accumulate}: c[{i}][{j}] = {} vs {}",
                                    got[i * n + j],
                                    want[i * n + j]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_fallback_computes_the_same_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (m, n, k) = (2048, 1408, 512);
        let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let (a, b) = (Operand::F32(&x, k, 1), Operand::F32(&w, 1, k));
        let want = reference(m, n, k, a, b);
        let mut c = vec![0f32; m * n];
        fallback(m, n, k, a, b, &mut c, n, false);
        for (got, want) in c.iter().zip(&want) {
            assert!(
                (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
}

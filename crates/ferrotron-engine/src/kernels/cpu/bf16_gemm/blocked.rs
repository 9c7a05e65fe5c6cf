//! The blocked GEMM any path runs (Goto/BLIS): blocks of `b` packed into panels, blocks of `a`
//! into panels, a micro-kernel per tile; the threads of one product, their packing buffers, and
//! how they claim rows of `c`.

use super::pack::pack;
use super::{APanel, Operand, Tiles};
use crate::kernels::cpu::small_gemm::Causal;
use crate::kernels::cpu::threads::SendPtr;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

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
pub(super) fn aligned(buffer: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if buffer.len() < len + 16 {
        // Workspace, not the step's activations.
        let _other = crate::memory::scope(crate::memory::Term::Other);
        buffer.resize(len + 16, 0);
    }
    let line = (64 - buffer.as_ptr() as usize % 64) % 64 / 4;
    &mut buffer[line..line + len]
}

/// `f(0..parts)`, in parallel when there is more than one.
pub(super) fn for_each_part(parts: usize, f: impl Fn(usize) + Sync + Send) {
    if parts > 1 {
        use rayon::prelude::*;
        (0..parts).into_par_iter().for_each(f);
    } else if parts == 1 {
        f(0)
    }
}

/// A micro-tile's result when it overhangs `c`, aligned for the tile stores.
#[repr(C, align(64))]
pub(super) struct EdgeTile([f32; 32 * 32]);

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
pub(super) unsafe fn blocked<P: Tiles>(
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
    let c = SendPtr(c);
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
                let pb_ptr = SendPtr(pb.as_mut_ptr());
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
                    // Every panel is written (above) and no longer written.
                    let pb = BPanels {
                        at: pb_ptr.get(),
                        pairs: kp,
                    };
                    // SAFETY: the threads write disjoint rows of `c`, all inside it.
                    while let Some(rows) = claim_rows(&next_row, m, mr, parts) {
                        rows_against::<P>(
                            Left::View(a),
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
pub(super) fn claim_rows(
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
pub(super) fn needed<P: Tiles>(
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

/// The left operand of [`rows_against`]: a view, whose blocks are packed there, or panels packed
/// before the product ([`super::PackedA`]).
#[derive(Clone, Copy)]
pub(super) enum Left<'a> {
    View(Operand<'a>),
    Packed(APanels),
}

/// Panels of `a` packed before a product, from its first row and pair: the panel of rows
/// `MR·i..MR·(i + 1)` from `at + i·panel`, laid out as `layout` says; every panel whole (`MR` rows
/// readable, those past the product's rows never stored).
#[derive(Clone, Copy)]
pub(super) struct APanels {
    pub at: *const u32,
    pub panel: usize,
    pub layout: APanel,
}

/// Packed panels of `b`, `NR` columns each: panel `j`'s pair `p` from `at + (j·pairs + p)·NR`. A
/// block packed for one product, or a part of an operand packed once for many
/// ([`super::PackedB`]), whose panels are deeper than the product.
#[derive(Clone, Copy)]
pub(super) struct BPanels {
    pub at: *const u32,
    pub pairs: usize,
}

/// `c[rows, jc..jc + nc] (+)= a[rows, pairs] · b-block` on this thread: `pb` holds the block of `b`
/// packed (`kp` pairs from pair `pc`, of `k` values, in panels `pb.pairs` deep: `kp` for a block
/// packed for this product), the rows' blocks of `a` packed here (or before: [`Left::Packed`],
/// whose panels start at row 0, so `rows` starts on one). Under a causal `mask`, the micro-tiles
/// past its edge are skipped, and those along it run over the pairs they need (packed alone, panel
/// by panel).
///
/// # Safety
/// As [`blocked`]; no one else touches these rows of `c`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_against<P: Tiles>(
    a: Left,
    rows: std::ops::Range<usize>,
    m: usize,
    (pc, kp, k): (usize, usize, usize),
    pb: BPanels,
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
            let (panels_a, panels_b) = (mc.div_ceil(mr), nc.div_ceil(nr));
            let panel_rows = |im: usize| mr.min(m - (ic + im * mr));
            // The panels of this block of rows: packed here, or before the product.
            let packed_here = match a {
                Left::View(a) => {
                    let pa = aligned(&mut buffer, mc.div_ceil(mr) * mr * kp);
                    if depth_masked {
                        // Each panel's pairs alone: a panel is `[pair][MR]`, so pairs `s..e` are
                        // a run.
                        for im in 0..panels_a {
                            let (_, pairs) =
                                needed::<P>(mask, ic + im * mr, panel_rows(im), (pc, kp, k));
                            let run =
                                &mut pa[(im * kp + pairs.start) * mr..(im * kp + pairs.end) * mr];
                            let k0 = 2 * (pc + pairs.start);
                            P::pack_a(a, ic + im * mr, mr, m, k0, k, pairs.len(), run);
                        }
                    } else {
                        P::pack_a(a, ic, mc, m, 2 * pc, k, kp, pa);
                    }
                    pa.as_ptr()
                }
                Left::Packed(_) => std::ptr::null(),
            };
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
                let bp = pb.at.add((jn * pb.pairs + pairs.start) * nr);
                let (ap, layout) = match a {
                    // The panel's pairs from the first needed: packed alone (depth-masked: a run
                    // of `pairs.len()`), or the panel whole (from pair 0).
                    Left::View(a) => (
                        packed_here.add((im * kp + pairs.start) * mr),
                        P::a_panel(a, if depth_masked { pairs.len() } else { kp }),
                    ),
                    Left::Packed(p) => (
                        p.at.add(
                            (ic + im * mr) / mr * p.panel + (pc + pairs.start) * p.layout.pair,
                        ),
                        p.layout,
                    ),
                };
                let dst = c.add(i * c_rs + j);
                if (rows == mr && cols == nr) || P::PART_BLOCKS {
                    P::micro(pairs.len(), ap, layout, bp, dst, c_rs, add, rows, cols);
                } else {
                    let tile = tile.get_or_insert_with(|| Box::new(EdgeTile([0.0; 32 * 32])));
                    let edge = tile.0.as_mut_ptr();
                    P::micro(pairs.len(), ap, layout, bp, edge, nr, false, mr, nr);
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

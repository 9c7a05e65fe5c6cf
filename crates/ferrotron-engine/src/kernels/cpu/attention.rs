//! Causal softmax attention with grouped-query heads, memory-efficient (FlashAttention-2's
//! algorithm, Dao 2023): forward walks each head's scores in tiles with an online softmax and keeps
//! only the output and each query row's log-sum-exp; backward recomputes each tile's probabilities
//! from Q, K and the log-sum-exp. No T×T matrix exists: the scratch is a few tiles per task.
//!
//! Q, K, V are token-major (`[tokens, heads·d]`); each head is read in place through strides, and
//! a query head reads its KV head in place (grouped-query heads share it, nothing is repeated).
//! Tiles wholly above the causal diagonal, or wholly before a sliding window, are never computed.

use super::bf16_gemm::PackedA;
use super::exp2_rows;
use super::small_gemm::{self, Causal};
use super::threads::SendPtr;
use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::simd::{self, simd_kernel};
use crate::kernels::{extent, AttnBlock, AttnGradInputs, AttnShape, Qkv, QkvGrads};
use ferrotron_core::precision::Products;

/// `c (+)= a·b` on raw pointers with (row, column) strides. Callers guarantee bounds and that
/// concurrent tasks write disjoint elements. Under bf16 products (`bf16`, f32 values, `c` rows
/// contiguous) the bf16 GEMM, operands rounded as they are packed, skipping what `mask` says
/// tile by tile (masked columns are left unwritten: callers overwrite or zero them); in f32, with
/// `b` and `c` rows contiguous, the AVX-512 kernel made for these shapes; otherwise the `gemm`
/// crate.
pub(super) unsafe fn gemm_raw<T: Real>(
    (m, n, k): (usize, usize, usize),
    a: (*const T, usize, usize),
    b: (*const T, usize, usize),
    c: (*mut T, usize, usize),
    accumulate: bool,
    mask: Causal,
    bf16: bool,
) {
    if bf16 && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() && c.2 == 1 {
        use super::bf16_gemm::{gemm_into, Operand};
        let (ae, be) = (extent(m, k, a.1, a.2), extent(k, n, b.1, b.2));
        let av = std::slice::from_raw_parts(a.0.cast::<f32>(), ae);
        let bv = std::slice::from_raw_parts(b.0.cast::<f32>(), be);
        let (ao, bo) = (Operand::F32(av, a.1, a.2), Operand::F32(bv, b.1, b.2));
        if gemm_into(m, n, k, ao, bo, c.0.cast(), c.1, accumulate, mask) {
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && b.2 == 1
        && c.2 == 1
        && small_gemm::available()
    {
        small_gemm::gemm_f32(
            (m, n, k),
            (a.0.cast(), a.1, a.2),
            (b.0.cast(), b.1),
            (c.0.cast(), c.1),
            accumulate,
            mask,
        );
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        c.0,
        c.2 as isize,
        c.1 as isize,
        accumulate,
        a.0,
        a.2 as isize,
        a.1 as isize,
        b.0,
        b.2 as isize,
        b.1 as isize,
        T::ONE,
        T::ONE,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// Head columns `[off, off + d)` of the `t` token rows of `x` (row stride `width`), transposed to
/// `d` rows of `t` (row stride `t +` [`ROW_PAD`]): Kᵀ and Vᵀ as right operands with contiguous
/// rows.
fn transposed_head<T: Real>(x: &[T], off: usize, width: usize, t: usize, d: usize) -> Vec<T> {
    // In blocks of 16 tokens, so that each output row is written 16 contiguous elements at a time
    // while the block's 16 input rows stay in L1.
    const BLOCK: usize = 16;
    let stride = t + ROW_PAD;
    let mut out = vec![T::ZERO; d * stride];
    for j0 in (0..t).step_by(BLOCK) {
        let j1 = (j0 + BLOCK).min(t);
        for c in 0..d {
            for (j, o) in (j0..j1).zip(&mut out[c * stride + j0..c * stride + j1]) {
                *o = x[off + j * width + c];
            }
        }
    }
    out
}

/// Elements added to the row stride of the kernels' row-major scratch (transposed heads, tiles of
/// probabilities): the products walk down their columns, and with a power-of-two stride (2–16 KiB)
/// every row would fall in the same cache set and evict the one before.
pub(super) const ROW_PAD: usize = 16;

/// Whether attention's products run on the bf16 GEMM (bf16 products on a CPU with bf16
/// instructions): it takes a head of K or V as a transposed view (its packing transposes anyway),
/// so no transposed copy is made.
pub(super) fn on_bf16_gemm<T: Real>(products: Products) -> bool {
    products == Products::Bf16
        && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && super::bf16_gemm::best_path() != super::bf16_gemm::Path::F32Gemm
}

/// How one call's products run, chosen once: the bf16 GEMM on right operands packed once per head
/// (AVX512_BF16) or reading heads in place (AMX, which packs per product), the f32 register-tile
/// kernel on operands packed once per head, or the `gemm` crate on transposed copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProductPath {
    Bf16Packed,
    Bf16InPlace,
    #[cfg(target_arch = "x86_64")]
    Packed(small_gemm::Kernel),
    Copied,
}

pub(super) fn product_path<T: Real>(products: Products) -> ProductPath {
    if on_bf16_gemm::<T>(products) {
        if super::bf16_gemm::PackedB::available() {
            return ProductPath::Bf16Packed;
        }
        return ProductPath::Bf16InPlace;
    }
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
        if let Some(kernel) = small_gemm::best() {
            return ProductPath::Packed(kernel);
        }
    }
    ProductPath::Copied
}

/// One head's rows (`t × d`, token-major inside a wider tensor) of K, V, Q or dO, or their
/// transpose (`d × t`), as the right operand of the tiles' products: made once per head (or row
/// tile) and read by every tile.
pub(super) enum HeadOperand<T> {
    /// Element `(p, j)` at `ptr + p·rs + j·cs`: the head itself.
    Strided(*const T, usize, usize),
    /// A transposed copy and its row stride.
    Copied(Vec<T>, usize),
    #[cfg(target_arch = "x86_64")]
    Packed(small_gemm::Packed),
    /// Rounded to bf16 and packed for the bf16 GEMM.
    PackedBf16(super::bf16_gemm::PackedB),
}

impl<T: Real> HeadOperand<T> {
    pub(super) fn empty() -> Self {
        HeadOperand::Strided(std::ptr::null(), 0, 0)
    }

    /// Makes this operand the head at columns `off..off + d` of the `t` rows of `x` (row stride
    /// `width`), transposed or not, reusing its packed buffer. The inputs of one kernel call do not
    /// change, and the operand lives in that call's scratch: the head it already holds (the next
    /// query head of a grouped KV head) is not packed again.
    pub(super) fn set(
        &mut self,
        path: ProductPath,
        x: &[T],
        (off, width): (usize, usize),
        (t, d): (usize, usize),
        transposed: bool,
    ) {
        assert!(
            t == 0 || off + (t - 1) * width + d <= x.len(),
            "attention: a head outside its tensor"
        );
        let head = x[off..].as_ptr();
        // The packed paths' view of the head (T is f32 on them).
        let (shape, view) = if transposed {
            ((d, t), (head.cast::<f32>(), 1, width))
        } else {
            ((t, d), (head.cast::<f32>(), width, 1))
        };
        *self = match path {
            #[cfg(target_arch = "x86_64")]
            ProductPath::Packed(kernel) => {
                let mut packed = match std::mem::replace(self, HeadOperand::empty()) {
                    HeadOperand::Packed(p) => p,
                    _ => small_gemm::Packed::new(kernel),
                };
                if !packed.holds(shape, view) {
                    // SAFETY: the head's elements lie inside `x` (asserted); T is f32 here.
                    unsafe { packed.pack(shape, view) };
                }
                HeadOperand::Packed(packed)
            }
            ProductPath::Bf16Packed => {
                let mut packed = match std::mem::replace(self, HeadOperand::empty()) {
                    HeadOperand::PackedBf16(p) => p,
                    _ => super::bf16_gemm::PackedB::new(),
                };
                if !packed.holds(shape, view) {
                    // SAFETY: as above; the bf16 path runs here.
                    unsafe { packed.pack(shape, view) };
                }
                HeadOperand::PackedBf16(packed)
            }
            ProductPath::Copied if transposed => {
                HeadOperand::Copied(transposed_head(x, off, width, t, d), t + ROW_PAD)
            }
            _ if transposed => HeadOperand::Strided(head, 1, width),
            _ => HeadOperand::Strided(head, width, 1),
        };
    }

    /// The operand from row `row0` and column `col0` on.
    pub(super) fn at(&self, row0: usize, col0: usize) -> Right<'_, T> {
        match self {
            // SAFETY (both): offsets inside the operand, which the products' shapes respect.
            HeadOperand::Strided(ptr, rs, cs) => {
                Right::Strided(unsafe { ptr.add(row0 * rs + col0 * cs) }, *rs, *cs)
            }
            HeadOperand::Copied(xt, rs) => {
                Right::Strided(unsafe { xt.as_ptr().add(row0 * rs + col0) }, *rs, 1)
            }
            #[cfg(target_arch = "x86_64")]
            HeadOperand::Packed(p) => Right::Packed(p, row0, col0),
            HeadOperand::PackedBf16(p) => Right::PackedBf16(p, row0, col0),
        }
    }
}

/// A product's right operand: through strides, or packed.
#[derive(Clone, Copy)]
pub(super) enum Right<'a, T> {
    Strided(*const T, usize, usize),
    #[cfg(target_arch = "x86_64")]
    Packed(&'a small_gemm::Packed, usize, usize),
    PackedBf16(&'a super::bf16_gemm::PackedB, usize, usize),
    #[cfg(not(target_arch = "x86_64"))]
    #[allow(dead_code)]
    Never(std::marker::PhantomData<&'a T>),
}

/// [`gemm_raw`] with the right operand a [`Right`].
///
/// # Safety
/// As [`gemm_raw`].
pub(super) unsafe fn product<T: Real>(
    mnk: (usize, usize, usize),
    a: (*const T, usize, usize),
    b: Right<'_, T>,
    c: (*mut T, usize, usize),
    accumulate: bool,
    mask: Causal,
    bf16: bool,
) {
    match b {
        Right::Strided(ptr, rs, cs) => gemm_raw(mnk, a, (ptr, rs, cs), c, accumulate, mask, bf16),
        #[cfg(target_arch = "x86_64")]
        Right::Packed(packed, row0, col0) => {
            assert!(
                c.2 == 1,
                "attention: a packed product's output rows are contiguous"
            );
            small_gemm::gemm_f32_packed(
                mnk,
                (a.0.cast(), a.1, a.2),
                (packed, row0, col0),
                (c.0.cast(), c.1),
                accumulate,
                mask,
            )
        }
        Right::PackedBf16(packed, row0, col0) => {
            use super::bf16_gemm::{gemm_packed_b, Operand};
            assert!(
                c.2 == 1,
                "attention: a packed product's output rows are contiguous"
            );
            let (m, _, k) = mnk;
            let av = std::slice::from_raw_parts(a.0.cast::<f32>(), extent(m, k, a.1, a.2));
            let a_f32 = Operand::F32(av, a.1, a.2);
            let b = (packed, row0, col0);
            if !gemm_packed_b(mnk, a_f32, b, c.0.cast(), c.1, accumulate, mask) {
                // Not on its panels' edges: the view itself.
                let (ptr, rs, cs) = packed.view_at(row0, col0);
                gemm_raw(mnk, a, (ptr.cast(), rs, cs), c, accumulate, mask, bf16);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Right::Never(_) => unreachable!(),
    }
}

/// [`product`] whose left operand `a` was also [packed](PackedA) as it was computed (`packed`,
/// where it was): on a packed right operand the bf16 GEMM reads those panels, the same products in
/// the same order as packing `a` itself.
///
/// # Safety
/// As [`gemm_raw`]; `packed` holds `a`'s values.
#[allow(clippy::too_many_arguments)]
unsafe fn product_of_packed<T: Real>(
    mnk: (usize, usize, usize),
    a: (*const T, usize, usize),
    packed: Option<&PackedA>,
    b: Right<'_, T>,
    c: (*mut T, usize, usize),
    accumulate: bool,
    mask: Causal,
    bf16: bool,
) {
    if let (Some(pa), Right::PackedBf16(pb, row0, col0)) = (packed, b) {
        let (ptr, rs) = (c.0.cast::<f32>(), c.1);
        let b = (pb, row0, col0);
        if c.2 == 1 && super::bf16_gemm::gemm_packed_ab(mnk, pa, b, ptr, rs, accumulate, mask) {
            return;
        }
    }
    product(mnk, a, b, c, accumulate, mask, bf16)
}

/// `x` as the f32 values it is: the bf16 GEMM's operands (T is f32 wherever it runs).
fn f32s<T: Real>(x: &[T]) -> &[f32] {
    T::as_f32(x).expect("attention: packed bf16 operands are made from f32 values")
}

/// Query rows and key columns of a backward tile: large enough that each tile's products amortise
/// the GEMM's packing and dispatch (measured on `bench attention`: 64×64 tiles ran the 4096-token
/// backward 20% slower than 256×512; 128×256 and 64×256 ran within noise of it on the AVX2
/// kernel), small enough that a tile of scores (512 KiB) stays in a core's L2 on most CPUs.
const BACKWARD_TILE: (usize, usize) = (256, 512);

/// The forward's tile: fewer query rows (eight panels of the AVX512_BF16 micro-kernel's 14), so
/// that its scores and their rounded copy (about 340 KiB) leave more of L2 to the head's K and V
/// (measured: bf16 forward 3% faster at 2048 tokens on 2 threads, in 15 of 20 alternated runs; f32
/// unchanged). The backward's tile needs the most scratch, which the planner prices.
const FORWARD_TILE: (usize, usize) = (112, 512);

/// The tile of a block: `sizes`, or the block's whole queries or keys where they are fewer (so a
/// short sequence's scratch is no larger than it needs).
fn tile(b: &AttnBlock, sizes: (usize, usize)) -> (usize, usize) {
    (sizes.0.min(b.q.len).max(1), sizes.1.min(b.k.len).max(1))
}

/// The key tiles `[c0, c1)` (rows of the block's keys) the block's query rows `[r0, r1)` see: from
/// the tile holding the first key of row `r0`'s window to their last query's diagonal, `bc` keys at
/// a time. Tiles wholly past the diagonal or before the window are never visited.
fn key_tiles(
    b: &AttnBlock,
    (r0, r1): (usize, usize),
    bc: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let (q, k) = (b.q, b.k);
    // Keys at positions up to the last query's; from the first query's window on.
    let hi = (q.position + r1).saturating_sub(k.position).min(k.len);
    let lo = b
        .shape
        .first_key(q.position + r0)
        .saturating_sub(k.position)
        .min(hi);
    (lo / bc * bc..hi)
        .step_by(bc)
        .map(move |c0| (c0, (c0 + bc).min(hi)))
}

/// The products' masks on a tile of query rows from `r0` and keys from `c0` (the GEMMs skip what
/// lies past the causal diagonal; the row functions zero it): for S and dP (columns past it), for
/// P·V and dS·K (depth past it), and for Pᵀ·dO and dSᵀ·Q (depth before it). A tile whose first
/// query precedes its first key has rows that see nothing: computed whole, zeroed by the rows.
fn tile_masks(b: &AttnBlock, r0: usize, c0: usize) -> [Causal; 3] {
    match (b.q.position + r0).checked_sub(b.k.position + c0) {
        Some(diag) => [
            Causal::Columns(diag),
            Causal::DepthUpTo(diag),
            Causal::DepthFrom(diag),
        ],
        None => [Causal::None; 3],
    }
}

/// The keys of tile `[c0, c1)` query row `i` of the block sees: `[lo, hi)` relative to `c0`
/// (empty when `lo == hi`).
fn visible(b: &AttnBlock, i: usize, (c0, c1): (usize, usize)) -> (usize, usize) {
    let at = b.q.position + i;
    let first = b.shape.first_key(at).saturating_sub(b.k.position);
    let last = (at + 1).saturating_sub(b.k.position);
    let lo = first.clamp(c0, c1) - c0;
    let hi = last.clamp(c0, c1) - c0;
    (lo, hi.max(lo))
}

simd_kernel! {
    /// One query row of a forward tile: scales its visible scores `row[lo..hi]` (by `scale2`, the
    /// softmax's scale times log2(e), so that exponentials are powers of two), folds them into the
    /// running maximum `m` (in the same units) and sum `l` (the output row `acc`, accumulated so far
    /// against the old maximum, is rescaled to the new one), and leaves the tile's probabilities
    /// against the new maximum in `row` (0 outside the visible keys, so the product with V adds
    /// nothing there), and rounded to bf16 in `rounded` where given (the row packed for that
    /// product: its values, then zero to its whole pairs; `row` is kept as well, for a product
    /// that cannot read the packed panels and multiplies the rows themselves).
    fn online_softmax_row<T: Real>(
        row: &mut [T],
        seen: (usize, usize),
        scale2: T,
        m: &mut T,
        l: &mut T,
        acc: &mut [T],
        rounded: Option<&mut [u16]>,
    ) {
        let ((lo, hi), n) = (seen, row.len());
        row[..lo].fill(T::ZERO);
        row[hi..n].fill(T::ZERO);
        let rounded = rounded.map(|r| {
            r[..lo].fill(0);
            r[hi..].fill(0);
            &mut r[lo..hi]
        });
        if lo == hi {
            return;
        }
        let seen = &mut row[lo..hi];
        // The scale is positive, so the largest scaled score is the largest score scaled.
        let tile_max = exp2_rows::max(seen) * scale2;
        // The first keys this row sees set its maximum; later ones raise it.
        let new_max = if *l == T::ZERO { tile_max } else { tile_max.max(*m) };
        let sum = match rounded {
            Some(r) => exp2_rows::affine_sum_rounded(seen, scale2, new_max, r),
            None => exp2_rows::affine_sum(seen, scale2, new_max),
        };
        if *l == T::ZERO {
            // Nothing accumulated yet (acc is zero).
            *l = sum;
        } else {
            let correction = (*m - new_max).exp2_fused();
            *l = *l * correction + sum;
            acc.iter_mut().for_each(|x| *x *= correction);
        }
        *m = new_max;
    }
}

/// One query row of a backward tile: the probabilities `P` of its scores `s` (in place) and the
/// scores' gradients `dS = P ⊙ (dP − D) · scale` (in place of `dp`), over its visible keys; 0
/// elsewhere. In one pass where the values are f32.
fn probabilities_and_gradients<T: Real>(
    s: &mut [T],
    dp: &mut [T],
    seen: (usize, usize),
    (scale2, lse2): (T, T),
    (d, scale): (T, T),
) {
    let (lo, hi) = seen;
    if let (Some(sv), Some(dpv)) = (
        T::as_f32_mut(&mut s[lo..hi]),
        T::as_f32_mut(&mut dp[lo..hi]),
    ) {
        let f = |x: T| x.to_f64() as f32;
        exp2_rows::probabilities_and_gradients(sv, dpv, (f(scale2), f(lse2)), (f(d), f(scale)));
        let n = s.len();
        for x in [s, dp] {
            x[..lo].fill(T::ZERO);
            x[hi..n].fill(T::ZERO);
        }
        return;
    }
    probabilities_row(s, seen, scale2, lse2);
    score_gradient_row(dp, s, seen, d, scale);
}

simd_kernel! {
    /// One query row of a backward tile: the probabilities `2^(scale2·s − lse2)` = `exp(scale·s −
    /// lse)` of its visible scores in place of `s` (`scale2` and `lse2` in units of log2(e)), 0
    /// elsewhere.
    fn probabilities_row<T: Real>(s: &mut [T], seen: (usize, usize), scale2: T, lse2: T) {
        let ((lo, hi), n) = (seen, s.len());
        s[..lo].fill(T::ZERO);
        s[hi..n].fill(T::ZERO);
        exp2_rows::affine_sum(&mut s[lo..hi], scale2, lse2);
    }
}

simd_kernel! {
    /// dS = P ⊙ (dP − D) · scale over one row's visible keys (D = rowsum(dO ⊙ O)), in place of dP;
    /// 0 elsewhere.
    fn score_gradient_row<T: Real>(dp: &mut [T], p: &[T], seen: (usize, usize), d: T, scale: T) {
        let ((lo, hi), n) = (seen, dp.len());
        dp[..lo].fill(T::ZERO);
        dp[hi..n].fill(T::ZERO);
        for (x, &p) in dp[lo..hi].iter_mut().zip(&p[lo..hi]) {
            *x = p * (*x - d) * scale;
        }
    }
}

fn check_lengths(b: &AttnBlock, q: usize, k: usize, v: usize, out: usize, lse: usize) {
    let s = b.shape;
    assert!(
        s.kv_heads > 0 && s.heads.is_multiple_of(s.kv_heads),
        "attention: heads not divisible by kv heads"
    );
    assert!(
        b.q.first + b.q.len <= b.q.rows && b.k.first + b.k.len <= b.k.rows,
        "attention: a block's rows outside its tensors"
    );
    assert_eq!(q, s.batch * b.q.rows * s.q_width(), "attention: q length");
    assert_eq!(k, s.batch * b.k.rows * s.kv_width(), "attention: k length");
    assert_eq!(v, s.batch * b.k.rows * s.kv_width(), "attention: v length");
    assert_eq!(
        out,
        s.batch * b.q.rows * s.q_width(),
        "attention: output length"
    );
    assert_eq!(
        lse,
        s.batch * s.heads * b.q.rows,
        "attention: log-sum-exp length"
    );
}

/// The left operands of forward's products, packed for the bf16 GEMM.
struct ForwardLeft {
    q: PackedA,
    probs: PackedA,
}

/// The left operands of backward's products, packed for the bf16 GEMM: the row tile's Q and dO
/// once for all its key tiles; a tile's Pᵀ, dS and dSᵀ as the rows of P and dS are made.
struct BackwardLeft {
    q: PackedA,
    dout: PackedA,
    probs_t: PackedA,
    dscores: PackedA,
    dscores_t: PackedA,
}

/// The `rows × d` head rows of `x` from `off` (row stride `width`) packed as a left operand.
fn pack_head_rows<T: Real>(
    packed: &mut PackedA,
    x: &[T],
    (off, width): (usize, usize),
    (rows, d): (usize, usize),
) {
    packed.by_rows(rows, d);
    for i in 0..rows {
        simd::prefetch(
            x[off..].as_ptr().wrapping_add((i + AHEAD) * width),
            d,
            false,
        );
        packed.set_row(i, f32s(&x[off + i * width..][..d]));
    }
}

/// Rows of a token-major tensor asked for ([`simd::prefetch`]) ahead of the one in hand.
const AHEAD: usize = 8;

/// Per task: a tile of scores, the output rows being accumulated, each row's running maximum and
/// sum, and the head's Kᵀ and V as right operands; on packed bf16 products, the left operands
/// packed: the row tile's Q once for all its key tiles, and each tile's P as its rows are made.
struct ForwardScratch<T> {
    scores: Vec<T>,
    packed: Option<ForwardLeft>,
    acc: Vec<T>,
    max: Vec<T>,
    sum: Vec<T>,
    kt: HeadOperand<T>,
    v: HeadOperand<T>,
}

/// One block of attention: its output rows (normalised over the block's keys) and, per (sequence,
/// head, query), the log-sum-exp of the query's scaled scores against them, which is all backward
/// needs besides Q, K, V and the output. A query that sees none of the block's keys gets a zero row
/// and −∞. Writes exactly the block's query rows of `out` and `lse`.
pub(crate) fn forward<T: Real>(
    threads: &Threads,
    products: Products,
    b: AttnBlock,
    Qkv { q, k, v }: Qkv<T>,
    out: &mut [T],
    lse: &mut [T],
) {
    check_lengths(&b, q.len(), k.len(), v.len(), out.len(), lse.len());
    let s = b.shape;
    let (tq, tk, d, qw, kw) = (b.q.len, b.k.len, s.head_dim, s.q_width(), s.kv_width());
    let scale2 = T::of(std::f64::consts::LOG2_E / (d as f64).sqrt());
    let (br, bc) = tile(&b, FORWARD_TILE);
    let (bf16, path) = (products == Products::Bf16, product_path::<T>(products));
    let (out_p, lse_p) = (SendPtr(out.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    let packing = path == ProductPath::Bf16Packed;
    let scratch = || ForwardScratch {
        scores: vec![T::ZERO; br * bc],
        packed: packing.then(|| ForwardLeft {
            q: PackedA::new(),
            probs: PackedA::new(),
        }),
        acc: vec![T::ZERO; br * d],
        max: vec![T::ZERO; br],
        sum: vec![T::ZERO; br],
        kt: HeadOperand::empty(),
        v: HeadOperand::empty(),
    };
    threads.for_tasks_with(s.batch * s.heads, scratch, |w, task| {
        let (seq, h) = (task / s.heads, task % s.heads);
        let kvh = h / (s.heads / s.kv_heads);
        let qo = (seq * b.q.rows + b.q.first) * qw + h * d;
        let ko = (seq * b.k.rows + b.k.first) * kw + kvh * d;
        let lo = (seq * s.heads + h) * b.q.rows + b.q.first;
        w.kt.set(path, k, (ko, kw), (tk, d), true);
        w.v.set(path, v, (ko, kw), (tk, d), false);
        for r0 in (0..tq).step_by(br) {
            let r1 = (r0 + br).min(tq);
            let m = r1 - r0;
            if let Some(packed) = &mut w.packed {
                pack_head_rows(&mut packed.q, q, (qo + r0 * qw, qw), (m, d));
            }
            w.acc[..m * d].fill(T::ZERO);
            w.max[..m].fill(T::ZERO);
            w.sum[..m].fill(T::ZERO);
            for (c0, c1) in key_tiles(&b, (r0, r1), bc) {
                let n = c1 - c0;
                let [columns, depth_up_to, _] = tile_masks(&b, r0, c0);
                // SAFETY: the tile's Q rows, K columns and V rows lie inside q, k and v (lengths
                // checked above); scores and acc are this task's scratch.
                unsafe {
                    // S = Q·Kᵀ over the tile.
                    product_of_packed(
                        (m, n, d),
                        (q.as_ptr().add(qo + r0 * qw), qw, 1),
                        w.packed.as_ref().map(|p| &p.q),
                        w.kt.at(0, c0),
                        (w.scores.as_mut_ptr(), n, 1),
                        false,
                        columns,
                        bf16,
                    );
                }
                if let Some(packed) = &mut w.packed {
                    packed.probs.by_rows(m, n);
                }
                for i in 0..m {
                    online_softmax_row(
                        &mut w.scores[i * n..(i + 1) * n],
                        visible(&b, r0 + i, (c0, c1)),
                        scale2,
                        &mut w.max[i],
                        &mut w.sum[i],
                        &mut w.acc[i * d..(i + 1) * d],
                        w.packed.as_mut().map(|p| p.probs.row_bf16_mut(i)),
                    );
                }
                unsafe {
                    // O += P·V over the tile.
                    product_of_packed(
                        (m, d, n),
                        (w.scores.as_ptr(), n, 1),
                        w.packed.as_ref().map(|p| &p.probs),
                        w.v.at(c0, 0),
                        (w.acc.as_mut_ptr(), d, 1),
                        true,
                        depth_up_to,
                        bf16,
                    );
                }
            }
            // SAFETY: this task alone writes head h of sequence `seq`: its output columns and its
            // log-sum-exp row, at the block's queries.
            unsafe {
                for i in 0..m {
                    let ahead = out_p.get().wrapping_add(qo + (r0 + i + AHEAD) * qw);
                    simd::prefetch(ahead, d, true);
                    let o = std::slice::from_raw_parts_mut(out_p.get().add(qo + (r0 + i) * qw), d);
                    let lse_i = lse_p.get().add(lo + r0 + i);
                    if w.sum[i] == T::ZERO {
                        o.fill(T::ZERO);
                        *lse_i = T::of(f64::NEG_INFINITY);
                        continue;
                    }
                    let inv = T::ONE / w.sum[i];
                    for (o, &a) in o.iter_mut().zip(&w.acc[i * d..(i + 1) * d]) {
                        *o = a * inv;
                    }
                    // Back to natural units: ln(2^max · sum).
                    let max = w.max[i].to_f64() * std::f64::consts::LN_2;
                    *lse_i = T::of(max + w.sum[i].to_f64().ln());
                }
            }
        }
    });
}

/// Folds block results into running ones, row by row: lse = log(e^lse + e^lse_b), and the output
/// the two outputs weighted by their share of it. A row the block did not see (−∞) is unchanged.
pub(crate) fn merge<T: Real>(
    threads: &Threads,
    s: AttnShape,
    out: &mut [T],
    lse: &mut [T],
    out_b: &[T],
    lse_b: &[T],
) {
    let (t, d, qw) = (s.seq, s.head_dim, s.q_width());
    assert!(
        out.len() == s.batch * t * qw && out_b.len() == out.len(),
        "attention merge: output lengths"
    );
    assert!(
        lse.len() == s.lse_len() && lse_b.len() == lse.len(),
        "attention merge: log-sum-exp lengths"
    );
    let (out_p, lse_p) = (SendPtr(out.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    threads.for_tasks_with(
        s.batch * s.heads,
        || (),
        |_, task| {
            let (seq, h) = (task / s.heads, task % s.heads);
            for i in 0..t {
                let l = (seq * s.heads + h) * t + i;
                let row = (seq * t + i) * qw + h * d;
                // SAFETY: this task alone touches head h of sequence `seq`.
                unsafe {
                    let (a, b) = (*lse_p.get().add(l), lse_b[l]);
                    if b.to_f64() == f64::NEG_INFINITY {
                        continue;
                    }
                    let o = std::slice::from_raw_parts_mut(out_p.get().add(row), d);
                    let ob = &out_b[row..row + d];
                    if a.to_f64() == f64::NEG_INFINITY {
                        o.copy_from_slice(ob);
                        *lse_p.get().add(l) = b;
                        continue;
                    }
                    let m = a.max(b);
                    let (wa, wb) = ((a - m).exp(), (b - m).exp());
                    let total = wa + wb;
                    let (wa, wb) = (wa / total, wb / total);
                    for (x, &y) in o.iter_mut().zip(ob) {
                        *x = *x * wa + y * wb;
                    }
                    *lse_p.get().add(l) = m + T::of(total.to_f64().ln());
                }
            }
        },
    );
}

/// Per task: a tile of probabilities and one of their gradients, per query row of the head in hand
/// the log-sum-exp in units of log2(e), and the right operands.
struct BackwardScratch<T> {
    probs: Vec<T>,
    dprobs: Vec<T>,
    /// The row stride of `probs` and `dprobs`: a tile's columns and [`ROW_PAD`].
    stride: usize,
    lse2: Vec<T>,
    /// On packed bf16 products, the left operands packed.
    packed: Option<BackwardLeft>,
    /// The KV head's Kᵀ, Vᵀ and K, and the row tile's Q and dO, as right operands.
    kt: HeadOperand<T>,
    vt: HeadOperand<T>,
    k: HeadOperand<T>,
    q_rows: HeadOperand<T>,
    dout_rows: HeadOperand<T>,
}

/// One block's share of the gradients at Q, K and V, recomputing each tile's probabilities from the
/// whole attention's log-sum-exp (and D from its output): adds into the block's query rows of `dq`
/// and key rows of `dk` and `dv`.
pub(crate) fn backward_block<T: Real>(
    threads: &Threads,
    products: Products,
    b: AttnBlock,
    inputs: AttnGradInputs<T>,
    QkvGrads { dq, dk, dv }: QkvGrads<T>,
) {
    let AttnGradInputs {
        dout,
        x: Qkv { q, k, v },
        out,
        lse,
    } = inputs;
    check_lengths(&b, q.len(), k.len(), v.len(), out.len(), lse.len());
    assert!(
        dout.len() == q.len() && dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "attention: gradient lengths"
    );
    let s = b.shape;
    let (tq, tk, d, qw, kw) = (b.q.len, b.k.len, s.head_dim, s.q_width(), s.kv_width());
    let group = s.heads / s.kv_heads;
    let scale = T::ONE / T::of(d as f64).sqrt();
    let scale2 = T::of(std::f64::consts::LOG2_E / (d as f64).sqrt());
    let (br, bc) = tile(&b, BACKWARD_TILE);
    let (bf16, path) = (products == Products::Bf16, product_path::<T>(products));
    let (dq_p, dk_p, dv_p) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    let stride = bc + ROW_PAD;
    let packing = path == ProductPath::Bf16Packed;
    let scratch = || BackwardScratch {
        packed: packing.then(|| BackwardLeft {
            q: PackedA::new(),
            dout: PackedA::new(),
            probs_t: PackedA::new(),
            dscores: PackedA::new(),
            dscores_t: PackedA::new(),
        }),
        probs: vec![T::ZERO; br * stride],
        dprobs: vec![T::ZERO; br * stride],
        stride,
        lse2: vec![T::ZERO; tq],
        kt: HeadOperand::empty(),
        vt: HeadOperand::empty(),
        k: HeadOperand::empty(),
        q_rows: HeadOperand::empty(),
        dout_rows: HeadOperand::empty(),
    };
    let delta = row_deltas(threads, &b, dout, out);
    // One task per (sequence, KV head): the query heads that share a KV head accumulate into its
    // dK/dV one after another, so no two tasks write the same element.
    threads.for_tasks_with(s.batch * s.kv_heads, scratch, |w, task| {
        let (seq, kvh) = (task / s.kv_heads, task % s.kv_heads);
        let ko = (seq * b.k.rows + b.k.first) * kw + kvh * d;
        w.kt.set(path, k, (ko, kw), (tk, d), true);
        w.vt.set(path, v, (ko, kw), (tk, d), true);
        w.k.set(path, k, (ko, kw), (tk, d), false);
        for j in 0..group {
            let h = kvh * group + j;
            let qo = (seq * b.q.rows + b.q.first) * qw + h * d;
            let lse = &lse[(seq * s.heads + h) * b.q.rows + b.q.first..][..tq];
            for (lse2, &lse) in w.lse2.iter_mut().zip(lse) {
                *lse2 = T::of(lse.to_f64() * std::f64::consts::LOG2_E);
            }
            let head = HeadViews {
                delta: &delta[(seq * s.heads + h) * tq..][..tq],
                q: q[qo..].as_ptr(),
                dout: dout[qo..].as_ptr(),
                qw,
                kw,
                // SAFETY: offsets inside the checked lengths.
                dq: unsafe { dq_p.get().add(qo) },
                dk: unsafe { dk_p.get().add(ko) },
                dv: unsafe { dv_p.get().add(ko) },
            };
            for r0 in (0..tq).step_by(br) {
                let r1 = (r0 + br).min(tq);
                let rows = (qo + r0 * qw, qw);
                w.q_rows.set(path, q, rows, (r1 - r0, d), false);
                w.dout_rows.set(path, dout, rows, (r1 - r0, d), false);
                if let Some(packed) = &mut w.packed {
                    pack_head_rows(&mut packed.q, q, rows, (r1 - r0, d));
                    pack_head_rows(&mut packed.dout, dout, rows, (r1 - r0, d));
                }
                for keys in key_tiles(&b, (r0, r1), bc) {
                    // SAFETY: this task alone writes the kvh columns of dK and dV and its query
                    // heads' columns of dQ, for sequence `seq`; the tile's rows lie inside the
                    // checked lengths.
                    unsafe { backward_tile(&b, w, &head, (r0, r1), keys, (scale, scale2), bf16) };
                }
            }
        }
    });
}

/// D = rowsum(dO ⊙ O) of every query row of the block, per sequence, head and row
/// (`[batch][heads][tq]`).
/// Token row by token row, every head of a row at once: the tensors read front to back. (A head
/// at a time, 256 bytes every 2 KiB of both tensors, it took 2.5% of the backward at 2048 tokens;
/// this pass, ~1% less.)
fn row_deltas<T: Real>(threads: &Threads, b: &AttnBlock, dout: &[T], out: &[T]) -> Vec<T> {
    let s = b.shape;
    let (tq, d, qw) = (b.q.len, s.head_dim, s.q_width());
    let mut delta = vec![T::ZERO; s.batch * s.heads * tq];
    let delta_p = SendPtr(delta.as_mut_ptr());
    // Runs of rows, so that a task's reads are long.
    const ROWS: usize = 64;
    let runs = tq.div_ceil(ROWS);
    threads.for_tasks_with(
        s.batch * runs,
        || (),
        |_, task| {
            let (seq, run) = (task / runs, task % runs);
            for i in run * ROWS..((run + 1) * ROWS).min(tq) {
                let row = (seq * b.q.rows + b.q.first + i) * qw;
                for h in 0..s.heads {
                    let at = row + h * d;
                    // SAFETY: this task alone writes rows `run` of sequence `seq`, every head.
                    unsafe {
                        *delta_p.get().add((seq * s.heads + h) * tq + i) =
                            simd::dot(&dout[at..at + d], &out[at..at + d]);
                    }
                }
            }
        },
    );
    delta
}

/// One head of a backward task: D = rowsum(dO ⊙ O) of its query rows, its query-side rows (from
/// row 0 of the block, row stride `qw`), the key-side row stride `kw`, and where its gradients go.
struct HeadViews<'a, T> {
    delta: &'a [T],
    q: *const T,
    dout: *const T,
    qw: usize,
    kw: usize,
    dq: *mut T,
    dk: *mut T,
    dv: *mut T,
}

/// One backward tile, query rows `[r0, r1)` against keys `[c0, c1)` of the block: S = Q·Kᵀ and
/// dP = dO·Vᵀ; row by row P recomputed (exp(scale·S − lse)) and dS = P ⊙ (dP − D)·scale (packed as
/// they are made, on packed bf16 products); then dV += Pᵀ·dO, dQ += dS·K, dK += dSᵀ·Q.
///
/// # Safety
/// The views name rows inside their tensors, and no other thread writes the gradients' rows.
unsafe fn backward_tile<T: Real>(
    b: &AttnBlock,
    w: &mut BackwardScratch<T>,
    h: &HeadViews<T>,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    (scale, scale2): (T, T),
    bf16: bool,
) {
    let (m, n, d) = (r1 - r0, c1 - c0, b.shape.head_dim);
    let (qw, kw, ps) = (h.qw, h.kw, w.stride);
    let (dor, qr) = (h.dout.add(r0 * qw), h.q.add(r0 * qw));
    let [columns, depth_up_to, depth_from] = tile_masks(b, r0, c0);
    product_of_packed(
        (m, n, d),
        (qr, qw, 1),
        w.packed.as_ref().map(|p| &p.q),
        w.kt.at(0, c0),
        (w.probs.as_mut_ptr(), ps, 1),
        false,
        columns,
        bf16,
    );
    product_of_packed(
        (m, n, d),
        (dor, qw, 1),
        w.packed.as_ref().map(|p| &p.dout),
        w.vt.at(0, c0),
        (w.dprobs.as_mut_ptr(), ps, 1),
        false,
        columns,
        bf16,
    );
    if let Some(packed) = &mut w.packed {
        packed.probs_t.by_depth_pairs(n, m);
        packed.dscores.by_rows(m, n);
        packed.dscores_t.by_depth_pairs(n, m);
    }
    // Two rows at a time: a depth pair of Pᵀ and dSᵀ.
    for i in (0..m).step_by(2) {
        let pair = i..(i + 2).min(m);
        for r in pair.clone() {
            let row = r * ps..r * ps + n;
            let seen = visible(b, r0 + r, (c0, c1));
            let (p, dp) = (&mut w.probs[row.clone()], &mut w.dprobs[row]);
            probabilities_and_gradients(
                p,
                dp,
                seen,
                (scale2, w.lse2[r0 + r]),
                (h.delta[r0 + r], scale),
            );
            if let Some(packed) = &mut w.packed {
                packed.dscores.set_row(r, f32s(dp));
            }
        }
        if let Some(packed) = &mut w.packed {
            let pairs = [
                (&mut packed.probs_t, &w.probs),
                (&mut packed.dscores_t, &w.dprobs),
            ];
            for (packed, x) in pairs {
                let first = f32s(&x[i * ps..i * ps + n]);
                let second = (pair.len() == 2).then(|| f32s(&x[(i + 1) * ps..(i + 1) * ps + n]));
                packed.set_depth_pair(i / 2, first, second);
            }
        }
    }
    let packed = w.packed.as_ref();
    let [pt, ds, dst] = [
        packed.map(|p| &p.probs_t),
        packed.map(|p| &p.dscores),
        packed.map(|p| &p.dscores_t),
    ];
    let (dv, dk) = (h.dv.add(c0 * kw), h.dk.add(c0 * kw));
    product_of_packed(
        (n, d, m),
        (w.probs.as_ptr(), 1, ps),
        pt,
        w.dout_rows.at(0, 0),
        (dv, kw, 1),
        true,
        depth_from,
        bf16,
    );
    let ds_view = w.dprobs.as_ptr();
    product_of_packed(
        (m, d, n),
        (ds_view, ps, 1),
        ds,
        w.k.at(c0, 0),
        (h.dq.add(r0 * qw), qw, 1),
        true,
        depth_up_to,
        bf16,
    );
    product_of_packed(
        (n, d, m),
        (ds_view, 1, ps),
        dst,
        w.q_rows.at(0, 0),
        (dk, kw, 1),
        true,
        depth_from,
        bf16,
    );
}

/// The gradients at Q, K and V of whole-sequence attention: every element of `dq`, `dk` and `dv`
/// is written, none read.
pub(crate) fn backward<T: Real>(
    threads: &Threads,
    products: Products,
    s: AttnShape,
    inputs: AttnGradInputs<T>,
    grads: QkvGrads<T>,
) {
    grads.dq.fill(T::ZERO);
    grads.dk.fill(T::ZERO);
    grads.dv.fill(T::ZERO);
    backward_block(threads, products, s.whole(), inputs, grads);
}

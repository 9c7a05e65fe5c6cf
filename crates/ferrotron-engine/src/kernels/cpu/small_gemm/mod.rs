//! The per-head products of attention in f32: `c (+)= a·b` where `b` and `c` have contiguous rows.
//! These are small (a tile of 256 queries × 512 keys × a head of 64) and many (every tile of every
//! head), the size at which a general GEMM's blocking and dispatch cost more than they save, and
//! they come with causal masks a general GEMM cannot skip. Two register-tile kernels, picked at run
//! time: AVX-512 (`avx512.rs`: 4 × 64 tiles of `c`, `b` read in place) and AVX2+FMA (`avx2.rs`:
//! 6 × 16 tiles, `b` packed once per product into 16-column panels, since with 16 registers a tile
//! is too narrow to read `b`'s rows in place without conflict misses).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests;

/// The register-tile kernel a product runs on.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Avx512,
    Avx2,
}

/// The fastest kernel this CPU runs, if any.
#[cfg(target_arch = "x86_64")]
pub(crate) fn best() -> Option<Kernel> {
    if std::arch::is_x86_feature_detected!("avx512f") {
        Some(Kernel::Avx512)
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        Some(Kernel::Avx2)
    } else {
        None
    }
}

/// Whether [`gemm_f32`] may be called on this CPU.
#[cfg(target_arch = "x86_64")]
pub(crate) fn available() -> bool {
    best().is_some()
}

/// `c[m×n] (+)= a[m×k]·b[k×n]` on the fastest kernel. `a` is read element by element through
/// (row, column) strides, so a transposed view is free; `b` and `c` rows are contiguous with row
/// strides `b_rs` and `c_rs`. Each element of `c` is one fused multiply-add chain over `k` in
/// order (added to `c` at the end when accumulating), so results do not depend on how the work is
/// cut. `mask` skips work in row tiles; columns it skips are left as they were.
///
/// # Safety
/// [`available`] must be true, and every element the views name must lie inside its allocation, with
/// `c` not overlapping `a` or `b`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm_f32(
    mnk: (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    match best() {
        Some(kernel) => gemm_f32_on(kernel, mnk, a, b, c, accumulate, mask),
        None => panic!("small_gemm::gemm_f32 called on a CPU without AVX2+FMA or AVX-512"),
    }
}

/// [`gemm_f32`] on a given kernel (the tests run each one this CPU has).
///
/// # Safety
/// As [`gemm_f32`], and the CPU runs `kernel`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm_f32_on(
    kernel: Kernel,
    mnk: (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    match kernel {
        Kernel::Avx512 => avx512::gemm(mnk, a, b, c, accumulate, mask),
        Kernel::Avx2 => avx2::gemm(mnk, a, b, c, accumulate, mask),
    }
}

/// A right operand `b[k×n]` laid out once for a kernel, for the many products that read it (every
/// tile of an attention head multiplies the same K, V, Q or dO; packing `b` per product cost 5–7%
/// of the products' time on the AVX2 kernel, measured by `perf` at 4096 tokens). AVX2: 16-column
/// panels of all `k` rows. AVX-512 (which reads rows in place): contiguous rows with a padded
/// stride.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Packed {
    kernel: Kernel,
    data: Vec<f32>,
    k: usize,
    n: usize,
    /// The view last laid out.
    source: PackedFrom,
}

/// The view a packed operand was last laid out from, if any: `(k, n)`, then `(address, row stride,
/// column stride)` (this kernel's [`Packed`], and the bf16 GEMM's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PackedFrom(pub Option<PackedView>);

/// `(k, n)`, then `(address, row stride, column stride)`.
pub(crate) type PackedView = ((usize, usize), (usize, usize, usize));

impl PackedFrom {
    /// Whether it is this very view (same shape, address and strides): a caller whose source has
    /// not changed since need not pack it again.
    pub(crate) fn holds(&self, (k, n): (usize, usize), b: (*const f32, usize, usize)) -> bool {
        self.0 == Some(((k, n), (b.0 as usize, b.1, b.2)))
    }
    pub(crate) fn set(&mut self, (k, n): (usize, usize), b: (*const f32, usize, usize)) {
        self.0 = Some(((k, n), (b.0 as usize, b.1, b.2)));
    }
}

#[cfg(target_arch = "x86_64")]
impl Packed {
    /// Empty, for `kernel`'s layout.
    pub(crate) fn new(kernel: Kernel) -> Self {
        Self {
            kernel,
            data: Vec::new(),
            k: 0,
            n: 0,
            source: PackedFrom(None),
        }
    }

    /// Whether the last [`Packed::pack`] laid out this very view ([`PackedFrom::holds`]).
    pub(crate) fn holds(&self, shape: (usize, usize), b: (*const f32, usize, usize)) -> bool {
        self.source.holds(shape, b)
    }

    /// Lays out `b[k×n]`, element `(p, j)` at `b.0 + p·b.1 + j·b.2` (a transposed view is
    /// `(ptr, 1, row stride)`), reusing this operand's buffer.
    ///
    /// # Safety
    /// Every element the view names lies inside its allocation; the CPU runs the kernel.
    pub(crate) unsafe fn pack(&mut self, (k, n): (usize, usize), b: (*const f32, usize, usize)) {
        (self.k, self.n) = (k, n);
        self.source.set((k, n), b);
        match self.kernel {
            Kernel::Avx2 => avx2::pack(&mut self.data, (k, n), b),
            Kernel::Avx512 => {
                let stride = self.avx512_stride();
                self.data.resize(k * stride, 0.0);
                for p in 0..k {
                    for (j, x) in self.data[p * stride..p * stride + n].iter_mut().enumerate() {
                        *x = *b.0.add(p * b.1 + j * b.2);
                    }
                }
            }
        }
    }

    /// AVX-512's row stride: the columns and 16, so that rows 2–16 KiB apart do not share a cache
    /// set.
    fn avx512_stride(&self) -> usize {
        self.n + 16
    }
}

/// [`gemm_f32`] with `b` the rows `[row0, row0 + k)` and columns `[col0, col0 + n)` of a packed
/// operand (`col0` a multiple of 16).
///
/// # Safety
/// As [`gemm_f32`]; the product lies inside the packed operand, and the CPU runs its kernel.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn gemm_f32_packed(
    (m, n, k): (usize, usize, usize),
    a: (*const f32, usize, usize),
    (b, row0, col0): (&Packed, usize, usize),
    c: (*mut f32, usize),
    accumulate: bool,
    mask: Causal,
) {
    assert!(
        row0 + k <= b.k && col0 + n <= b.n && col0.is_multiple_of(avx2::PANEL),
        "small_gemm: a product outside its packed operand"
    );
    if m == 0 || n == 0 {
        return;
    }
    match b.kernel {
        Kernel::Avx2 => {
            let panel_stride = b.k * avx2::PANEL;
            let at = b
                .data
                .as_ptr()
                .add(col0 / avx2::PANEL * panel_stride + row0 * avx2::PANEL);
            avx2::gemm_panels((m, n, k), a, (at, panel_stride), c, accumulate, mask)
        }
        Kernel::Avx512 => {
            let stride = b.avx512_stride();
            let at = b.data.as_ptr().add(row0 * stride + col0);
            avx512::gemm((m, n, k), a, (at, stride), c, accumulate, mask)
        }
    }
}

/// Where a causal mask makes part of a product unnecessary, for row `i` of `c`. Skipped depth
/// multiplies exact zeros, so skipping it changes no result; skipped columns are ones the caller
/// masks afterwards.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Causal {
    /// Everything is computed (no mask; the tests' reference).
    None,
    /// Only columns `j ≤ i + diag` are needed (scores, and their gradient, of queries `diag + i`).
    Columns(usize),
    /// Depth `p > i + diag` multiplies zeros (probabilities of queries `diag + i` past the diagonal).
    DepthUpTo(usize),
    /// Depth `p < i − diag` multiplies zeros (row `i` is key `i`; depth `p` is query `diag + p`).
    DepthFrom(usize),
}

impl Causal {
    /// The columns (from 0) and depth a tile of `rows` rows of `c` from row `i0` needs, of an
    /// `n`-column, depth-`k` product: the rest is masked or multiplies zeros.
    #[cfg(target_arch = "x86_64")]
    fn needed(self, i0: usize, rows: usize, n: usize, k: usize) -> (usize, std::ops::Range<usize>) {
        match self {
            Causal::None => (n, 0..k),
            Causal::Columns(diag) => ((i0 + rows + diag).min(n), 0..k),
            Causal::DepthUpTo(diag) => (n, 0..(i0 + rows + diag).min(k)),
            Causal::DepthFrom(diag) => (n, i0.saturating_sub(diag).min(k)..k),
        }
    }
}

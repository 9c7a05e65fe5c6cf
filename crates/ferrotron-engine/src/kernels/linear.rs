//! GEMM and the linear layer (both Hugging Face weight layouts) on the CPU.

use super::float::Real;
use super::{CpuBackend, LinearShape};
use ferrotron_core::model::WeightLayout;

/// Largest element offset a strided `rows × cols` view touches, plus one.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `c[m×n] (+)= a[m×k]·b[k×n]`; views are (slice, row stride, column stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_strided<T: Real>(
    be: &CpuBackend,
    m: usize,
    n: usize,
    k: usize,
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
    c: &mut [T],
    c_rs: usize,
    accumulate: bool,
    threaded: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // The views must lie inside their slices: this is what makes the raw-pointer call sound.
    assert!(
        extent(m, k, a.1, a.2) <= a.0.len(),
        "gemm: lhs view out of bounds"
    );
    assert!(
        extent(k, n, b.1, b.2) <= b.0.len(),
        "gemm: rhs view out of bounds"
    );
    assert!(
        extent(m, n, c_rs, 1) <= c.len(),
        "gemm: dst view out of bounds"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                c[r * c_rs..r * c_rs + n].fill(T::ZERO);
            }
        }
        return;
    }
    // A product with a side narrower than a register tile (LoRA's rank-r halves) is too thin to
    // split over threads: the fork/join costs more than its work.
    let par = if threaded && m.min(n).min(k) >= 16 {
        be.parallelism(2 * m * n * k)
    } else {
        gemm::Parallelism::None
    };
    // A threaded call allocates the crate's per-thread packing buffers for the call: kernel
    // workspace, which would otherwise count in the activations peak of a one-device run (3.5× the
    // stash on llama-tiny with 2 threads). Single-threaded calls (every device of a mesh) are
    // measured as before.
    let _workspace = matches!(par, gemm::Parallelism::Rayon(_))
        .then(|| crate::memory::scope(crate::memory::Term::Other));
    // SAFETY: bounds checked above; `c` is exclusively borrowed and does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_rs as isize,
            accumulate,
            a.0.as_ptr(),
            a.2 as isize,
            a.1 as isize,
            b.0.as_ptr(),
            b.2 as isize,
            b.1 as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        );
    }
}

pub(crate) fn forward<T: Real>(
    be: &CpuBackend,
    s: LinearShape,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) {
    let (i, o) = (s.in_dim, s.out_dim);
    // W viewed as the [in × out] right operand.
    let wv = match s.layout {
        WeightLayout::OutIn => (w, 1, i),
        _ => (w, o, 1),
    };
    gemm_strided(be, s.rows, o, i, (x, i, 1), wv, y, o, false, true);
    if let Some(b) = bias {
        be.for_rows(y, o, |_, row| {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y += b)
        });
    }
}

pub(crate) fn backward_input<T: Real>(
    be: &CpuBackend,
    s: LinearShape,
    dy: &[T],
    w: &[T],
    dx: &mut [T],
    acc: bool,
) {
    let (i, o) = (s.in_dim, s.out_dim);
    // dx[rows × in] = dy[rows × out] · W viewed as [out × in].
    let wv = match s.layout {
        WeightLayout::OutIn => (w, i, 1),
        _ => (w, 1, o),
    };
    gemm_strided(be, s.rows, i, o, (dy, o, 1), wv, dx, i, acc, true);
}

pub(crate) fn backward_weight<T: Real>(
    be: &CpuBackend,
    s: LinearShape,
    dy: &[T],
    x: &[T],
    dw: &mut [T],
    dbias: Option<&mut [T]>,
) {
    let (i, o, r) = (s.in_dim, s.out_dim, s.rows);
    match s.layout {
        // dW[out × in] += dyᵀ · x
        WeightLayout::OutIn => gemm_strided(be, o, i, r, (dy, 1, o), (x, i, 1), dw, i, true, true),
        // dW[in × out] += xᵀ · dy
        _ => gemm_strided(be, i, o, r, (x, 1, i), (dy, o, 1), dw, o, true, true),
    }
    if let Some(db) = dbias {
        column_sums_into(dy, o, db);
    }
}

/// `out[j] += Σ_r m[r][j]`, accumulated in f64 for accuracy.
pub(crate) fn column_sums_into<T: Real>(m: &[T], width: usize, out: &mut [T]) {
    let mut acc = vec![0f64; width];
    for row in m.chunks_exact(width) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v.to_f64();
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o += T::of(a);
    }
}

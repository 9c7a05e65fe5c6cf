//! GEMM and the linear layer (both Hugging Face weight layouts) on the CPU.

use super::bf16_convert;
use super::bf16_gemm::{self, Operand};
use super::float::Real;
use super::{extent, CpuBackend, LinearShape};
use ferrotron_core::model::WeightLayout;

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

/// A linear layer's product: on the bf16 GEMM when the backend says so (the operands are f32 here),
/// else [`gemm_strided`].
#[allow(clippy::too_many_arguments)]
fn product<T: Real>(
    be: &CpuBackend,
    m: usize,
    n: usize,
    k: usize,
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
    c: &mut [T],
    c_rs: usize,
    accumulate: bool,
) {
    if be.bf16_products {
        if let (Some(a0), Some(b0), Some(c0)) = (T::as_f32(a.0), T::as_f32(b.0), T::as_f32_mut(c)) {
            let (a, b) = (Operand::F32(a0, a.1, a.2), Operand::F32(b0, b.1, b.2));
            return bf16_gemm::gemm(m, n, k, a, b, c0, c_rs, accumulate, be.threads);
        }
    }
    gemm_strided(be, m, n, k, a, b, c, c_rs, accumulate, true)
}

/// Strides of W viewed as the forward's right operand, `[in × out]`.
fn forward_view(s: LinearShape) -> (usize, usize) {
    match s.layout {
        WeightLayout::OutIn => (1, s.in_dim),
        _ => (s.out_dim, 1),
    }
}

/// Strides of W viewed as the input gradient's right operand, `[out × in]`.
fn backward_input_view(s: LinearShape) -> (usize, usize) {
    match s.layout {
        WeightLayout::OutIn => (s.in_dim, 1),
        _ => (1, s.out_dim),
    }
}

/// `y[r] += b` for every row.
fn add_bias<T: Real>(be: &CpuBackend, y: &mut [T], bias: Option<&[T]>, o: usize) {
    if let Some(b) = bias {
        be.for_rows(y, o, |_, row| {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y += b)
        });
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
    let (rs, cs) = forward_view(s);
    product(be, s.rows, o, i, (x, i, 1), (w, rs, cs), y, o, false);
    add_bias(be, y, bias, o);
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
    let (rs, cs) = backward_input_view(s);
    product(be, s.rows, i, o, (dy, o, 1), (w, rs, cs), dx, i, acc);
}

/// [`forward`] with the weight in bf16 (the compute copy under bf16 mixed precision): read by the
/// bf16 GEMM as it is, or widened for the f32 one when the backend's products are f32.
pub(crate) fn forward_bf16(
    be: &CpuBackend,
    s: LinearShape,
    x: &[f32],
    w: &[half::bf16],
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    if !be.bf16_products {
        return forward(be, s, x, &bf16_convert::widened(w), bias, y);
    }
    let (i, o) = (s.in_dim, s.out_dim);
    let (rs, cs) = forward_view(s);
    let (xv, wv) = (Operand::F32(x, i, 1), Operand::Bf16(w, rs, cs));
    bf16_gemm::gemm(s.rows, o, i, xv, wv, y, o, false, be.threads);
    add_bias(be, y, bias, o);
}

/// [`backward_input`] with the weight in bf16 (see [`forward_bf16`]).
pub(crate) fn backward_input_bf16(
    be: &CpuBackend,
    s: LinearShape,
    dy: &[f32],
    w: &[half::bf16],
    dx: &mut [f32],
    acc: bool,
) {
    if !be.bf16_products {
        return backward_input(be, s, dy, &bf16_convert::widened(w), dx, acc);
    }
    let (i, o) = (s.in_dim, s.out_dim);
    let (rs, cs) = backward_input_view(s);
    let (dyv, wv) = (Operand::F32(dy, o, 1), Operand::Bf16(w, rs, cs));
    bf16_gemm::gemm(s.rows, i, o, dyv, wv, dx, i, acc, be.threads);
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
        WeightLayout::OutIn => product(be, o, i, r, (dy, 1, o), (x, i, 1), dw, i, true),
        // dW[in × out] += xᵀ · dy
        _ => product(be, i, o, r, (x, 1, i), (dy, o, 1), dw, o, true),
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

//! GEMM and the linear layer (both Hugging Face weight layouts) on the CPU.

use super::bf16_gemm::{self, Operand};
use super::f32_gemm::gemm_strided;
use super::threads::Threads;
use crate::kernels::bf16_convert;
use crate::kernels::float::Real;
use crate::kernels::LinearShape;
use ferrotron_core::model::WeightLayout;
use ferrotron_core::precision::Products;

/// A linear layer's product: on the bf16 GEMM when the backend says so (the operands are f32 here),
/// else [`gemm_strided`].
#[allow(clippy::too_many_arguments)]
fn product<T: Real>(
    threads: &Threads,
    products: Products,
    m: usize,
    n: usize,
    k: usize,
    a: (&[T], usize, usize),
    b: (&[T], usize, usize),
    c: &mut [T],
    c_rs: usize,
    accumulate: bool,
) {
    if products == Products::Bf16 {
        if let (Some(a0), Some(b0), Some(c0)) = (T::as_f32(a.0), T::as_f32(b.0), T::as_f32_mut(c)) {
            let (a, b) = (Operand::F32(a0, a.1, a.2), Operand::F32(b0, b.1, b.2));
            return bf16_gemm::gemm(m, n, k, a, b, c0, c_rs, accumulate, threads.count());
        }
    }
    gemm_strided(threads, m, n, k, a, b, c, c_rs, accumulate, true)
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
fn add_bias<T: Real>(threads: &Threads, y: &mut [T], bias: Option<&[T]>, o: usize) {
    if let Some(b) = bias {
        threads.for_rows(y, o, |_, row| {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y += b)
        });
    }
}

pub(crate) fn forward<T: Real>(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) {
    let (i, o) = (s.in_dim, s.out_dim);
    let (rs, cs) = forward_view(s);
    product(
        threads,
        products,
        s.rows,
        o,
        i,
        (x, i, 1),
        (w, rs, cs),
        y,
        o,
        false,
    );
    add_bias(threads, y, bias, o);
}

pub(crate) fn backward_input<T: Real>(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    dy: &[T],
    w: &[T],
    dx: &mut [T],
    acc: bool,
) {
    let (i, o) = (s.in_dim, s.out_dim);
    // dx[rows × in] = dy[rows × out] · W viewed as [out × in].
    let (rs, cs) = backward_input_view(s);
    product(
        threads,
        products,
        s.rows,
        i,
        o,
        (dy, o, 1),
        (w, rs, cs),
        dx,
        i,
        acc,
    );
}

/// [`forward`] with the weight in bf16 (the compute copy under bf16 mixed precision): read by the
/// bf16 GEMM as it is, or widened for the f32 one when the backend's products are f32.
pub(crate) fn forward_bf16(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    x: &[f32],
    w: &[half::bf16],
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    if !(products == Products::Bf16) {
        return forward(threads, products, s, x, &bf16_convert::widened(w), bias, y);
    }
    let (i, o) = (s.in_dim, s.out_dim);
    let (rs, cs) = forward_view(s);
    let (xv, wv) = (Operand::F32(x, i, 1), Operand::Bf16(w, rs, cs));
    bf16_gemm::gemm(s.rows, o, i, xv, wv, y, o, false, threads.count());
    add_bias(threads, y, bias, o);
}

/// [`backward_input`] with the weight in bf16 (see [`forward_bf16`]).
pub(crate) fn backward_input_bf16(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    dy: &[f32],
    w: &[half::bf16],
    dx: &mut [f32],
    acc: bool,
) {
    if !(products == Products::Bf16) {
        return backward_input(threads, products, s, dy, &bf16_convert::widened(w), dx, acc);
    }
    let (i, o) = (s.in_dim, s.out_dim);
    let (rs, cs) = backward_input_view(s);
    let (dyv, wv) = (Operand::F32(dy, o, 1), Operand::Bf16(w, rs, cs));
    bf16_gemm::gemm(s.rows, i, o, dyv, wv, dx, i, acc, threads.count());
}

pub(crate) fn backward_weight<T: Real>(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    dy: &[T],
    x: &[T],
    dw: &mut [T],
    dbias: Option<&mut [T]>,
) {
    let (i, o, r) = (s.in_dim, s.out_dim, s.rows);
    match s.layout {
        // dW[out × in] += dyᵀ · x
        WeightLayout::OutIn => product(
            threads,
            products,
            o,
            i,
            r,
            (dy, 1, o),
            (x, i, 1),
            dw,
            i,
            true,
        ),
        // dW[in × out] += xᵀ · dy
        _ => product(
            threads,
            products,
            i,
            o,
            r,
            (x, 1, i),
            (dy, o, 1),
            dw,
            o,
            true,
        ),
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

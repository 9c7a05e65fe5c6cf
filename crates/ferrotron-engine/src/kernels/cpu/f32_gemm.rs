//! The f32 GEMM: the `gemm` crate's kernels over strided views, threaded when worth it.

use super::threads::Threads;
use crate::kernels::extent;
use crate::kernels::float::Real;

/// `c[m×n] (+)= a[m×k]·b[k×n]`; views are (slice, row stride, column stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_strided<T: Real>(
    threads: &Threads,
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
        threads.parallelism(2 * m * n * k)
    } else {
        gemm::Parallelism::None
    };
    // The crate's packing buffers are kernel workspace, `other` memory like the bf16 GEMM's: in the
    // activations they read as a second copy of the logits' gradient at the head (+14% of
    // llama-small's activations at 2 × 128 tokens), a buffer no activation model holds.
    let _workspace = crate::memory::scope(crate::memory::Term::Other);
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

//! A linear layer over an NF4 weight (a QLoRA base): the weight is dequantized a panel of its
//! output rows at a time, into the compute precision's operand, just before the GEMM packs it; no
//! full-precision copy of the matrix exists. The token rows are split over the threads, each with
//! its own panel (dequantizing costs `out × in` per thread, against `2 · rows/threads · out · in`
//! FLOP of product).

use super::linear::product;
use super::threads::{SendPtr, Threads};
use crate::kernels::nf4::Nf4Matrix;
use crate::kernels::LinearShape;
use crate::memory::{self, Term};
use ferrotron_core::precision::Products;

/// Values in one dequantized panel: big enough that the GEMM's packing of the activations is
/// spread over many output columns, small enough to stay in the L2 cache.
const PANEL_VALUES: usize = 1 << 15;

/// Output rows of `w` a panel holds: a multiple of 16, 16 to 256.
pub(crate) fn panel_rows(w: &Nf4Matrix) -> usize {
    ((PANEL_VALUES / w.cols.max(1)) & !15)
        .clamp(16, 256)
        .min(w.rows.max(1))
}

/// Token rows each thread takes, and how many threads: one below ~4 MFLOP of product.
fn split(threads: &Threads, rows: usize, w: &Nf4Matrix) -> (usize, usize) {
    let n = if 2 * rows * w.rows * w.cols >= 1 << 22 {
        threads.count().min(rows.div_ceil(16)).max(1)
    } else {
        1
    };
    let per = rows.div_ceil(n);
    (per, rows.div_ceil(per.max(1)))
}

/// Runs `f(token rows, panel scratch)` over blocks of token rows, in parallel.
fn over_token_blocks(
    threads: &Threads,
    rows: usize,
    w: &Nf4Matrix,
    f: &(dyn Fn(std::ops::Range<usize>, &mut Vec<f32>) + Sync),
) {
    let (per, blocks) = split(threads, rows, w);
    // The panel is kernel workspace, as the GEMM's packing buffers are.
    let scratch = || {
        let _w = memory::scope(Term::Other);
        Vec::with_capacity(panel_rows(w) * w.cols)
    };
    threads.for_tasks_with(blocks, scratch, |panel, b| {
        f(b * per..rows.min((b + 1) * per), panel)
    });
}

/// `y = x·Wᵀ (+ bias)`, `W` the `[out, in]` NF4 matrix.
pub(crate) fn forward(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    x: &[f32],
    w: &Nf4Matrix,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    let (i, o) = (s.in_dim, s.out_dim);
    check(s, w);
    assert!(
        x.len() >= s.rows * i && y.len() >= s.rows * o,
        "nf4 linear: operands"
    );
    let out = SendPtr(y.as_mut_ptr());
    let one = Threads::new(1);
    over_token_blocks(threads, s.rows, w, &|tokens, panel| {
        let m = tokens.len();
        // SAFETY: the blocks of token rows are disjoint, so each task writes its own rows of `y`.
        let y = unsafe { std::slice::from_raw_parts_mut(out.get().add(tokens.start * o), m * o) };
        let x = &x[tokens.start * i..tokens.end * i];
        let step = panel_rows(w);
        for r0 in (0..o).step_by(step) {
            let n = step.min(o - r0);
            panel.resize(n * i, 0.0);
            w.dequantize_rows(r0..r0 + n, panel);
            // y[:, r0..r0+n] = x · panelᵀ
            product(
                &one,
                products,
                m,
                n,
                i,
                (x, i, 1),
                (panel, 1, i),
                &mut y[r0..],
                o,
                false,
            );
        }
        if let Some(b) = bias {
            y.chunks_exact_mut(o)
                .for_each(|row| row.iter_mut().zip(b).for_each(|(y, &b)| *y += b));
        }
    });
}

/// `dx (+)= dy·W`, `W` the `[out, in]` NF4 matrix.
pub(crate) fn backward_input(
    threads: &Threads,
    products: Products,
    s: LinearShape,
    dy: &[f32],
    w: &Nf4Matrix,
    dx: &mut [f32],
    acc: bool,
) {
    let (i, o) = (s.in_dim, s.out_dim);
    check(s, w);
    assert!(
        dy.len() >= s.rows * o && dx.len() >= s.rows * i,
        "nf4 linear: operands"
    );
    let out = SendPtr(dx.as_mut_ptr());
    let one = Threads::new(1);
    over_token_blocks(threads, s.rows, w, &|tokens, panel| {
        let m = tokens.len();
        // SAFETY: as in `forward`, each task writes its own rows of `dx`.
        let dx = unsafe { std::slice::from_raw_parts_mut(out.get().add(tokens.start * i), m * i) };
        let dy = &dy[tokens.start * o..tokens.end * o];
        let step = panel_rows(w);
        for r0 in (0..o).step_by(step) {
            let n = step.min(o - r0);
            panel.resize(n * i, 0.0);
            w.dequantize_rows(r0..r0 + n, panel);
            // dx += dy[:, r0..r0+n] · panel
            let add = acc || r0 > 0;
            product(
                &one,
                products,
                m,
                i,
                n,
                (&dy[r0..], o, 1),
                (panel, i, 1),
                dx,
                i,
                add,
            );
        }
        if o == 0 && !acc {
            dx.fill(0.0);
        }
    });
}

fn check(s: LinearShape, w: &Nf4Matrix) {
    assert!(
        (w.rows, w.cols) == (s.out_dim, s.in_dim),
        "nf4 linear: a {}×{} weight for a {}→{} layer",
        w.rows,
        w.cols,
        s.in_dim,
        s.out_dim
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::model::WeightLayout;

    fn case(rows: usize, i: usize, o: usize) -> (LinearShape, Vec<f32>, Vec<f32>, Nf4Matrix) {
        let s = LinearShape {
            rows,
            in_dim: i,
            out_dim: o,
            layout: WeightLayout::OutIn,
        };
        let x: Vec<f32> = (0..rows * i)
            .map(|k| ((k * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let dy: Vec<f32> = (0..rows * o)
            .map(|k| ((k * 53) % 97) as f32 / 48.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..o * i)
            .map(|k| ((k * 7919) % 1009) as f32 / 5000.0 - 0.1)
            .collect();
        (s, x, dy, Nf4Matrix::quantize(&w, o, i))
    }

    #[test]
    fn panels_compute_the_product_of_the_dequantized_matrix() {
        // 300 output rows: several panels, the last one short; odd sizes everywhere.
        for threads in [1, 2] {
            let (s, x, dy, w) = case(70, 176, 300);
            let t = Threads::new(threads);
            let dense = w.dequantized();
            let mut y = vec![0f32; 70 * 300];
            let mut want = y.clone();
            forward(&t, Products::F32, s, &x, &w, None, &mut y);
            super::super::linear::forward(&t, Products::F32, s, &x, &dense, None, &mut want);
            let mut dx = vec![1f32; 70 * 176];
            let mut want_dx = dx.clone();
            backward_input(&t, Products::F32, s, &dy, &w, &mut dx, true);
            super::super::linear::backward_input(
                &t,
                Products::F32,
                s,
                &dy,
                &dense,
                &mut want_dx,
                true,
            );
            for (a, b) in y.iter().zip(&want).chain(dx.iter().zip(&want_dx)) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn no_full_precision_copy_of_the_matrix_is_made() {
        let (s, x, dy, w) = case(64, 1024, 2048);
        let f32_bytes = 4 * 1024 * 2048;
        let dev = 41;
        memory::set_device(dev);
        memory::reset_peaks(dev);
        let t = Threads::new(1);
        let mut y = vec![0f32; 64 * 2048];
        let mut dx = vec![0f32; 64 * 1024];
        let before = memory::device_memory(dev).peak_other();
        forward(&t, Products::F32, s, &x, &w, None, &mut y);
        backward_input(&t, Products::F32, s, &dy, &w, &mut dx, false);
        let scratch = memory::device_memory(dev).peak_other() - before;
        memory::clear_device();
        assert!(scratch > 0, "the panel is counted");
        assert!(
            (scratch as usize) <= f32_bytes / 8,
            "{scratch} bytes of scratch for a {f32_bytes}-byte f32 matrix"
        );
    }
}

//! A linear layer over an NF4 weight (a QLoRA base): the weight is dequantized a panel at a time
//! into the operand the GEMM packs, in the compute precision (f32, or bf16 under bf16 products);
//! no full-precision copy of the matrix exists. The threads split the weight (the forward its
//! output rows, the input gradient its input columns), so each value is dequantized once a call;
//! each thread multiplies its panels into its own columns of the output.

use super::bf16_gemm::{self, Operand, Path};
use super::f32_gemm::gemm_strided;
use super::threads::Threads;
use crate::kernels::bf16_convert;
use crate::kernels::nf4::Nf4Matrix;
use crate::kernels::LinearShape;
use crate::memory::{self, Term};
use ferrotron_core::precision::Products;
use rayon::prelude::*;
use std::ops::Range;

/// Values in one dequantized panel: big enough that the GEMM's packing of the activations is
/// spread over many output columns, small enough to stay in the L2 cache.
const PANEL_VALUES: usize = 1 << 16;

/// Rows of a panel `width` values wide: a multiple of 16, at least 16.
pub(crate) fn panel_rows(width: usize) -> usize {
    ((PANEL_VALUES / width.max(1)) & !15).max(16)
}

/// How a panel is multiplied: in f32; in bf16 on the bf16 instructions (the panel dequantized
/// into bf16); or in bf16 on the f32 GEMM where the CPU has none (both operands rounded to bf16,
/// as the bf16 GEMM's fallback does, the activations once a call rather than once a panel).
#[derive(Clone, Copy, PartialEq)]
enum Arithmetic {
    F32,
    Bf16,
    Bf16OnF32,
}

impl Arithmetic {
    fn of(products: Products) -> Self {
        match products {
            Products::F32 => Self::F32,
            Products::Bf16 if bf16_gemm::best_path() == Path::F32Gemm => Self::Bf16OnF32,
            Products::Bf16 => Self::Bf16,
        }
    }

    /// The activations as this arithmetic multiplies them: as they are, or rounded to bf16.
    fn operand<'a>(self, x: &'a [f32], rounded: &'a mut Vec<f32>) -> &'a [f32] {
        if self != Self::Bf16OnF32 {
            return x;
        }
        let _w = memory::scope(Term::Other);
        *rounded = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        rounded
    }
}

/// A thread's panel, dequantized into the arithmetic's operand.
#[derive(Default)]
struct Panel {
    f32: Vec<f32>,
    bf16: Vec<half::bf16>,
}

impl Panel {
    /// Rows `rows`, columns `cols` of `w`.
    fn fill(&mut self, arith: Arithmetic, w: &Nf4Matrix, rows: Range<usize>, cols: Range<usize>) {
        self.f32.resize(rows.len() * cols.len(), 0.0);
        w.dequantize(rows, cols, &mut self.f32);
        match arith {
            Arithmetic::F32 => {}
            Arithmetic::Bf16OnF32 => self.f32.iter_mut().for_each(|x| {
                *x = half::bf16::from_f32(*x).to_f32();
            }),
            Arithmetic::Bf16 => {
                self.bf16.resize(self.f32.len(), half::bf16::ZERO);
                bf16_convert::round_into(&self.f32, &mut self.bf16);
            }
        }
    }

    /// `c (+)= a · b`, `b` this panel viewed with strides `b_strides`.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        arith: Arithmetic,
        (m, n, k): (usize, usize, usize),
        a: (&[f32], usize, usize),
        b_strides: (usize, usize),
        c: &mut [f32],
        c_rs: usize,
        acc: bool,
    ) {
        let (rs, cs) = b_strides;
        match arith {
            Arithmetic::F32 | Arithmetic::Bf16OnF32 => {
                let one = Threads::new(1);
                gemm_strided(&one, m, n, k, a, (&self.f32, rs, cs), c, c_rs, acc, false)
            }
            Arithmetic::Bf16 => {
                let (av, bv) = (
                    Operand::F32(a.0, a.1, a.2),
                    Operand::Bf16(&self.bf16, rs, cs),
                );
                bf16_gemm::gemm(m, n, k, av, bv, c, c_rs, acc, 1)
            }
        }
    }
}

/// `len` cut into the threads' parts (multiples of 16 but the last): one part below ~4 MFLOP of
/// product, where the fork/join costs more than it saves.
fn parts(threads: &Threads, len: usize, flop: usize) -> Vec<Range<usize>> {
    let n = if flop >= 1 << 22 {
        threads.count().min(len.div_ceil(16)).max(1)
    } else {
        1
    };
    let per = len.div_ceil(n).div_ceil(16) * 16;
    (0..len)
        .step_by(per.max(1))
        .map(|s| s..len.min(s + per))
        .collect()
}

/// What a thread does with its part of the weight: `(part, its output, the output's row stride,
/// its panel)`.
type PartWork<'a> = dyn Fn(Range<usize>, &mut [f32], usize, &mut Panel) + Sync + 'a;

/// Runs `f(part, its output, its panel)` for every part, in parallel when there are several. With
/// one part, `f` writes `whole` directly (row stride `width`); with several, each its own block
/// (row stride the part's length), then copied (or, `acc`, added) into `whole`'s columns.
fn over_parts(
    parts: &[Range<usize>],
    rows: usize,
    whole: &mut [f32],
    width: usize,
    acc: bool,
    f: &PartWork,
) {
    let panel = || {
        let _w = memory::scope(Term::Other);
        Panel::default()
    };
    if let [only] = parts {
        return f(only.clone(), whole, width, &mut panel());
    }
    let mut outs: Vec<Vec<f32>> = {
        let _w = memory::scope(Term::Other);
        parts.iter().map(|p| vec![0f32; rows * p.len()]).collect()
    };
    outs.par_iter_mut()
        .zip(parts.par_iter())
        .for_each_init(panel, |panel, (out, part)| {
            let _w = memory::scope(Term::Other);
            f(part.clone(), out, part.len(), panel)
        });
    for (part, out) in parts.iter().zip(&outs) {
        for (row, src) in whole
            .chunks_exact_mut(width)
            .zip(out.chunks_exact(part.len()))
        {
            let dst = &mut row[part.clone()];
            if acc {
                dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
            } else {
                dst.copy_from_slice(src);
            }
        }
    }
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
    let (m, i, o) = (s.rows, s.in_dim, s.out_dim);
    check(s, w);
    assert!(x.len() >= m * i && y.len() >= m * o, "nf4 linear: operands");
    let arith = Arithmetic::of(products);
    let mut rounded = Vec::new();
    let x = arith.operand(&x[..m * i], &mut rounded);
    // Each part is a range of W's rows: y's columns.
    let parts = parts(threads, o, 2 * m * i * o);
    over_parts(
        &parts,
        m,
        &mut y[..m * o],
        o,
        false,
        &|part, out, stride, panel| {
            let step = panel_rows(i);
            for r0 in part.clone().step_by(step) {
                let n = step.min(part.end - r0);
                panel.fill(arith, w, r0..r0 + n, 0..i);
                // out[:, r0..r0+n] = x · panelᵀ
                let c = &mut out[r0 - part.start..];
                panel.product(arith, (m, n, i), (x, i, 1), (1, i), c, stride, false);
            }
        },
    );
    if let Some(b) = bias {
        y[..m * o]
            .chunks_exact_mut(o)
            .for_each(|row| row.iter_mut().zip(b).for_each(|(y, &b)| *y += b));
    }
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
    let (m, i, o) = (s.rows, s.in_dim, s.out_dim);
    check(s, w);
    assert!(
        dy.len() >= m * o && dx.len() >= m * i,
        "nf4 linear: operands"
    );
    let arith = Arithmetic::of(products);
    let mut rounded = Vec::new();
    let dy = arith.operand(&dy[..m * o], &mut rounded);
    if o == 0 {
        if !acc {
            dx[..m * i].fill(0.0);
        }
        return;
    }
    // Each part is a range of W's columns: dx's columns.
    let parts = parts(threads, i, 2 * m * i * o);
    let whole = parts.len() == 1;
    over_parts(
        &parts,
        m,
        &mut dx[..m * i],
        i,
        acc,
        &|part, out, stride, panel| {
            let step = panel_rows(part.len());
            for r0 in (0..o).step_by(step) {
                let n = step.min(o - r0);
                panel.fill(arith, w, r0..r0 + n, part.clone());
                // out (+)= dy[:, r0..r0+n] · panel
                let add = (whole && acc) || r0 > 0;
                let a = (&dy[r0..], o, 1);
                panel.product(
                    arith,
                    (m, part.len(), n),
                    a,
                    (part.len(), 1),
                    out,
                    stride,
                    add,
                );
            }
        },
    );
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
    use crate::kernels::cpu::linear;
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
        // 1100 output rows: several panels, the last one short; odd sizes everywhere. Under bf16
        // products both operands are rounded to bf16, as the dense product rounds them.
        for (threads, products) in [(1, Products::F32), (2, Products::F32), (2, Products::Bf16)] {
            let (s, x, dy, w) = case(70, 176, 1100);
            let t = Threads::new(threads);
            let dense = w.dequantized();
            let mut y = vec![0f32; 70 * 1100];
            let mut want = y.clone();
            forward(&t, products, s, &x, &w, None, &mut y);
            linear::forward(&t, products, s, &x, &dense, None, &mut want);
            let mut dx = vec![1f32; 70 * 176];
            let mut want_dx = dx.clone();
            backward_input(&t, products, s, &dy, &w, &mut dx, true);
            linear::backward_input(&t, products, s, &dy, &dense, &mut want_dx, true);
            for (a, b) in y.iter().zip(&want).chain(dx.iter().zip(&want_dx)) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{products:?}: {a} vs {b}"
                );
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
        // A copy of the matrix would be 8 MB in f32 (4 MB in bf16). What is allowed is the panel
        // and the f32 GEMM's own packing buffers, which the `gemm` crate sizes from the CPU's
        // caches: under 1.05 MB on a 512 KiB-L2 Zen 1, 1.31 MB on a 1 MiB-L2 Zen 4.
        assert!(
            (scratch as usize) <= f32_bytes / 4,
            "{scratch} bytes of scratch for a {f32_bytes}-byte f32 matrix"
        );
    }
}

//! Every kernel's backward against central finite differences of its forward, in f64, on random
//! shapes including odd and prime sizes. With h = 1e-5 the truncation error (h²·f''') and the
//! rounding error (ε₆₄/h ≈ 2e-11) are both far below the 1e-7 relative tolerance.

use super::threads::Threads;
use super::*;
use crate::kernels::float::Real;
use crate::kernels::{AttnGradInputs, AttnShape, LinearShape, Qkv, QkvGrads, RopeTable};
use ferrotron_core::model::WeightLayout;
use ferrotron_core::precision::Products;
use rand::{Rng, SeedableRng};

const H: f64 = 1e-5;
const TOL: f64 = 1e-7;

fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

fn randn(r: &mut impl Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Checks `analytic[i]` = ∂(Σ weights·f(inputs))/∂inputs[i] by central differences on every
/// coordinate (or a deterministic sample of at most 400 of them).
fn check(name: &str, inputs: &[Vec<f64>], analytic: &[Vec<f64>], f: impl Fn(&[Vec<f64>]) -> f64) {
    for (i, grad) in analytic.iter().enumerate() {
        let n = inputs[i].len();
        let step = n.div_ceil(400).max(1);
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for j in (0..n).step_by(step) {
            let mut plus = inputs.to_vec();
            plus[i][j] += H;
            let mut minus = inputs.to_vec();
            minus[i][j] -= H;
            let fd = (f(&plus) - f(&minus)) / (2.0 * H);
            num += (fd - grad[j]).powi(2);
            den += fd * fd;
        }
        let rel = (num / den.max(1e-300)).sqrt();
        assert!(rel < TOL, "{name}: input {i} gradient rel err {rel:e}");
    }
}

fn be() -> Threads {
    Threads::new(2)
}

#[test]
fn linear_both_layouts_with_and_without_bias() {
    let mut r = rng(1);
    for (rows, i, o) in [(1, 1, 1), (7, 5, 3), (13, 17, 11)] {
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            for with_bias in [false, true] {
                let s = LinearShape {
                    rows,
                    in_dim: i,
                    out_dim: o,
                    layout,
                };
                let (x, w, b, wy) = (
                    randn(&mut r, rows * i),
                    randn(&mut r, i * o),
                    randn(&mut r, o),
                    randn(&mut r, rows * o),
                );
                let f = |inp: &[Vec<f64>]| {
                    let mut y = vec![0.0; rows * o];
                    linear::forward(
                        &be(),
                        Products::F32,
                        s,
                        &inp[0],
                        &inp[1],
                        with_bias.then_some(&inp[2][..]),
                        &mut y,
                    );
                    dot(&y, &wy)
                };
                let mut dx = vec![0.0; rows * i];
                linear::backward_input(&be(), Products::F32, s, &wy, &w, &mut dx, false);
                let (mut dw, mut db) = (vec![0.0; i * o], vec![0.0; o]);
                linear::backward_weight(
                    &be(),
                    Products::F32,
                    s,
                    &wy,
                    &x,
                    &mut dw,
                    with_bias.then_some(&mut db[..]),
                );
                let mut grads = vec![dx, dw];
                if with_bias {
                    grads.push(db);
                }
                check(
                    &format!("linear {rows}x{i}->{o} {layout:?} bias={with_bias}"),
                    &[x.clone(), w.clone(), b.clone()],
                    &grads,
                    f,
                );
            }
        }
    }
}

#[test]
fn rmsnorm_and_layernorm() {
    let mut r = rng(2);
    for (rows, n) in [(1, 2), (3, 7), (5, 64)] {
        let (x, w, b, wy) = (
            randn(&mut r, rows * n),
            randn(&mut r, n),
            randn(&mut r, n),
            randn(&mut r, rows * n),
        );
        let eps = 1e-5;
        let rms = |inp: &[Vec<f64>]| {
            let (mut y, mut rstd) = (vec![0.0; rows * n], vec![0.0; rows]);
            norm::rms_forward(&be(), &inp[0], &inp[1], eps, &mut y, &mut rstd);
            dot(&y, &wy)
        };
        let (mut y, mut rstd) = (vec![0.0; rows * n], vec![0.0; rows]);
        norm::rms_forward(&be(), &x, &w, eps, &mut y, &mut rstd);
        let (mut dx, mut dw) = (vec![0.0; rows * n], vec![0.0; n]);
        norm::rms_backward_input(&be(), &wy, &x, &w, &rstd, &mut dx, false);
        norm::rms_backward_weight(&wy, &x, &rstd, &mut dw);
        check(
            &format!("rmsnorm {rows}x{n}"),
            &[x.clone(), w.clone()],
            &[dx, dw],
            rms,
        );

        let ln = |inp: &[Vec<f64>]| {
            let (mut y, mut m, mut rs) = (vec![0.0; rows * n], vec![0.0; rows], vec![0.0; rows]);
            norm::layer_forward(
                &be(),
                &inp[0],
                &inp[1],
                &inp[2],
                eps,
                &mut y,
                &mut m,
                &mut rs,
            );
            dot(&y, &wy)
        };
        let (mut m, mut rs) = (vec![0.0; rows], vec![0.0; rows]);
        norm::layer_forward(&be(), &x, &w, &b, eps, &mut y, &mut m, &mut rs);
        let (mut dx, mut dw, mut db) = (vec![0.0; rows * n], vec![0.0; n], vec![0.0; n]);
        norm::layer_backward_input(&be(), &wy, &x, &w, &m, &rs, &mut dx, false);
        norm::layer_backward_weight(&wy, &x, &m, &rs, &mut dw, &mut db);
        check(
            &format!("layernorm {rows}x{n}"),
            &[x, w, b],
            &[dx, dw, db],
            ln,
        );
    }
}

#[test]
fn rope_rotation() {
    let mut r = rng(3);
    for (rows, heads, d) in [(5, 1, 2), (7, 3, 6), (11, 2, 16)] {
        let table = RopeTable::new(d, 64, 10000.0);
        let positions: Vec<u32> = (0..rows).map(|i| (i * 5 % 64) as u32).collect();
        let (x, wy) = (
            randn(&mut r, rows * heads * d),
            randn(&mut r, rows * heads * d),
        );
        let f = |inp: &[Vec<f64>]| {
            let mut y = inp[0].clone();
            rotate::rotate(&be(), &table, &positions, heads, &mut y, false);
            dot(&y, &wy)
        };
        let mut dx = wy.clone();
        rotate::rotate(&be(), &table, &positions, heads, &mut dx, true);
        check(&format!("rope {rows}x{heads}x{d}"), &[x], &[dx], f);
    }
}

/// An attention shape from (batch, seq, heads, kv_heads, head_dim).
/// (batch, seq, heads, kv heads, head width)
type Dims = (usize, usize, usize, usize, usize);

fn attn_shape((batch, seq, heads, kv_heads, head_dim): Dims) -> AttnShape {
    AttnShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        window: None,
    }
}

/// Attention forward then backward with output gradient `dout`: `[out, lse, dq, dk, dv]`. The
/// outputs start as NaN: attention writes every element of them (the executor does not zero them
/// first), so an element it misses shows.
fn attention_run<T: Real>(s: AttnShape, q: &[T], k: &[T], v: &[T], dout: &[T]) -> [Vec<T>; 5] {
    attention_run_on(&be(), Products::F32, s, q, k, v, dout)
}

fn attention_run_on<T: Real>(
    be: &Threads,
    products: Products,
    s: AttnShape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
) -> [Vec<T>; 5] {
    let garbage = |n: usize| vec![T::of(f64::NAN); n];
    let (mut out, mut lse) = (garbage(q.len()), garbage(s.lse_len()));
    let x = Qkv { q, k, v };
    attention::forward(be, products, s.whole(), x, &mut out, &mut lse);
    let (mut dq, mut dk, mut dv) = (garbage(q.len()), garbage(k.len()), garbage(v.len()));
    let inputs = AttnGradInputs {
        dout,
        x,
        out: &out,
        lse: &lse,
    };
    let grads = QkvGrads::new(&mut dq, &mut dk, &mut dv);
    attention::backward(be, products, s, inputs, grads);
    [out, lse, dq, dk, dv]
}

/// Relative error, in norm, of `got` against `want`.
fn relative_error(want: &[f64], got: &[f32]) -> f64 {
    let err = want
        .iter()
        .zip(got)
        .map(|(a, &b)| (a - b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    err / dot(want, want).sqrt()
}

#[test]
fn causal_attention_with_grouped_query_heads() {
    let mut r = rng(4);
    // Sequences across the 64-row tiles; windows that leave whole tiles unseen (70 of 140) and
    // that cut rows inside one tile (5).
    for (dims, window) in [
        ((1, 1, 1, 1, 1), None),
        ((2, 7, 4, 2, 5), None),
        ((1, 13, 3, 1, 4), None),
        ((2, 67, 2, 2, 3), None),
        ((2, 67, 2, 2, 3), Some(5)),
        ((1, 140, 2, 1, 4), Some(70)),
    ] {
        let s = AttnShape {
            window,
            ..attn_shape(dims)
        };
        let rows = s.batch * s.seq;
        let (q, k, v) = (
            randn(&mut r, rows * s.q_width()),
            randn(&mut r, rows * s.kv_width()),
            randn(&mut r, rows * s.kv_width()),
        );
        let wy = randn(&mut r, rows * s.q_width());
        let f = |inp: &[Vec<f64>]| {
            let (mut out, mut lse) = (vec![0.0; rows * s.q_width()], vec![0.0; s.lse_len()]);
            attention::forward(
                &be(),
                Products::F32,
                s.whole(),
                Qkv::new(&inp[0], &inp[1], &inp[2]),
                &mut out,
                &mut lse,
            );
            dot(&out, &wy)
        };
        let [_, _, dq, dk, dv] = attention_run(s, &q, &k, &v, &wy);
        check(&format!("attention {s:?}"), &[q, k, v], &[dq, dk, dv], f);
    }
}

#[test]
fn swiglu_and_gelu() {
    let mut r = rng(5);
    for n in [1, 7, 4099, 20011] {
        let (g, u, wy) = (randn(&mut r, n), randn(&mut r, n), randn(&mut r, n));
        let sw = |inp: &[Vec<f64>]| {
            let mut y = vec![0.0; n];
            activation::swiglu_forward(&be(), &inp[0], &inp[1], &mut y);
            dot(&y, &wy)
        };
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        activation::swiglu_backward(&be(), &wy, &g, &u, &mut dg, &mut du);
        check(&format!("swiglu {n}"), &[g.clone(), u], &[dg, du], sw);

        let x: Vec<f64> = g.iter().map(|v| 3.0 * v).collect();
        let ge = |inp: &[Vec<f64>]| {
            let mut y = vec![0.0; n];
            activation::gelu_forward(&be(), &inp[0], &mut y);
            dot(&y, &wy)
        };
        let mut dx = vec![0.0; n];
        activation::gelu_backward(&be(), &wy, &x, &mut dx);
        check(&format!("gelu {n}"), &[x], &[dx], ge);
    }
}

#[test]
fn embedding_scatter_add() {
    let mut r = rng(6);
    let (vocab, dim) = (11, 5);
    let ids: Vec<u32> = vec![3, 0, 3, 10, 7, 3, 1];
    let (table, wy) = (randn(&mut r, vocab * dim), randn(&mut r, ids.len() * dim));
    let f = |inp: &[Vec<f64>]| {
        let mut y = vec![0.0; ids.len() * dim];
        embedding::forward(&be(), &ids, &inp[0], dim, &mut y, false);
        dot(&y, &wy)
    };
    let mut dt = vec![0.0; vocab * dim];
    embedding::backward_weight(&ids, &wy, dim, &mut dt);
    check("embedding", &[table], &[dt], f);
}

#[test]
fn cross_entropy_with_ignored_rows() {
    let mut r = rng(7);
    for (rows, vocab) in [(1, 2), (5, 13), (9, 1031)] {
        let logits: Vec<f64> = randn(&mut r, rows * vocab)
            .iter()
            .map(|x| 4.0 * x)
            .collect();
        let targets: Vec<Option<u32>> = (0..rows)
            .map(|i| (i % 3 != 2).then(|| ((i * 7) % vocab) as u32))
            .collect();
        let scale = 0.37;
        let f = |inp: &[Vec<f64>]| {
            let mut l = inp[0].clone();
            loss::cross_entropy(&be(), &mut l, vocab, &targets, 1.0) * scale
        };
        let mut grad = logits.clone();
        loss::cross_entropy(&be(), &mut grad, vocab, &targets, scale);
        check(
            &format!("cross_entropy {rows}x{vocab}"),
            &[logits],
            &[grad],
            f,
        );
    }
}

#[test]
fn f32_kernels_agree_with_f64_kernels() {
    // The f32 instantiation (with the polynomial exp) against the f64 one on the same inputs.
    let mut r = rng(8);
    let n = 10_007;
    let x = randn(&mut r, n);
    let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let (mut y64, mut y32) = (vec![0.0f64; n], vec![0.0f32; n]);
    activation::swiglu_forward(&be(), &x, &x, &mut y64);
    activation::swiglu_forward(&be(), &x32, &x32, &mut y32);
    let worst = y64
        .iter()
        .zip(&y32)
        .map(|(a, &b)| (a - b.to_f64()).abs() / a.abs().max(1e-3))
        .fold(0.0, f64::max);
    assert!(worst < 1e-6, "swiglu f32 vs f64: {worst:e}");
}

/// Attention on `be` in f32 against the f64 attention (`gemm` crate) on the same inputs: each of
/// its five outputs within `bound` in relative norm.
fn attention_agrees_with_f64(
    be: &Threads,
    products: Products,
    seed: u64,
    shapes: &[Dims],
    bound: f64,
) {
    let mut r = rng(seed);
    for &dims in shapes {
        let s = attn_shape(dims);
        let rows = s.batch * s.seq;
        let [q, k, v, dout] =
            [s.q_width(), s.kv_width(), s.kv_width(), s.q_width()].map(|w| randn(&mut r, rows * w));
        let narrow = |x: &[f64]| -> Vec<f32> { x.iter().map(|&e| e as f32).collect() };
        let want = attention_run(s, &q, &k, &v, &dout);
        let [q, k, v, dout] = [&q, &k, &v, &dout].map(|x| narrow(x));
        let got = attention_run_on(be, products, s, &q, &k, &v, &dout);
        for ((name, want), got) in ["out", "lse", "dq", "dk", "dv"].iter().zip(&want).zip(&got) {
            let err = relative_error(want, got);
            assert!(err <= bound, "{name} {s:?}: relative error {err:e}");
        }
    }
}

#[test]
fn f32_attention_agrees_with_f64_attention() {
    // In f32 the per-head products run on the AVX-512 kernel where the CPU has it (with its causal
    // skipping), in f64 on the `gemm` crate: the same function, to f32 precision. Sequences cross the
    // 64-row blocks and the kernel's 4-row and 16-lane tails; head widths 64, 17 and 5. f32 rounding
    // of inputs and products: ~1e-7 relative (measured 0.4–2.6e-7), with margin.
    let shapes = [(2, 130, 4, 2, 64), (1, 67, 3, 1, 5), (1, 9, 2, 2, 17)];
    attention_agrees_with_f64(&be(), Products::F32, 9, &shapes, 2e-6);
}

#[test]
fn bf16_attention_agrees_with_f64_attention_within_the_bf16_bound() {
    // Under bf16 products each of a head's products runs whole on the bf16 GEMM, which skips the
    // masked tiles and depth (a single block of rows, rather than f32's blocks of 64). Every product
    // rounds both operands to bf16 (unit roundoff u = 2⁻⁹), so each carries a relative error up to
    // 2u = 2⁻⁸ in norm; the deepest chain, dQ and dK, passes three such products (S, then dP, then
    // dS·K or dSᵀ·Q; softmax and its backward are f32): at most 3·2⁻⁸ ≈ 1.2e-2 relative, measured
    // up to 3.5e-3 (dQ, dK; the probabilities 6e-4). A tile or depth skipped that was needed, or
    // an element left unwritten, is O(1).
    let shapes = [(2, 130, 4, 2, 64), (1, 67, 3, 1, 32), (1, 9, 2, 2, 16)];
    attention_agrees_with_f64(&be(), Products::Bf16, 10, &shapes, 3.0 * 2f64.powi(-8));
}

/// The memory-efficient kernel against the materialised one it replaced (kept as this reference):
/// the same output and gradients, in f64 to rounding and in f32 to f32 rounding, over tile tails,
/// grouped-query heads and sliding windows that skip whole tiles.
#[test]
fn memory_efficient_attention_equals_the_materialised_kernel() {
    use super::attention_materialized as materialized;
    fn run_materialized<T: Real>(
        s: AttnShape,
        q: &[T],
        k: &[T],
        v: &[T],
        dout: &[T],
    ) -> [Vec<T>; 4] {
        let (mut out, mut p) = (
            vec![T::ZERO; q.len()],
            vec![T::ZERO; materialized::probs_len(s)],
        );
        materialized::forward(&be(), Products::F32, s, q, k, v, &mut out, &mut p);
        let (mut dq, mut dk, mut dv) = (
            vec![T::ZERO; q.len()],
            vec![T::ZERO; k.len()],
            vec![T::ZERO; v.len()],
        );
        materialized::backward(
            &be(),
            Products::F32,
            s,
            dout,
            q,
            k,
            v,
            &p,
            &mut dq,
            &mut dk,
            &mut dv,
        );
        [out, dq, dk, dv]
    }
    let mut r = rng(11);
    for (dims, window) in [
        ((2, 130, 4, 2, 16), None),
        ((1, 200, 3, 1, 8), Some(70)),
        ((1, 64, 2, 2, 8), Some(3)),
        ((1, 129, 2, 1, 5), Some(128)),
    ] {
        let s = AttnShape {
            window,
            ..attn_shape(dims)
        };
        let rows = s.batch * s.seq;
        let [q, k, v, dout] =
            [s.q_width(), s.kv_width(), s.kv_width(), s.q_width()].map(|w| randn(&mut r, rows * w));
        let want = run_materialized(s, &q, &k, &v, &dout);
        let [out, _, dq, dk, dv] = attention_run(s, &q, &k, &v, &dout);
        for ((name, want), got) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(&want)
            .zip([out, dq, dk, dv])
        {
            let got: Vec<f32> = got.iter().map(|&x| x as f32).collect();
            let err = relative_error(want, &got);
            // The f64 results narrowed to f32 for the comparison: f32's rounding is the bound.
            assert!(err < 1e-7, "f64 {name} {s:?}: relative error {err:e}");
        }
        let narrow = |x: &[f64]| -> Vec<f32> { x.iter().map(|&e| e as f32).collect() };
        let [q, k, v, dout] = [&q, &k, &v, &dout].map(|x| narrow(x));
        let [out, _, dq, dk, dv] = attention_run(s, &q, &k, &v, &dout);
        for ((name, want), got) in ["out", "dq", "dk", "dv"]
            .iter()
            .zip(&want)
            .zip([out, dq, dk, dv])
        {
            let err = relative_error(want, &got);
            assert!(err < 2e-6, "f32 {name} {s:?}: relative error {err:e}");
        }
    }
}

/// Attention cut into blocks (a context-parallel device's queries against each device's keys)
/// equals the whole: every (query chunk, key chunk) block's forward merged, and every block's
/// backward added up. Queries come from a tensor holding only their chunk (as on a device), keys
/// from the whole sequence; chunks of unequal lengths, windows, grouped-query heads.
#[test]
fn attention_in_blocks_equals_the_whole() {
    use crate::kernels::{AttnBlock, Span};
    let mut r = rng(12);
    for (dims, window, cuts) in [
        ((2, 96, 4, 2, 8), None, vec![0, 24, 48, 72, 96]),
        ((1, 150, 2, 1, 5), Some(40), vec![0, 70, 71, 150]),
        ((1, 33, 3, 3, 4), None, vec![0, 1, 17, 33]),
    ] {
        let s = AttnShape {
            window,
            ..attn_shape(dims)
        };
        let (t, qw, kw) = (s.seq, s.q_width(), s.kv_width());
        let rows = s.batch * t;
        let [q, k, v, dout] = [qw, kw, kw, qw].map(|w| randn(&mut r, rows * w));
        let [want_out, want_lse, want_dq, want_dk, want_dv] = attention_run(s, &q, &k, &v, &dout);
        let chunks: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
        // A chunk's rows of a token-major tensor `x` (width `w`), every sequence's.
        let rows_of = |x: &[f64], w: usize, (a, b): (usize, usize)| -> Vec<f64> {
            (0..s.batch)
                .flat_map(|seq| x[(seq * t + a) * w..(seq * t + b) * w].to_vec())
                .collect()
        };
        let mut dq_all = vec![0.0; q.len()];
        let (mut dk, mut dv) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        let whole_k = Span {
            rows: t,
            first: 0,
            len: t,
            position: 0,
        };
        for &(a, b) in &chunks {
            let len = b - a;
            let shape = AttnShape { seq: len, ..s };
            let q_span = Span {
                rows: len,
                first: 0,
                len,
                position: a,
            };
            let qc = rows_of(&q, qw, (a, b));
            let (mut out, mut lse) = (
                vec![0.0; qc.len()],
                vec![f64::NEG_INFINITY; shape.lse_len()],
            );
            for &(ka, kb) in &chunks {
                let block = AttnBlock {
                    shape,
                    q: q_span,
                    k: Span {
                        first: ka,
                        len: kb - ka,
                        position: ka,
                        ..whole_k
                    },
                };
                let (mut ob, mut lb) = (vec![f64::NAN; qc.len()], vec![f64::NAN; shape.lse_len()]);
                let x = Qkv::new(&qc, &k, &v);
                attention::forward(&be(), Products::F32, block, x, &mut ob, &mut lb);
                attention::merge(&be(), shape, &mut out, &mut lse, &ob, &lb);
            }
            assert!(relative_error(&rows_of(&want_out, qw, (a, b)), &narrow(&out)) < 1e-7);
            let want_l: Vec<f64> = (0..s.batch * s.heads)
                .flat_map(|bh| want_lse[bh * t + a..bh * t + b].to_vec())
                .collect();
            assert!(
                relative_error(&want_l, &narrow(&lse)) < 1e-7,
                "lse {s:?} {a}..{b}"
            );
            let doc = rows_of(&dout, qw, (a, b));
            let mut dq = vec![0.0; qc.len()];
            for &(ka, kb) in &chunks {
                let block = AttnBlock {
                    shape,
                    q: q_span,
                    k: Span {
                        first: ka,
                        len: kb - ka,
                        position: ka,
                        ..whole_k
                    },
                };
                attention::backward_block(
                    &be(),
                    Products::F32,
                    block,
                    AttnGradInputs::new(&doc, Qkv::new(&qc, &k, &v), &out, &lse),
                    QkvGrads::new(&mut dq, &mut dk, &mut dv),
                );
            }
            for seq in 0..s.batch {
                for i in 0..len {
                    let (from, to) = ((seq * len + i) * qw, (seq * t + a + i) * qw);
                    dq_all[to..to + qw].copy_from_slice(&dq[from..from + qw]);
                }
            }
        }
        for (name, want, got) in [
            ("dq", &want_dq, &dq_all),
            ("dk", &want_dk, &dk),
            ("dv", &want_dv, &dv),
        ] {
            let err = relative_error(want, &narrow(got));
            assert!(
                err < 1e-7,
                "{name} {s:?} in blocks {cuts:?}: relative error {err:e}"
            );
        }
    }
}

fn narrow(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&e| e as f32).collect()
}

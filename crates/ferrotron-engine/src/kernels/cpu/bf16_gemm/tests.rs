use super::pack::{pack, pack_rows};
use super::*;
use rand::{Rng, SeedableRng};

/// The exact sum of the bf16-rounded products, in f64.
fn reference(m: usize, n: usize, k: usize, a: Operand, b: Operand) -> Vec<f64> {
    let ((ars, acs), (brs, bcs)) = (a.strides(), b.strides());
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a.rounded(i * ars + p * acs) as f64 * b.rounded(p * brs + j * bcs) as f64)
                .sum();
        }
    }
    c
}

/// An operand of `len` values in [-2, 2), in f32 and rounded to bf16.
pub(super) fn random_operand(len: usize, seed: u64) -> (Vec<f32>, Vec<bf16>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let xf: Vec<f32> = (0..len).map(|_| rng.gen_range(-2.0..2.0)).collect();
    let xb = xf.iter().map(|&v| bf16::from_f32(v)).collect();
    (xf, xb)
}

/// The packed pair of k-values `kk` and `kk + 1` of one row (`at(kk)`: where value `kk` lies),
/// zero past `kn`: what a panel must hold there.
pub(super) fn pair_bits(x: Operand, at: impl Fn(usize) -> usize, kk: usize, kn: usize) -> u32 {
    let bits = |kk: usize| if kk < kn { x.bits(at(kk)) as u32 } else { 0 };
    bits(kk) | bits(kk + 1) << 16
}

/// The vectorised packings (k contiguous: transposed in registers; rows contiguous: pair by
/// pair across the block) lay out exactly the bits of the definition, for the panel widths of
/// both paths (14 and 32 for AVX512_BF16, 16 and 32 for AMX), partial panels, rows and k cut
/// short by the operand's edge, odd k, depths padded past the data, f32 and bf16 operands, and
/// the general strided case. Exact equality: packing only moves and rounds bits. This is what
/// keeps the AMX path's panels right on machines without AMX.
#[test]
fn packed_panels_hold_exactly_the_operand_s_pairs() {
    if !available() {
        eprintln!("no AVX512_BF16 here: the packing routines are not used");
        return;
    }
    let (rows_all, cols_all) = (83, 157);
    let (xf, xb) = random_operand(rows_all * cols_all, 11);
    for &w in &[14, 16, 32] {
        for &(t0, rows, k0, kp) in &[
            (0, 64, 0, 40),
            (5, 45, 3, 70),
            (60, 40, 100, 35),
            (0, 1, 0, 1),
        ] {
            // (ts, ks, tn, kn): k contiguous, rows contiguous, neither.
            for &(ts, ks, tn, kn) in &[
                (cols_all, 1, rows_all, cols_all),
                (1, cols_all, cols_all, rows_all),
                (2, 2 * cols_all, 40, 40),
            ] {
                for x in [
                    Operand::F32(&xf, cols_all, 1),
                    Operand::Bf16(&xb, cols_all, 1),
                ] {
                    // Garbage where it packs (the packing writes every element), and
                    // around it.
                    let size = usize::div_ceil(rows, w) * kp * w;
                    let mut got = vec![0xdead_beef_u32; size + 6];
                    pack(
                        x,
                        ts,
                        ks,
                        t0,
                        rows,
                        tn,
                        k0,
                        kn,
                        kp,
                        w,
                        &mut got[3..size + 3],
                    );
                    // Panel i's pair p of row t at i·kp·w + p·w + t: zero past the rows,
                    // k and the data.
                    let mut want = vec![0u32; rows.div_ceil(w) * kp * w];
                    for t in 0..rows.min(tn.saturating_sub(t0)) {
                        for p in 0..kp {
                            let at = |kk: usize| (t0 + t) * ts + kk * ks;
                            want[(t / w) * kp * w + p * w + t % w] =
                                pair_bits(x, at, k0 + 2 * p, kn);
                        }
                    }
                    let around = [&got[..3], &got[size + 3..]];
                    assert!(around == [[0xdead_beef; 3]; 2], "written outside its block");
                    assert!(
                        got[3..size + 3] == want[..],
                        "w {w} t0 {t0} rows {rows} k0 {k0} kp {kp} ts {ts} ks {ks}: first difference at {:?}",
                        got[3..].iter().zip(&want).position(|(a, b)| a != b)
                    );
                }
            }
        }
    }
}

/// Row-by-row panels (the AVX512_BF16 path's `a` where k is contiguous): pair `p` of row `t` at
/// `t·kp + p`, with rows and k cut short by the operand's edge, odd k, depths padded past the data,
/// a depth of zero, f32 and bf16 operands; nothing written outside the block. Exact equality.
#[test]
fn row_panels_hold_exactly_the_operand_s_pairs() {
    if !available() {
        eprintln!("no AVX512_BF16 here: the packing routines are not used");
        return;
    }
    let (rows_all, cols_all) = (83, 157);
    let (xf, xb) = random_operand(rows_all * cols_all, 12);
    for &(t0, rows, k0, kp, padded) in &[
        (0, 64, 0, 40, 70),
        (5, 45, 3, 70, 56),
        (60, 40, 100, 35, 42),
        (0, 1, 0, 1, 14),
        (3, 14, 9, 0, 14),
    ] {
        for x in [
            Operand::F32(&xf, cols_all, 1),
            Operand::Bf16(&xb, cols_all, 1),
        ] {
            let size = padded * kp;
            let mut got = vec![0xdead_beef_u32; size + 6];
            pack_rows(
                x,
                cols_all,
                t0,
                rows,
                rows_all,
                k0,
                cols_all,
                kp,
                &mut got[3..size + 3],
            );
            let mut want = vec![0u32; size];
            for t in 0..rows.min(rows_all - t0) {
                for p in 0..kp {
                    let at = |kk: usize| (t0 + t) * cols_all + kk;
                    want[t * kp + p] = pair_bits(x, at, k0 + 2 * p, cols_all);
                }
            }
            let around = [&got[..3], &got[size + 3..]];
            assert!(around == [[0xdead_beef; 3]; 2], "written outside its block");
            assert!(
                got[3..size + 3] == want[..],
                "t0 {t0} rows {rows} k0 {k0} kp {kp}: first difference at {:?}",
                got[3..].iter().zip(&want).position(|(a, b)| a != b)
            );
        }
    }
}

/// The bf16 instruction paths this machine runs (the f32 fallback has its own test).
fn paths_here() -> Vec<Path> {
    let paths: Vec<Path> = [Path::Amx, Path::Avx512Bf16]
        .into_iter()
        .filter(|&p| runs_here(p))
        .collect();
    eprintln!("bf16 paths tested here: {paths:?}");
    paths
}

/// Every stride pattern of the three linear products, odd sizes (partial tiles, an odd k), f32
/// and bf16 operands, one and two threads, with and without accumulation. Against the exact sum
/// of the rounded products the only error is f32 accumulation over k terms: bounded by
/// k·2⁻²⁴·Σ|aᵢbᵢ| (Higham's γ_k), far below one bf16 rounding of the inputs (2⁻⁸ relative),
/// which a wrong packing or a missed pair would exceed.
#[test]
fn every_layout_of_the_three_products_sums_the_rounded_products() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for &(m, n, k) in &[
        (29, 70, 67),
        (64, 33, 128),
        (3, 5, 1),
        (150, 40, 301),
        (15, 1030, 9),
        // Past one block of rows, of columns and of depth on every path.
        (270, 1060, 530),
        // Too few rows to share the packed b: threads split the columns.
        (20, 3000, 70),
    ] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        // a: row-major (k contiguous) or its transpose's view (m contiguous);
        // b: [k×n] row-major (n contiguous) or [n×k] viewed transposed (k contiguous).
        let a_views = [
            Operand::F32(&x, k, 1),
            Operand::F32(&x, 1, m),
            Operand::Bf16(&xb, k, 1),
            Operand::Bf16(&xb, 1, m),
        ];
        let b_views = [
            Operand::F32(&w, n, 1),
            Operand::F32(&w, 1, k),
            Operand::Bf16(&wb, n, 1),
            Operand::Bf16(&wb, 1, k),
        ];
        // The large shape with f32 operands only (the small ones cover bf16 operands).
        let views = if m * n * k > 10_000_000 { 2 } else { 4 };
        for a in a_views.into_iter().take(views) {
            for b in b_views.into_iter().take(views) {
                let want = reference(m, n, k, a, b);
                let bound: Vec<f64> = {
                    let ((ars, acs), (brs, bcs)) = (a.strides(), b.strides());
                    (0..m * n)
                        .map(|ij| {
                            let (i, j) = (ij / n, ij % n);
                            let s: f64 = (0..k)
                                .map(|p| {
                                    (a.rounded(i * ars + p * acs) as f64
                                        * b.rounded(p * brs + j * bcs) as f64)
                                        .abs()
                                })
                                .sum();
                            k as f64 * 2f64.powi(-24) * s + 1e-30
                        })
                        .collect()
                };
                for (path, threads, accumulate) in paths_here()
                    .into_iter()
                    .flat_map(|p| [(p, 1, false), (p, 2, false), (p, 1, true), (p, 2, true)])
                {
                    {
                        let mut c = vec![0.5f32; m * n];
                        gemm_on(path, m, n, k, a, b, &mut c, n, accumulate, threads);
                        for ij in 0..m * n {
                            let expect = want[ij] + if accumulate { 0.5 } else { 0.0 };
                            let err = (c[ij] as f64 - expect).abs();
                            assert!(
                                err <= bound[ij] + 2f64.powi(-24) * expect.abs(),
                                "{m}x{n}x{k} {path:?} threads {threads} acc {accumulate}: c[{ij}] = {} vs {expect} (bound {:e})",
                                c[ij],
                                bound[ij]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Without accumulation the GEMM writes every element of its output and reads none (the
/// executor hands it buffers that were not zeroed, `Backend::overwritten`): into a buffer of
/// NaN it is bit for bit what it is into one of 7s, on one thread and two, where the threads
/// share the packed b and where they split the columns, and with k = 0.
#[test]
fn without_accumulation_the_gemm_writes_every_element() {
    for &(m, n, k) in &[(29, 70, 67), (270, 1060, 530), (20, 3000, 70), (5, 9, 0)] {
        let (x, _) = random_operand(m * k, 1);
        let (w, _) = random_operand(k * n, 2);
        let (a, b) = (Operand::F32(&x, k, 1), Operand::F32(&w, 1, k));
        for threads in [1, 2] {
            let mut want = vec![7.0f32; m * n];
            gemm(m, n, k, a, b, &mut want, n, false, threads);
            let mut got = vec![f32::NAN; m * n];
            gemm(m, n, k, a, b, &mut got, n, false, threads);
            assert!(
                got.iter()
                    .map(|v| v.to_bits())
                    .eq(want.iter().map(|v| v.to_bits())),
                "{m}x{n}x{k} on {threads} threads"
            );
        }
    }
}

#[test]
fn a_causal_mask_changes_nothing_the_caller_reads() {
    if best_path() == Path::F32Gemm {
        // gemm_into is the bf16 paths' product; without AVX512_BF16 or AMX there is none (the
        // callers fall back to the f32 GEMM, whose mask `small_gemm`'s tests check).
        eprintln!("skipped: this CPU has no bf16 GEMM path (no AVX512_BF16, no AMX)");
        return;
    }
    for &(m, n, k) in &[(64, 64, 64), (256, 64, 256), (47, 33, 95), (300, 70, 1100)] {
        for mask in [
            Causal::Columns(0),
            Causal::Columns(5),
            Causal::DepthUpTo(0),
            Causal::DepthUpTo(3),
            Causal::DepthFrom(0),
            Causal::DepthFrom(7),
        ] {
            let zero = |i: usize, p: usize| match mask {
                Causal::DepthUpTo(d) => p > i + d,
                Causal::DepthFrom(d) => p + d < i,
                _ => false,
            };
            let (mut x, _) = random_operand(m * k, 5);
            for (ip, v) in x.iter_mut().enumerate() {
                if zero(ip / k, ip % k) {
                    *v = 0.0;
                }
            }
            let xt: Vec<f32> = (0..k * m).map(|pi| x[(pi % m) * k + pi / m]).collect();
            let (w, _) = random_operand(k * n, 6);
            let a_views = [Operand::F32(&x, k, 1), Operand::F32(&xt, 1, m)];
            let b_views = [Operand::F32(&w, n, 1), Operand::F32(&w, 1, k)];
            for (a, b) in a_views.into_iter().zip(b_views) {
                for accumulate in [false, true] {
                    let mut want = vec![0.5f32; m * n];
                    let mut got = want.clone();
                    // SAFETY: both views lie in their slices; `c` holds m × n.
                    unsafe {
                        let c = want.as_mut_ptr();
                        assert!(gemm_into(m, n, k, a, b, c, n, accumulate, Causal::None));
                        let c = got.as_mut_ptr();
                        assert!(gemm_into(m, n, k, a, b, c, n, accumulate, mask));
                    }
                    for i in 0..m {
                        for j in 0..n {
                            if let Causal::Columns(d) = mask {
                                if j > i + d {
                                    continue;
                                }
                            }
                            assert!(
                                got[i * n + j] == want[i * n + j],
                                "{m}x{n}x{k} {mask:?} acc {accumulate}: c[{i}][{j}] = {} vs {}",
                                got[i * n + j],
                                want[i * n + j]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_fallback_computes_the_same_products() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let (m, n, k) = (2048, 1408, 512);
    let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let (a, b) = (Operand::F32(&x, k, 1), Operand::F32(&w, 1, k));
    let want = reference(m, n, k, a, b);
    let mut c = vec![0f32; m * n];
    fallback(m, n, k, a, b, &mut c, n, false);
    for (got, want) in c.iter().zip(&want) {
        assert!(
            (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "{got} vs {want}"
        );
    }
}

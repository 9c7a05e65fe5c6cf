//! Each kernel this CPU runs, against an f64 product and against itself unmasked.

use super::{Causal, Kernel};
use rand::{Rng, SeedableRng};

/// Odd sizes, tails in both directions, transposed and strided `a`, overwrite and accumulate,
/// against an f64 product.
#[test]
fn matches_a_plain_product() {
    for kernel in kernels() {
        matches_a_plain_product_on(kernel);
    }
}

fn matches_a_plain_product_on(kernel: Kernel) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for &(m, n, k) in &[
        (1, 1, 1),
        (3, 17, 5),
        (4, 64, 64),
        (9, 70, 33),
        (64, 256, 64),
        (13, 48, 512),
        (256, 100, 64),
        (7, 129, 1),
    ] {
        for transposed in [false, true] {
            for accumulate in [false, true] {
                let (a_rs, a_cs) = if transposed { (1, m + 3) } else { (k + 2, 1) };
                let a: Vec<f32> = (0..(m + 3) * (k + 2))
                    .map(|_| rng.gen_range(-1.0..1.0))
                    .collect();
                let (b_rs, c_rs) = (n + 5, n + 1);
                let b: Vec<f32> = (0..k * b_rs).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let c0: Vec<f32> = (0..m * c_rs).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut c = c0.clone();
                unsafe {
                    super::gemm_f32_on(
                        kernel,
                        (m, n, k),
                        (a.as_ptr(), a_rs, a_cs),
                        (b.as_ptr(), b_rs),
                        (c.as_mut_ptr(), c_rs),
                        accumulate,
                        Causal::None,
                    )
                };
                for i in 0..m {
                    for j in 0..c_rs {
                        let got = c[i * c_rs + j] as f64;
                        if j >= n {
                            assert_eq!(got, c0[i * c_rs + j] as f64, "wrote past column {n}");
                            continue;
                        }
                        let mut want = if accumulate {
                            c0[i * c_rs + j] as f64
                        } else {
                            0.0
                        };
                        for p in 0..k {
                            want += a[i * a_rs + p * a_cs] as f64 * b[p * b_rs + j] as f64;
                        }
                        let tol = 1e-6 * (k as f64).sqrt().max(1.0) * 4.0;
                        assert!(
                            (got - want).abs() <= tol,
                            "{m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// A causal mask gives the same numbers as the full product wherever the skipped work multiplies
/// zeros, and leaves skipped columns alone.
#[test]
fn causal_masks_skip_only_zeros() {
    for kernel in kernels() {
        causal_masks_skip_only_zeros_on(kernel);
    }
}

fn causal_masks_skip_only_zeros_on(kernel: Kernel) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    let (m, n, k, diag) = (13, 40, 40, 21);
    let rand = |rng: &mut rand_chacha::ChaCha8Rng, len| -> Vec<f32> {
        (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
    };
    let run = |a: &[f32], (a_rs, a_cs), b: &[f32], mask| {
        let mut c = vec![7.0f32; m * n];
        unsafe {
            super::gemm_f32_on(
                kernel,
                (m, n, k),
                (a.as_ptr(), a_rs, a_cs),
                (b.as_ptr(), n),
                (c.as_mut_ptr(), n),
                false,
                mask,
            )
        };
        c
    };
    let b = rand(&mut rng, k * n);
    // Depth up to the diagonal: a[i][p] = 0 for p > i + diag.
    let mut a = rand(&mut rng, m * k);
    (0..m).for_each(|i| {
        (0..k)
            .filter(|&p| p > i + diag)
            .for_each(|p| a[i * k + p] = 0.0)
    });
    assert_eq!(
        run(&a, (k, 1), &b, Causal::DepthUpTo(diag)),
        run(&a, (k, 1), &b, Causal::None)
    );
    // Depth from the diagonal: row i is key i, depth p is query diag' + p, zero where p < i − diag'.
    let d2 = 3;
    let mut a = rand(&mut rng, m * k);
    (0..m).for_each(|i| {
        (0..k)
            .filter(|&p| p + d2 < i)
            .for_each(|p| a[i * k + p] = 0.0)
    });
    assert_eq!(
        run(&a, (k, 1), &b, Causal::DepthFrom(d2)),
        run(&a, (k, 1), &b, Causal::None)
    );
    // Columns: every needed column equals the full product's; the rest keep their old value or
    // equal the full product (row tiles compute up to their last row's limit).
    let a = rand(&mut rng, m * k);
    let (full, part) = (
        run(&a, (k, 1), &b, Causal::None),
        run(&a, (k, 1), &b, Causal::Columns(5)),
    );
    for i in 0..m {
        for j in 0..n {
            let (f, p) = (full[i * n + j], part[i * n + j]);
            assert!(
                if j <= i + 5 {
                    p == f
                } else {
                    p == f || p == 7.0
                },
                "[{i},{j}]"
            );
        }
    }
}

/// The kernels this CPU runs.
fn kernels() -> Vec<Kernel> {
    let mut k = Vec::new();
    if std::arch::is_x86_feature_detected!("avx512f") {
        k.push(Kernel::Avx512);
    }
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        k.push(Kernel::Avx2);
    }
    k
}

/// A product reading a packed operand (from a row-major or a transposed view, from any row and any
/// 16th column) gives the bits of the same product packing `b` itself, masks included.
#[test]
fn a_packed_operand_gives_the_same_bits() {
    for kernel in kernels() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (rows, cols) = (70, 53);
        let b: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        // The same matrix stored transposed: element (p, j) at p + j·rows.
        let mut bt = vec![0f32; rows * cols];
        for p in 0..rows {
            for j in 0..cols {
                bt[p + j * rows] = b[p * cols + j];
            }
        }
        let mut packed = super::Packed::new(kernel);
        for transposed in [false, true] {
            let view = if transposed {
                (bt.as_ptr(), 1, rows)
            } else {
                (b.as_ptr(), cols, 1)
            };
            unsafe { packed.pack((rows, cols), view) };
            for &(m, n, k, row0, col0) in
                &[(9, 53, 70, 0, 0), (13, 21, 40, 30, 32), (6, 5, 1, 69, 48)]
            {
                let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
                for mask in [Causal::None, Causal::Columns(2), Causal::DepthUpTo(3)] {
                    let (mut want, mut got) = (vec![0.5f32; m * n], vec![0.5f32; m * n]);
                    unsafe {
                        super::gemm_f32_on(
                            kernel,
                            (m, n, k),
                            (a.as_ptr(), k, 1),
                            (b.as_ptr().add(row0 * cols + col0), cols),
                            (want.as_mut_ptr(), n),
                            true,
                            mask,
                        );
                        super::gemm_f32_packed(
                            (m, n, k),
                            (a.as_ptr(), k, 1),
                            (&packed, row0, col0),
                            (got.as_mut_ptr(), n),
                            true,
                            mask,
                        );
                    }
                    assert_eq!(
                        want, got,
                        "{kernel:?} {m}x{n}x{k} at ({row0}, {col0}) {mask:?}"
                    );
                }
            }
        }
    }
}

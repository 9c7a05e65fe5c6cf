//! `bench kernels`' measurements: every kernel of a preset's shapes timed on this machine, beside
//! the peak of the products' arithmetic (f32 FMA, or the bf16 path's) measured the same way. Each
//! function returns the table's rows; the command prints them.

use super::peak::{
    best_peak, best_time, bf16_peak_gflops, bf16_peak_gflops_of, fma_peak_gflops, time_beside_peak,
    KERNEL_REPS,
};
use ferrotron_core::model::{ModelConfig, WeightLayout};
use ferrotron_core::precision::Products;
use ferrotron_engine::half::bf16;
use ferrotron_engine::kernels::{
    bf16_gemm, AttnGradInputs, AttnShape, Backend, CpuBackend, LinearShape, Matrix, Qkv, QkvGrads,
};
use rand::{Rng, SeedableRng};

/// The peaks the products are read against, and what was said of them.
pub struct Peaks {
    /// The peak of the products' arithmetic (GFLOP/s), where measured.
    pub peak: Option<f64>,
    /// bf16 products: each timing is paired with a short peak measurement just before it.
    pub paired: bool,
    pub threads: usize,
    pub lines: Vec<String>,
}

impl Peaks {
    pub fn measure(be: &CpuBackend) -> Self {
        let mut lines = Vec::new();
        let f32_peak = match best_peak(|| fma_peak_gflops(be.threads)) {
            Some((gflops, isa)) => {
                lines.push(format!(
                    "f32 FMA peak of {} threads: {gflops:.1} GFLOP/s ({isa}, independent FMA chains)",
                    be.threads
                ));
                Some(gflops)
            }
            None => {
                lines.push("f32 FMA peak: not measured on this CPU".into());
                None
            }
        };
        let paired = be.products == Products::Bf16;
        let peak = if paired {
            let best = bf16_gemm::best_path();
            let mut best_gflops = None;
            for path in [bf16_gemm::Path::Amx, bf16_gemm::Path::Avx512Bf16] {
                let measured = best_peak(|| bf16_peak_gflops(path, be.threads).map(|g| (g, ())));
                if let Some((gf, ())) = measured {
                    lines.push(format!(
                        "bf16 peak of {} threads on {}: {gf:.1} GFLOP/s (chains of the instruction, no loads)",
                        be.threads,
                        path.name()
                    ));
                    if path == best {
                        best_gflops = Some(gf);
                    }
                }
            }
            lines.push(format!("bf16 products run on: {}", best.name()));
            best_gflops.or(f32_peak)
        } else {
            f32_peak
        };
        Self {
            peak,
            paired,
            threads: be.threads,
            lines,
        }
    }

    fn of_peak(&self, gflops: f64) -> String {
        self.peak
            .map_or(String::new(), |p| format!("{:.0}%", 100.0 * gflops / p))
    }

    /// A short peak measurement (about 10 ms) before each timing of a product, under bf16: an AMX
    /// iteration is 4,096 FLOP a thread, an AVX512_BF16 one 768.
    fn now(&self) -> Option<f64> {
        if !self.paired {
            return None;
        }
        let path = bf16_gemm::best_path();
        let short = match path {
            bf16_gemm::Path::Amx => 4_000_000,
            _ => 1_000_000,
        };
        bf16_peak_gflops_of(path, self.threads, short)
    }

    /// The paired column, under bf16 only (empty where this CPU has no bf16 peak to pair with).
    fn beside(&self, fraction: Option<f64>) -> String {
        match (self.paired, fraction) {
            (false, _) => String::new(),
            (true, Some(f)) => format!(" {:.0}% |", 100.0 * f),
            (true, None) => " |".to_string(),
        }
    }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// The three products of each linear layer of the preset, and a large square product.
pub fn linear_rows(be: &CpuBackend, cfg: &ModelConfig, rows: usize, peaks: &Peaks) -> Vec<String> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let mut out = Vec::new();
    for (name, i, o) in [
        ("linear q/o", h, h),
        ("linear gate/up", h, f),
        ("linear down", f, h),
        ("linear lm_head", h, v),
        // Not a layer of the preset: the large square product the bf16 peak target is stated for.
        ("large gemm", 2048, 2048),
    ] {
        let s = LinearShape {
            rows,
            in_dim: i,
            out_dim: o,
            layout: WeightLayout::OutIn,
        };
        let (x, w, dy) = (random(rows * i, 1), random(o * i, 2), random(rows * o, 3));
        let (mut y, mut dx, mut dw) = (
            vec![0f32; rows * o],
            vec![0f32; rows * i],
            vec![0f32; o * i],
        );
        let gf = 2.0 * (rows * i * o) as f64 / 1e9;
        // Under bf16 the weights are the bf16 compute copy, as in training.
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wm = if peaks.paired {
            Matrix::Bf16(&wb)
        } else {
            Matrix::F32(&w)
        };
        let now = || peaks.now();
        let mut row = |label: String, shape: String, (t, fr): (f64, Option<f64>)| {
            out.push(format!(
                "| {label} | {shape} | {:.2} | {:.1} | {} |{}",
                t * 1e3,
                gf / t,
                peaks.of_peak(gf / t),
                peaks.beside(fr)
            ))
        };
        row(
            format!("{name} fwd"),
            format!("{rows}x{i} -> {o}"),
            time_beside_peak(gf, &now, || be.linear_forward(s, &x, wm, None, &mut y)),
        );
        row(
            format!("{name} bwd input"),
            String::new(),
            time_beside_peak(gf, &now, || {
                be.linear_backward_input(s, &dy, wm, &mut dx, false)
            }),
        );
        row(
            format!("{name} bwd weight"),
            String::new(),
            time_beside_peak(gf, &now, || {
                be.linear_backward_weight(s, &dy, &x, &mut dw, None)
            }),
        );
    }
    out
}

/// Causal attention forward and backward over the preset's heads.
pub fn attention_rows(be: &CpuBackend, cfg: &ModelConfig, batch: usize, seq: usize) -> Vec<String> {
    let rows = batch * seq;
    let a = AttnShape {
        batch,
        seq,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        window: None,
    };
    let (q, k, vv, dout) = (
        random(rows * a.q_width(), 4),
        random(rows * a.kv_width(), 5),
        random(rows * a.kv_width(), 6),
        random(rows * a.q_width(), 7),
    );
    let (mut out, mut lse) = (vec![0f32; rows * a.q_width()], vec![0f32; a.lse_len()]);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; vv.len()],
    );
    // Causal: half of the full QK^T and PV work.
    let gf = 2.0 * 2.0 * (batch * a.heads * seq * seq * a.head_dim) as f64 / 2.0 / 1e9;
    let fwd = best_time(KERNEL_REPS, || {
        be.attention_forward(a, Qkv::new(&q, &k, &vv), &mut out, &mut lse)
    });
    let bwd = best_time(KERNEL_REPS, || {
        be.attention_backward(
            a,
            AttnGradInputs::new(&dout, Qkv::new(&q, &k, &vv), &out, &lse),
            QkvGrads::new(&mut dq, &mut dk, &mut dv),
        )
    });
    vec![
        format!(
            "| attention fwd | {batch}x{}h x{seq} | {:.2} | {:.1} | |",
            a.heads,
            fwd * 1e3,
            gf / fwd
        ),
        format!(
            "| attention bwd | | {:.2} | {:.1} | |",
            bwd * 1e3,
            2.0 * gf / bwd
        ),
    ]
}

/// The memory-bound kernels: RMSNorm, SwiGLU, the cross-entropy.
pub fn elementwise_rows(be: &CpuBackend, cfg: &ModelConfig, rows: usize) -> Vec<String> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (x, w) = (random(rows * h, 8), random(h, 9));
    let (mut y, mut rstd, mut dx, mut dw) = (
        vec![0f32; rows * h],
        vec![0f32; rows],
        vec![0f32; rows * h],
        vec![0f32; h],
    );
    let norm_fwd = best_time(KERNEL_REPS, || {
        be.rmsnorm_forward(&x, &w, 1e-5, &mut y, &mut rstd)
    });
    let norm_bwd = best_time(KERNEL_REPS, || {
        be.rmsnorm_backward_input(&y, &x, &w, &rstd, &mut dx, false);
        be.rmsnorm_backward_weight(&y, &x, &rstd, &mut dw)
    });
    let (g, u) = (random(rows * f, 10), random(rows * f, 11));
    let (mut o, mut dg, mut du) = (
        vec![0f32; rows * f],
        vec![0f32; rows * f],
        vec![0f32; rows * f],
    );
    let swiglu_fwd = best_time(KERNEL_REPS, || be.swiglu_forward(&g, &u, &mut o));
    let swiglu_bwd = best_time(KERNEL_REPS, || {
        be.swiglu_backward(&o, &g, &u, &mut dg, &mut du)
    });
    let logits = random(rows * v, 12);
    let targets: Vec<Option<u32>> = (0..rows).map(|r| Some((r % v) as u32)).collect();
    let mut l = logits.clone();
    let copy = best_time(KERNEL_REPS, || l.copy_from_slice(&logits));
    let ce = best_time(KERNEL_REPS, || {
        l.copy_from_slice(&logits);
        be.cross_entropy(&mut l, v, &targets, 1.0);
    });
    vec![
        format!("| rmsnorm fwd | {rows}x{h} | {:.2} | | |", norm_fwd * 1e3),
        format!("| rmsnorm bwd | {rows}x{h} | {:.2} | | |", norm_bwd * 1e3),
        format!("| swiglu fwd | {rows}x{f} | {:.2} | | |", swiglu_fwd * 1e3),
        format!("| swiglu bwd | {rows}x{f} | {:.2} | | |", swiglu_bwd * 1e3),
        format!(
            "| cross-entropy | {rows}x{v} | {:.2} | | |",
            (ce - copy) * 1e3
        ),
    ]
}

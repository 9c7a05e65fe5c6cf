//! `bench attention`'s measurement: the engine's memory-efficient causal attention, forward and
//! backward, timed on this machine at one shape, beside the peak of the products' arithmetic
//! measured the same way (the f32 FMA peak, or the bf16 path's).

use super::kernel_bench::Peaks;
use super::peak::{sorted_times, Clock};
use ferrotron_core::precision::Products;
use ferrotron_engine::kernels::{AttnGradInputs, AttnShape, Backend, CpuBackend, Qkv, QkvGrads};
use rand::{Rng, SeedableRng};

/// What was measured: median and fastest seconds of each pass, and the FLOPs they count.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttentionTimes {
    pub forward_s: f64,
    pub backward_s: f64,
    /// The fastest timings, read against the peak (itself the best of its measurements): a shared
    /// machine only ever slows a run, so kernel and peak are compared at its best, as `bench
    /// kernels` compares them.
    pub forward_best_s: f64,
    pub backward_best_s: f64,
    /// FlashAttention-2's convention: forward 4·B·H·S²·D, halved under the causal mask; backward
    /// 2.5 times the forward (its five products to the forward's two, QKᵀ recomputed).
    pub forward_flop: f64,
    pub backward_flop: f64,
    /// The peak the products are read against (GFLOP/s), where this CPU has one measured.
    pub peak_gflops: Option<f64>,
    pub threads: usize,
}

impl AttentionTimes {
    pub fn forward_gflops(&self) -> f64 {
        self.forward_flop / self.forward_s / 1e9
    }
    pub fn backward_gflops(&self) -> f64 {
        self.backward_flop / self.backward_s / 1e9
    }
    /// The fraction of the peak of each pass and of both, at their fastest timings (None where
    /// this CPU has no peak measured).
    pub fn of_peak(&self) -> Option<[f64; 3]> {
        let peak = self.peak_gflops? * 1e9;
        let (f, b) = (self.forward_best_s, self.backward_best_s);
        Some([
            self.forward_flop / f / peak,
            self.backward_flop / b / peak,
            (self.forward_flop + self.backward_flop) / (f + b) / peak,
        ])
    }
}

/// Why a benchmark cannot run attention of shape `s`, if it cannot: KV heads that do not divide the
/// query heads, or tensors too large to hold.
pub fn check_shape(s: &AttnShape) -> anyhow::Result<()> {
    anyhow::ensure!(
        s.heads.is_multiple_of(s.kv_heads),
        "--heads {} is not a multiple of --kv-heads {}: each key/value head serves a whole group \
         of query heads",
        s.heads,
        s.kv_heads
    );
    // Q, K, V, the output and four gradients, f32.
    let elements = (s.batch as u128) * (s.seq as u128) * (s.q_width() as u128) * 8;
    anyhow::ensure!(
        elements <= 1 << 34,
        "batch {} × seq {} × {} heads × head dim {} needs {:.1} GB of tensors: give a smaller shape",
        s.batch,
        s.seq,
        s.heads,
        s.head_dim,
        elements as f64 * 4.0 / 1e9
    );
    Ok(())
}

/// FLOPs of causal attention's forward at this shape (FlashAttention-2's count).
pub fn forward_flop(s: &AttnShape) -> f64 {
    let (b, h, t, d) = (s.batch, s.heads, s.seq, s.head_dim);
    4.0 * (b * h) as f64 * (t * t) as f64 * d as f64 / 2.0
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
}

/// Times `reps` forward and backward passes (after an untimed one each): their medians and the
/// fastest.
pub fn measure(be: &CpuBackend, s: AttnShape, reps: usize) -> AttentionTimes {
    // The tensors are allocated as a device thread allocates training's (on huge pages, where
    // the allocator puts a device's tensors), and let go of it after.
    ferrotron_engine::memory::set_device(0);
    let times = measure_on_device(be, s, reps);
    ferrotron_engine::memory::clear_device();
    times
}

fn measure_on_device(be: &CpuBackend, s: AttnShape, reps: usize) -> AttentionTimes {
    let rows = s.batch * s.seq;
    let (q, k, v, dout) = (
        random(rows * s.q_width(), 1),
        random(rows * s.kv_width(), 2),
        random(rows * s.kv_width(), 3),
        random(rows * s.q_width(), 4),
    );
    let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; s.lse_len()]);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    let peaks = Peaks::measure(be);
    // Backward reads what forward wrote; forward's output is the same every time.
    let forward = sorted_times(Clock::Wall, reps, || {
        be.attention_forward(s, Qkv::new(&q, &k, &v), &mut out, &mut lse)
    });
    let backward = sorted_times(Clock::Wall, reps, || {
        be.attention_backward(
            s,
            AttnGradInputs::new(&dout, Qkv::new(&q, &k, &v), &out, &lse),
            QkvGrads::new(&mut dq, &mut dk, &mut dv),
        )
    });
    let forward_flop = forward_flop(&s);
    AttentionTimes {
        forward_s: forward[forward.len() / 2],
        backward_s: backward[backward.len() / 2],
        forward_best_s: forward[0],
        backward_best_s: backward[0],
        forward_flop,
        backward_flop: 2.5 * forward_flop,
        peak_gflops: peaks.peak,
        threads: be.threads,
    }
}

/// The backend for a benchmark: `threads` kernel threads (0: all cores), products in `products`.
pub fn backend(threads: usize, products: Products) -> CpuBackend {
    if threads == 0 {
        CpuBackend::default()
    } else {
        CpuBackend::with_threads(threads)
    }
    .computing(products)
}

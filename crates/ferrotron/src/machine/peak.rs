//! What this machine's cores can do, measured: the f32 multiply-add peak and the bf16 peak of the
//! best bf16 GEMM path, from chains of their instructions, and the clocks and repetitions the
//! benchmarks time kernels with so that kernel and peak compare at the machine's best.

use ferrotron_engine::kernels::bf16_gemm;
use std::time::Instant;

#[derive(Clone, Copy)]
pub enum Clock {
    Wall,
    ThreadCpu,
}

impl Clock {
    /// Seconds since some fixed point of this clock (on this thread).
    fn now(self, epoch: Instant) -> f64 {
        match self {
            Clock::Wall => epoch.elapsed().as_secs_f64(),
            Clock::ThreadCpu => ferrotron_engine::comm::thread_cpu_time(),
        }
    }
}

/// The median of `reps` runs of `f` (after one to warm up) on `clock`.
pub fn time_on(clock: Clock, reps: usize, f: impl FnMut()) -> f64 {
    let t = sorted_times(clock, reps, f);
    t[t.len() / 2]
}

/// The fastest of `reps` timed calls of `f` (after one warm-up): what the code can do when nothing
/// else on a shared machine slows it, the measure to hold against a peak measured the same way.
pub fn best_time(reps: usize, f: impl FnMut()) -> f64 {
    sorted_times(Clock::Wall, reps, f)[0]
}

/// The times of `reps` runs of `f` (after one to warm up) on `clock`, fastest first.
pub fn sorted_times(clock: Clock, reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    let epoch = Instant::now();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = clock.now(epoch);
            f();
            clock.now(epoch) - t0
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t
}

/// Timings of each kernel in `bench kernels`, and measurements of each peak: the best of them is
/// reported, since a shared virtual machine only ever slows a run (its AMX rate here swings 2×
/// within seconds), so that kernel and peak are compared at the machine's best.
pub const KERNEL_REPS: usize = 9;
pub const PEAK_REPS: usize = 3;

/// The highest of [`PEAK_REPS`] measurements of a peak (GFLOP/s and what it ran on).
pub fn best_peak<T>(mut measure: impl FnMut() -> Option<(f64, T)>) -> Option<(f64, T)> {
    (0..PEAK_REPS)
        .filter_map(|_| measure())
        .max_by(|a, b| a.0.total_cmp(&b.0))
}

/// The CPU's f32 multiply-add peak on `threads` threads, for reading every GFLOP/s above as a fraction
/// of what the cores can do: twelve independent FMA chains per thread, 16 lanes wide with AVX-512 or
/// 8 with AVX2.
pub fn fma_peak_gflops(threads: usize) -> Option<(f64, &'static str)> {
    fma_peak_gflops_on(Clock::Wall, threads)
}

/// [`fma_peak_gflops`], each thread timed on `clock`: the sum of the threads' rates.
pub fn fma_peak_gflops_on(clock: Clock, threads: usize) -> Option<(f64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        const ITERS: usize = 40_000_000;
        let (run, isa): (fn(usize) -> f64, _) = if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected just above.
            (|n| unsafe { fma_chains_avx512(n) }, "AVX-512")
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were detected just above.
            (|n| unsafe { fma_chains_avx2(n) }, "AVX2")
        } else {
            return None;
        };
        Some((peak_rate(clock, threads, || run(ITERS)) / 1e9, isa))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (clock, threads);
        None
    }
}

/// The sum over `threads` threads of the FLOP rate of `run` (which returns the FLOP it did), each
/// timed on `clock`.
fn peak_rate(clock: Clock, threads: usize, run: impl Fn() -> f64 + Sync) -> f64 {
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let epoch = Instant::now();
                    let t0 = clock.now(epoch);
                    let flop = run();
                    flop / (clock.now(epoch) - t0)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or(0.0)).sum()
    })
}

/// The bf16 peak of `threads` threads on `path` (GFLOP/s), from chains of its
/// instruction; `None` where it has none.
pub fn bf16_peak_gflops(path: bf16_gemm::Path, threads: usize) -> Option<f64> {
    bf16_peak_gflops_of(path, threads, 40_000_000)
}

/// [`bf16_peak_gflops`] from `iters` rounds of each thread's chains.
pub fn bf16_peak_gflops_of(path: bf16_gemm::Path, threads: usize, iters: usize) -> Option<f64> {
    bf16_gemm::peak_chains(path, 1)?;
    Some(
        peak_rate(Clock::Wall, threads, || {
            bf16_gemm::peak_chains(path, iters).unwrap_or(0.0)
        }) / 1e9,
    )
}

/// The fastest of [`KERNEL_REPS`] timings of a product of `gflop` (after one warm-up) and, where
/// `peak_now` measures a peak, the median of each timing's fraction of the peak measured just
/// before it: this VM's AMX rate moves 2× within seconds, so a kernel's best timing and the best
/// peak may come from different moments, while a pair sees one.
pub fn time_beside_peak(
    gflop: f64,
    peak_now: &dyn Fn() -> Option<f64>,
    mut f: impl FnMut(),
) -> (f64, Option<f64>) {
    f();
    let (mut times, mut fractions) = (Vec::new(), Vec::new());
    for _ in 0..KERNEL_REPS {
        let peak = peak_now();
        let t0 = Instant::now();
        f();
        let t = t0.elapsed().as_secs_f64();
        times.push(t);
        fractions.extend(peak.map(|p| gflop / t / p));
    }
    times.sort_by(f64::total_cmp);
    fractions.sort_by(f64::total_cmp);
    let median = fractions.get(fractions.len() / 2).copied();
    (times[0], median)
}

/// FLOP done by `iters` rounds of 12 independent 16-lane fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_chains_avx512(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    // Opaque operands, so that the compiler cannot fold or hoist the chains.
    let (b, c) = (
        _mm512_set1_ps(std::hint::black_box(0.999_9)),
        _mm512_set1_ps(1e-4),
    );
    let mut acc: [__m512; 12] =
        std::array::from_fn(|i| _mm512_set1_ps(std::hint::black_box(i as f32)));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    std::hint::black_box(acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum::<f32>());
    (iters * 12 * 16 * 2) as f64
}

/// FLOP done by `iters` rounds of 12 independent 8-lane fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_chains_avx2(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let (b, c) = (
        _mm256_set1_ps(std::hint::black_box(0.999_9)),
        _mm256_set1_ps(1e-4),
    );
    let mut acc: [__m256; 12] =
        std::array::from_fn(|i| _mm256_set1_ps(std::hint::black_box(i as f32)));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    let mut lanes = [0f32; 8];
    for a in acc {
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        std::hint::black_box(lanes);
    }
    (iters * 12 * 8 * 2) as f64
}

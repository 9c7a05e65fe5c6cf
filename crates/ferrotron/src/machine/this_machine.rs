//! `ferrotron calibrate --this-machine`: measure what one device of the threads backend (one thread)
//! does on this CPU — the f32 FMA peak, GEMMs over a range of shapes, attention, the memory-bound
//! kernels, and collectives in device time — and write the `this-machine` cluster from it.

use super::peak::{fma_peak_gflops_on, time_on, Clock};
use super::write_cluster;
use crate::report::Table;
use anyhow::{bail, Result};
use ferrotron_core::model::WeightLayout;
use ferrotron_core::topology::{
    cpu_fingerprint, this_machine_cache, Cluster, MAX_ATTENTION_EFFICIENCY,
};
use ferrotron_engine::comm::{Comm, Group, LinkModel, ReduceOp, ThreadWorld};
use ferrotron_engine::kernels::{
    AttnGradInputs, AttnShape, Backend, CpuBackend, LinearShape, Matrix, Qkv, QkvGrads,
};
use std::path::Path;

/// Rows of the GEMMs measured: a micro-batch of 256 tokens, as the profiles run.
const ROWS: usize = 256;
/// (n, k) of the GEMMs measured: the widths a small model's projections take under tp = 1…8.
const GEMM_SHAPES: [(usize, usize); 8] = [
    (64, 256),
    (128, 256),
    (256, 256),
    (704, 256),
    (256, 704),
    (512, 512),
    (1024, 1024),
    (2048, 256),
];

fn rand_vec(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

/// Seconds for forward, input gradient and weight gradient of one GEMM shape on one thread.
fn gemm_seconds(be: &CpuBackend, rows: usize, n: usize, k: usize) -> f64 {
    let s = LinearShape {
        rows,
        in_dim: k,
        out_dim: n,
        layout: WeightLayout::OutIn,
    };
    let (x, w, dy) = (
        rand_vec(rows * k, 1),
        rand_vec(n * k, 2),
        rand_vec(rows * n, 3),
    );
    let (mut y, mut dx, mut dw) = (
        vec![0f32; rows * n],
        vec![0f32; rows * k],
        vec![0f32; n * k],
    );
    time_on(Clock::ThreadCpu, 5, || {
        be.linear_forward(s, &x, Matrix::F32(&w), None, &mut y)
    }) + time_on(Clock::ThreadCpu, 5, || {
        be.linear_backward_input(s, &dy, Matrix::F32(&w), &mut dx, false)
    }) + time_on(Clock::ThreadCpu, 5, || {
        be.linear_backward_weight(s, &dy, &x, &mut dw, None)
    })
}

/// Fits efficiency = max · w / (w + half) to (width, efficiency) points: 1/eff is linear in 1/w.
fn fit_gemm_curve(points: &[(f64, f64)]) -> (f64, f64) {
    let xs: Vec<f64> = points.iter().map(|p| 1.0 / p.0).collect();
    let ys: Vec<f64> = points.iter().map(|p| 1.0 / p.1).collect();
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let slope = (sxy / sxx).max(0.0);
    let intercept = (my - slope * mx).max(1.0);
    (1.0 / intercept, (slope / intercept).max(1.0))
}

/// Device time of one all-reduce of `elems` f32 over `n` threads with `link` charged per transfer:
/// the slowest rank's, median of a few.
fn all_reduce_device_time(n: usize, elems: usize, link: LinkModel) -> Result<f64> {
    let times = ThreadWorld::new(n).link(link).run(|c| {
        let g = Group::new("world", (0..n).collect());
        let mut buf = vec![1f32; elems];
        let mut t = Vec::new();
        for _ in 0..6 {
            c.barrier(&g)?;
            let t0 = c.device_time();
            c.all_reduce(&g, &mut buf, ReduceOp::Sum)?;
            t.push(c.device_time() - t0);
        }
        t.sort_by(f64::total_cmp);
        Ok::<f64, ferrotron_engine::comm::CommError>(t[t.len() / 2])
    });
    let mut worst: f64 = 0.0;
    for r in times {
        worst = worst.max(r??);
    }
    Ok(worst)
}

/// Device time of one point-to-point message of `elems` f32 from thread 0 to thread 1 with `link`
/// charged: the receiver's, from a common start, median of a few.
fn p2p_device_time(elems: usize, link: LinkModel) -> Result<f64> {
    let times = ThreadWorld::new(2).link(link).run(|c| {
        let g = Group::new("world", vec![0, 1]);
        let mut buf = vec![1f32; elems];
        let mut t = Vec::new();
        for tag in 0..6 {
            c.barrier(&g)?;
            let t0 = c.device_time();
            if c.rank() == 0 {
                c.send(1, &buf, tag)?;
            } else {
                c.recv(0, &mut buf, tag)?;
            }
            t.push(c.device_time() - t0);
        }
        t.sort_by(f64::total_cmp);
        Ok::<f64, ferrotron_engine::comm::CommError>(t[t.len() / 2])
    });
    let mut receiver = 0.0;
    for (rank, r) in times.into_iter().enumerate() {
        let t = r??;
        if rank == 1 {
            receiver = t;
        }
    }
    Ok(receiver)
}

/// Runs `f` on every core at once (devices compute side by side, sharing caches, memory and the
/// power budget) and returns the median of what each reports.
fn on_every_core(f: impl Fn() -> f64 + Sync) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut v: Vec<f64> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..cores).map(|_| s.spawn(&f)).collect();
        runs.into_iter()
            .map(|r| r.join().unwrap_or(f64::NAN))
            .collect()
    });
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(base: Cluster, out: &Path) -> Result<()> {
    let be = CpuBackend::with_threads(1);
    let cpu = cpu_fingerprint();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "ferrotron calibrate --this-machine: {cpu}; one device = one thread, measured with every \
         core busy ({cores} threads at once, as the devices run)"
    );
    // A peak is the fastest the cores go: the best of three measurements, so that one taken while a
    // shared VM runs slow does not make every kernel look faster than the peak (their efficiencies
    // would then be cut at 1 and the machine priced slower than it computes).
    let Some((all_gflops, isa)) = (0..3)
        .filter_map(|_| fma_peak_gflops_on(Clock::ThreadCpu, cores))
        .max_by(|a, b| a.0.total_cmp(&b.0))
    else {
        bail!("cannot measure this CPU's FMA peak (needs x86-64 with AVX2 or AVX-512)");
    };
    let peak = all_gflops / cores as f64 * 1e9;
    println!(
        "f32 FMA peak per thread with {cores} busy: {:.1} GFLOP/s ({isa})",
        peak / 1e9
    );
    let (gemm_max, gemm_half) = gemm_curve(&be, peak);
    let attention_efficiency = attention_efficiency(&be, peak);
    let bandwidth = memory_bound_bandwidth(&be);
    // Measured against the fixed modelled interconnect, not against `base`'s links, which may be an
    // earlier calibration's (its latency already holds the overhead measured here).
    let interconnect = Cluster::this_machine_uncalibrated();
    let (link_efficiency, latency) = links(&interconnect)?;
    let mut c = base;
    c.intra_node.bandwidth_bytes_per_s = interconnect.intra_node.bandwidth_bytes_per_s;
    c.name = "this-machine".into();
    c.peak_flops = peak;
    c.memory_bandwidth_bytes_per_s = bandwidth;
    c.calibration.gemm_efficiency_max = gemm_max.min(1.0);
    c.calibration.gemm_half_width = gemm_half.max(1e-3);
    c.calibration.attention_efficiency = attention_efficiency;
    c.calibration.link_efficiency = link_efficiency;
    c.intra_node.latency_s = latency;
    println!(
        "GEMM curve: max {:.1}% of peak, half at width {:.0}; attention {:.1}% of peak; memory-bound \
         kernels {:.1} GB/s; threads all-reduce and point-to-point {:.0}% of the modelled link (the rest: \
         their adds and copies); latency per message {:.1} µs",
        100.0 * c.calibration.gemm_efficiency_max,
        c.calibration.gemm_half_width,
        100.0 * attention_efficiency,
        bandwidth / 1e9,
        100.0 * link_efficiency,
        latency * 1e6
    );
    let header = format!(
        "ferrotron calibrate --this-machine on {cpu}: one device = one thread; links are the threads \
         backend's modelled interconnect"
    );
    write_cluster(out, &c, &header)?;
    let cache = this_machine_cache();
    write_cluster(&cache, &c, &header)?;
    println!("`--cluster this-machine` now means this calibration on this CPU");
    Ok(())
}

/// The GEMM efficiency curve (its maximum and the width where it is half), from the products of
/// [`GEMM_SHAPES`] on every core at once; its table printed.
fn gemm_curve(be: &CpuBackend, peak: f64) -> (f64, f64) {
    let mut table = Table::new(
        format!("GEMMs of {ROWS} rows, forward + both gradients, one thread per core"),
        &[
            "n × k",
            "width √(n·k)",
            "GFLOP/s per thread",
            "of peak (%)",
            "fitted (%)",
        ],
    );
    let mut points = Vec::new();
    for (n, k) in GEMM_SHAPES {
        let t = on_every_core(|| gemm_seconds(be, ROWS, n, k));
        let flops = 3.0 * 2.0 * (ROWS * n * k) as f64;
        points.push((((n * k) as f64).sqrt(), flops / t / peak));
    }
    let (gemm_max, gemm_half) = fit_gemm_curve(&points);
    for ((n, k), (w, eff)) in GEMM_SHAPES.iter().zip(&points) {
        table.row(vec![
            format!("{n} × {k}"),
            format!("{w:.0}"),
            format!("{:.1}", eff * peak / 1e9),
            format!("{:.1}", 100.0 * eff),
            format!("{:.1}", 100.0 * gemm_max * w / (w + gemm_half)),
        ]);
    }
    print!("{}", table.markdown());
    (gemm_max, gemm_half)
}

/// Attention of llama-small's shape, forward and backward, as a fraction of the peak; FLOPs counted
/// full (4·T·s·q_dim forward), as the planner does.
fn attention_efficiency(be: &CpuBackend, peak: f64) -> f64 {
    let a = AttnShape {
        batch: 1,
        seq: ROWS,
        heads: 4,
        kv_heads: 4,
        head_dim: 64,
        window: None,
    };
    let (q, k, v, dout) = (
        rand_vec(ROWS * a.q_width(), 4),
        rand_vec(ROWS * a.kv_width(), 5),
        rand_vec(ROWS * a.kv_width(), 6),
        rand_vec(ROWS * a.q_width(), 7),
    );
    let (o, lse) = (vec![0f32; q.len()], vec![0f32; a.lse_len()]);
    let (dq, dk, dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; v.len()],
    );
    let t_attn = on_every_core(|| {
        let (mut o, mut lse) = (o.clone(), lse.clone());
        let (mut dq, mut dk, mut dv) = (dq.clone(), dk.clone(), dv.clone());
        time_on(Clock::ThreadCpu, 5, || {
            be.attention_forward(a, Qkv::new(&q, &k, &v), &mut o, &mut lse)
        }) + time_on(Clock::ThreadCpu, 5, || {
            be.attention_backward(
                a,
                AttnGradInputs::new(&dout, Qkv::new(&q, &k, &v), &o, &lse),
                QkvGrads::new(&mut dq, &mut dk, &mut dv),
            )
        })
    });
    // Counted whole, the causal kernel's products may run at up to twice the peak.
    let attn_flops = 3.0 * 4.0 * (ROWS * ROWS * a.q_width()) as f64;
    (attn_flops / t_attn / peak).min(MAX_ATTENTION_EFFICIENCY)
}

/// The memory-bound kernels' bandwidth: bytes read and written over their time.
fn memory_bound_bandwidth(be: &CpuBackend) -> f64 {
    let (h, f) = (256usize, 704usize);
    let (x, w) = (rand_vec(ROWS * h, 8), rand_vec(h, 9));
    let (y, rstd, dx, dw) = (
        vec![0f32; ROWS * h],
        vec![0f32; ROWS],
        vec![0f32; ROWS * h],
        vec![0f32; h],
    );
    let (g, u) = (rand_vec(ROWS * f, 10), rand_vec(ROWS * f, 11));
    let (so, dg, du) = (
        vec![0f32; ROWS * f],
        vec![0f32; ROWS * f],
        vec![0f32; ROWS * f],
    );
    let t_mem = on_every_core(|| {
        let (mut y, mut rstd, mut dx, mut dw) = (y.clone(), rstd.clone(), dx.clone(), dw.clone());
        let (mut so, mut dg, mut du) = (so.clone(), dg.clone(), du.clone());
        time_on(Clock::ThreadCpu, 9, || {
            be.rmsnorm_forward(&x, &w, 1e-5, &mut y, &mut rstd)
        }) + time_on(Clock::ThreadCpu, 9, || {
            be.rmsnorm_backward_input(&y, &x, &w, &rstd, &mut dx, false);
            be.rmsnorm_backward_weight(&y, &x, &rstd, &mut dw)
        }) + time_on(Clock::ThreadCpu, 9, || be.swiglu_forward(&g, &u, &mut so))
            + time_on(Clock::ThreadCpu, 9, || {
                be.swiglu_backward(&so, &g, &u, &mut dg, &mut du)
            })
    });
    // rmsnorm: forward reads 1 writes 1, backward reads 2 writes 1 (and x again for the weight);
    // swiglu: forward reads 2 writes 1, backward reads 3 writes 2.
    let mem_bytes = 4.0 * (ROWS * (2 * h + 4 * h + 3 * f + 5 * f)) as f64;
    mem_bytes / t_mem
}

/// The collectives' efficiency against the link model they are charged by (the device time of a
/// threads all-reduce and of a large point-to-point message), and the latency per message.
fn links(base: &Cluster) -> Result<(f64, f64)> {
    let link = LinkModel {
        intra: base.intra_node,
        inter: base.inter_node,
        devices_per_node: base.devices_per_node,
    };
    let mut effs = Vec::new();
    for (n, elems) in [
        (2usize, 1usize << 18),
        (4, 1 << 18),
        (2, 1 << 20),
        (4, 1 << 20),
    ] {
        let measured = all_reduce_device_time(n, elems, link)?;
        let bytes = 2.0 * (n as f64 - 1.0) / n as f64 * (elems * 4) as f64;
        let steps = 2.0 * (n as f64 - 1.0);
        let wire = bytes / base.intra_node.bandwidth_bytes_per_s;
        let rest = (measured - steps * base.intra_node.latency_s).max(1e-12);
        effs.push((wire / rest).min(1.0));
    }
    // Point-to-point (pipeline boundaries): a large message's time against the link's wire time
    // counts towards the efficiency; a small one's (its wire time taken off) is the latency.
    let intra = base.intra_node;
    let wire = |elems: usize| (elems * 4) as f64 / intra.bandwidth_bytes_per_s;
    let large = 1usize << 20;
    let measured = p2p_device_time(large, link)?;
    effs.push((wire(large) / (measured - intra.latency_s).max(1e-12)).min(1.0));
    effs.sort_by(f64::total_cmp);
    let link_efficiency = effs[effs.len() / 2];
    let small = 256usize;
    let latency =
        (p2p_device_time(small, link)? - wire(small) / link_efficiency).max(intra.latency_s);
    Ok((link_efficiency, latency))
}

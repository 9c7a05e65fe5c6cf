use crate::machine::peak::{KERNEL_REPS, PEAK_REPS};
use anyhow::Result;
use clap::{Args, Subcommand};
use ferrotron_core::precision::{MixedPrecision, Products};
use ferrotron_engine::comm::ThreadWorld;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::runtime::engine_preset;
use ferrotron_engine::transformer::{ParamStore, TokenBatch};

use super::{device_count, positive};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Single-device training throughput (the PyTorch peer benchmark's configuration).
    Train(super::bench_train::TrainBench),
    /// Time of each kernel at the benchmark model's shapes, with achieved GFLOP/s for the GEMMs.
    Kernels(KernelBench),
    /// Causal attention (the engine's memory-efficient kernel), forward and backward at one shape:
    /// median times, GFLOP/s and the fraction of this machine's measured peak.
    Attention(AttentionBench),
    /// Context-parallel attention over cp devices on a simulated link (device time): the ring's
    /// exposed transfer time and the causal split's balance of compute.
    Context(ContextArgs),
    /// Collectives on the threads backend: time, algorithm and bus bandwidth (nccl-tests conventions).
    Comm(CommBench),
    /// Pipeline schedules on 4 stages: predicted and measured bubble, peak stash, step time.
    Pipeline(PipelineBench),
    /// ZeRO-3 on a simulated link: the gathers' exposed time per step, without and with prefetch.
    Zero3(Zero3Bench),
    /// The time model against this machine: calibrate, then measured and predicted step time of
    /// layouts covering dp, tp, pp (1F1B, ZB-H1), ZeRO-3, recompute and sp.
    Predict(PredictBench),
    /// LoRA against full fine-tuning of the same model and batches: tokens/s, forward/backward,
    /// and memory per term measured beside the planner's prediction.
    Lora(LoraBench),
    /// LoRA on an NF4 base against LoRA on the bf16 (and f32) base: tokens/s, the weights term
    /// measured and predicted, bytes per quantized parameter.
    Qlora(LoraBench),
    /// How long a checkpoint save holds training: synchronous against asynchronous
    /// (`checkpoint_async`), alternated rounds of the same run.
    Checkpoint(CheckpointBench),
}

#[derive(Args)]
pub struct CheckpointBench {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// The layout the runs train on.
    #[arg(long, default_value = "")]
    layout: String,
    /// Steps of each run.
    #[arg(long, value_parser = positive(), default_value_t = 12)]
    steps: usize,
    /// A save every this many steps.
    #[arg(long, value_parser = positive(), default_value_t = 3)]
    every: usize,
    /// Rounds, each one synchronous and one asynchronous run.
    #[arg(long, value_parser = positive(), default_value_t = 3)]
    rounds: usize,
    /// Where the checkpoints go: a directory or an `s3://` prefix (each run under its own name;
    /// default: each run's directory).
    #[arg(long)]
    to: Option<String>,
}

#[derive(Args)]
pub struct AttentionBench {
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 4096)]
    seq: usize,
    /// Sequences.
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    batch: usize,
    /// Query heads.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads; they must divide
    /// them).
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    kv_heads: usize,
    /// Width of each head.
    #[arg(long, value_parser = positive(), default_value_t = 64)]
    head_dim: usize,
    /// The products in `f32`, or in `bf16` (f32 accumulation, on the best bf16 instructions of
    /// this CPU).
    #[arg(long, default_value_t = MixedPrecision::F32)]
    precision: MixedPrecision,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed repetitions of each pass (the median is reported).
    #[arg(long, value_parser = positive(), default_value_t = 5)]
    reps: usize,
    /// Print one JSON object (`forward_s`, `backward_s`, … ) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ContextArgs {
    /// Devices the sequences are split over.
    #[arg(long, value_parser = device_count(), default_value_t = 4)]
    cp: usize,
    /// `ring` or `a2a`.
    #[arg(long, default_value = "ring")]
    cp_comm: String,
    /// Tokens per (whole) sequence.
    #[arg(long, value_parser = positive(), default_value_t = 8192)]
    seq: usize,
    /// Sequences.
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    batch: usize,
    /// Query heads.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    kv_heads: usize,
    /// Width of each head.
    #[arg(long, value_parser = positive(), default_value_t = 64)]
    head_dim: usize,
    /// The simulated link's bandwidth, GB/s.
    #[arg(long, default_value_t = 10.0)]
    link_gb_s: f64,
}

#[derive(Args)]
pub struct LoraBench {
    /// A preset or a Hugging Face model directory (e.g. the default run's `runs/default/model`).
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// The adapters' rank (alpha is twice it; every projection targeted).
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    rank: usize,
    /// Sequences per step.
    #[arg(long, value_parser = positive(), default_value_t = 16)]
    batch: usize,
    /// Sequences per micro-batch (`train`'s default layout runs one at a time).
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    mbs: usize,
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 128)]
    seq: usize,
    /// Steps timed (after two untimed ones).
    #[arg(long, value_parser = positive(), default_value_t = 10)]
    steps: usize,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

impl LoraBench {
    fn args(&self) -> super::bench_lora::LoraBenchArgs<'_> {
        super::bench_lora::LoraBenchArgs {
            model: &self.model,
            rank: self.rank,
            batch: self.batch,
            mbs: self.mbs,
            seq: self.seq,
            steps: self.steps,
            threads: self.threads,
        }
    }
}

#[derive(Args)]
pub struct PredictBench {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// Layouts to profile (`;`-separated; default: eight covering every dimension).
    #[arg(long, value_delimiter = ';')]
    layouts: Vec<String>,
    /// Steps each profile runs (the median step after the first is compared).
    #[arg(long, value_parser = positive(), default_value_t = 6)]
    steps: usize,
    /// Relative difference counted as agreement.
    #[arg(long, default_value_t = 0.15)]
    tolerance: f64,
    /// Where the cluster file and the profiles go.
    #[arg(long, default_value = "runs/bench-predict")]
    out: std::path::PathBuf,
}

#[derive(Args)]
pub struct Zero3Bench {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// Data-parallel group sizes to measure.
    #[arg(long, value_parser = device_count(), value_delimiter = ',', default_value = "2,4")]
    dp: Vec<usize>,
    /// The simulated link's bandwidth, GB/s.
    #[arg(long, default_value_t = 10.0)]
    link_gb_s: f64,
    /// Sequences per step (the global batch).
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 128)]
    seq: usize,
}

#[derive(Args)]
pub struct PipelineBench {
    /// Micro-batch counts to measure.
    #[arg(long, value_parser = positive(), value_delimiter = ',', default_value = "4,8,16")]
    micro_batches: Vec<usize>,
    /// Pipeline stages (one device each).
    #[arg(long, value_parser = device_count(), default_value_t = 4)]
    stages: usize,
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 256)]
    seq: usize,
}

#[derive(Args)]
pub struct CommBench {
    /// Group sizes to measure.
    #[arg(long, value_parser = device_count(), value_delimiter = ',', default_value = "2,4,8")]
    devices: Vec<usize>,
    /// Largest message in MiB (sizes go from 1 KiB up by factors of 4... to this).
    #[arg(long, value_parser = positive(), default_value_t = 256)]
    max_mib: usize,
    /// Repetitions per point (the median is reported).
    #[arg(long, value_parser = positive(), default_value_t = 3)]
    reps: usize,
}

#[derive(Args)]
pub struct KernelBench {
    /// A preset or a Hugging Face model directory: the kernels run at its shapes.
    #[arg(long, default_value = "llama-bench")]
    model: String,
    /// Sequences per step.
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, value_parser = positive(), default_value_t = 256)]
    seq: usize,
    /// Kernel threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The linear layers' products in `f32`, or in `bf16` (f32 accumulation, on the best bf16
    /// instructions of this CPU; the table then shows each shape beside the measured bf16 peak).
    #[arg(long, default_value_t = MixedPrecision::F32)]
    precision: MixedPrecision,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(b) => super::bench_train::run(b),
        BenchCommand::Kernels(b) => kernels(b),
        BenchCommand::Attention(b) => attention(b),
        BenchCommand::Context(b) => super::bench_context::run(super::bench_context::ContextBench {
            shape: ferrotron_engine::kernels::AttnShape {
                batch: b.batch,
                seq: b.seq,
                heads: b.heads,
                kv_heads: b.kv_heads,
                head_dim: b.head_dim,
                window: None,
            },
            cp: b.cp,
            comm: ferrotron_core::layout::CpComm::parse(&b.cp_comm)
                .ok_or_else(|| anyhow::anyhow!("--cp-comm `{}` is not ring or a2a", b.cp_comm))?,
            link_gb_s: b.link_gb_s,
        }),
        BenchCommand::Comm(b) => comm(b),
        BenchCommand::Pipeline(b) => pipeline(b),
        BenchCommand::Zero3(b) => {
            super::bench_zero3::run(&b.model, &b.dp, b.link_gb_s, b.batch, b.seq)
        }
        BenchCommand::Lora(b) => super::bench_lora::run(b.args()),
        BenchCommand::Qlora(b) => super::bench_qlora::run(b.args()),
        BenchCommand::Checkpoint(b) => super::bench_checkpoint::run(
            &b.model,
            &b.layout,
            b.steps,
            b.every,
            b.rounds,
            b.to.as_deref(),
        ),
        BenchCommand::Predict(b) => {
            let layouts = if b.layouts.is_empty() {
                super::bench_predict::LAYOUTS.map(String::from).to_vec()
            } else {
                b.layouts
            };
            super::bench_predict::run(&b.model, &layouts, b.steps, b.tolerance, &b.out)
        }
    }
}

/// What a measurement is timed by: elapsed time, or the calling thread's CPU time (the clock device
/// time runs on, which a virtual machine's stolen time does not move).
fn kernels(b: KernelBench) -> Result<()> {
    use crate::machine::kernel_bench::{self, Peaks};
    let cfg = engine_preset(&b.model)?;
    let be = if b.threads == 0 {
        CpuBackend::default()
    } else {
        CpuBackend::with_threads(b.threads)
    }
    .computing(b.precision.products());
    let rows = b.batch * b.seq;
    println!(
        "ferrotron bench kernels: {} shapes, {rows} rows, threads {}; each kernel the best of {KERNEL_REPS} timings, each peak the best of {PEAK_REPS}",
        b.model, be.threads
    );
    let peaks = Peaks::measure(&be);
    for line in &peaks.lines {
        println!("{line}");
    }
    let bf16 = be.products == Products::Bf16;
    let (head, rule) = if bf16 {
        (" of the peak just before (median of pairs) |", "---|")
    } else {
        ("", "")
    };
    println!(
        "| kernel | shape | ms | GFLOP/s | of {} peak |{head}\n|---|---|---|---|---|{rule}",
        b.precision
    );
    let rows_printed = [
        kernel_bench::linear_rows(&be, &cfg, rows, &peaks),
        kernel_bench::attention_rows(&be, &cfg, b.batch, b.seq),
        kernel_bench::elementwise_rows(&be, &cfg, rows),
    ];
    for line in rows_printed.iter().flatten() {
        println!("{line}");
    }
    Ok(())
}

/// One shape of causal attention, timed; a table, or one JSON object for scripts.
fn attention(b: AttentionBench) -> Result<()> {
    use crate::machine::attention_bench;
    let shape = ferrotron_engine::kernels::AttnShape {
        batch: b.batch,
        seq: b.seq,
        heads: b.heads,
        kv_heads: b.kv_heads,
        head_dim: b.head_dim,
        window: None,
    };
    attention_bench::check_shape(&shape)?;
    let be = attention_bench::backend(b.threads, b.precision.products());
    let t = attention_bench::measure(&be, shape, b.reps);
    if b.json {
        let mut v = serde_json::to_value(&t)?;
        v["seq"] = b.seq.into();
        v["batch"] = b.batch.into();
        v["heads"] = b.heads.into();
        v["kv_heads"] = b.kv_heads.into();
        v["head_dim"] = b.head_dim.into();
        v["precision"] = b.precision.name().into();
        v["forward_gflops"] = t.forward_gflops().into();
        v["backward_gflops"] = t.backward_gflops().into();
        if let Some([f, bw, both]) = t.of_peak() {
            v["forward_of_peak"] = f.into();
            v["backward_of_peak"] = bw.into();
            v["of_peak"] = both.into();
        }
        println!("{v}");
        return Ok(());
    }
    println!(
        "ferrotron bench attention: causal, batch {} x seq {}, {} heads ({} kv), head dim {}, {} products, {} threads; median and fastest of {} timings",
        b.batch, b.seq, b.heads, b.kv_heads, b.head_dim, b.precision.products().name(), t.threads, b.reps
    );
    let fractions = t.of_peak();
    let of_peak = |i: usize| {
        fractions.map_or("not measured".to_string(), |f| {
            format!("{:.0}%", 100.0 * f[i])
        })
    };
    println!(
        "| pass | median ms | GFLOP/s (median) | fastest ms | of the measured peak ({}), at the fastest |\n|---|---|---|---|---|",
        t.peak_gflops
            .map_or("none".to_string(), |p| format!("{p:.1} GFLOP/s"))
    );
    let flop = t.forward_flop + t.backward_flop;
    for (i, (pass, s, best, f)) in [
        ("forward", t.forward_s, t.forward_best_s, t.forward_flop),
        ("backward", t.backward_s, t.backward_best_s, t.backward_flop),
        (
            "forward + backward",
            t.forward_s + t.backward_s,
            t.forward_best_s + t.backward_best_s,
            flop,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        println!(
            "| {pass} | {:.2} | {:.1} | {:.2} | {} |",
            s * 1e3,
            f / s / 1e9,
            best * 1e3,
            of_peak(i)
        );
    }
    println!(
        "(the fastest timing against the best peak measurement, as `bench kernels` reads them: a \
         shared machine only ever slows a run)"
    );
    Ok(())
}

/// The threads backend's table; `ferrotron-mpi-selftest bench` prints the MPI backend's.
fn comm(b: CommBench) -> Result<()> {
    use ferrotron_engine::comm::selftest::{
        all_reduce_memory_ceiling, bench_op, bench_row, bench_sizes, BENCH_HEADER, BENCH_OPS,
    };

    let elems = (b.max_mib.min(64) << 20) / 4;
    println!(
        "memory-bandwidth ceiling of a 2-rank {} MiB all-reduce on this machine (only the adds and copies \
         the result needs, no messages): {:.2} GB/s bus bandwidth",
        (elems * 4) >> 20,
        all_reduce_memory_ceiling(elems, 5) / 1e9
    );
    println!("ferrotron bench comm: threads backend, f32, median of {} reps, wall time of the slowest rank", b.reps);
    println!("{BENCH_HEADER}");
    for &n in &b.devices {
        for elems in bench_sizes(b.max_mib, n) {
            for op in BENCH_OPS {
                let times = ThreadWorld::new(n).run(|c| bench_op(c, op, elems, b.reps));
                let t = times
                    .into_iter()
                    .map(|r| r.map_err(anyhow::Error::from).and_then(|x| Ok(x?)))
                    .collect::<Result<Vec<f64>>>()?;
                println!(
                    "{}",
                    bench_row("threads", op, n, elems, t.into_iter().fold(0.0, f64::max))
                );
            }
        }
    }
    Ok(())
}

/// Each schedule on a model whose stages cost the same (two equal layers each; a small head), one
/// warm-up step, then the measured one. "Predicted" is the schedule simulator with uniform costs
/// (backward = 2 × forward; zero-bubble halves split evenly; interleaved chunks cost 1/v).
fn pipeline(b: PipelineBench) -> Result<()> {
    use ferrotron_core::layout::{Recompute, Schedule};
    use ferrotron_core::model::ModelConfig;
    use ferrotron_core::schedule::{build, simulate, ActionCosts, StagePartition};
    ferrotron_engine::keep_freed_memory_in_process();
    let p = b.stages;
    let cfg = ModelConfig::llama(64, 256, 704, 2 * p, 4, 4, b.seq, 10000.0);
    let params = ParamStore::init_random(&cfg, 3);
    println!("ferrotron bench pipeline: {p} stages x 2 layers (hidden 256), seq {}, mbs 1, threads backend, device time", b.seq);
    let part = StagePartition::for_model(&cfg, p)?;
    let costs: Vec<String> = part
        .layers
        .iter()
        .zip(&part.costs)
        .map(|(r, c)| format!("{r:?}: {:.1} MFLOP/token", c / 1e6))
        .collect();
    println!(
        "stage partition (predicted cost per token): {}",
        costs.join(", ")
    );
    println!("| schedule | recompute | micro-batches | predicted bubble | measured bubble (worst stage) | peak stash stage 0 | peak activations stage 0 | step (device s) | step (wall s) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rows: Vec<(Schedule, usize, Recompute, usize)> = Vec::new();
    for schedule in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Zbh1] {
        for &m in &b.micro_batches {
            rows.push((schedule, 1, Recompute::None, m));
        }
    }
    rows.push((Schedule::Interleaved, 2, Recompute::None, 8));
    rows.push((Schedule::OneFOneB, 1, Recompute::Full, 8));
    let mut breakdown = None;
    for (schedule, v, recompute, m) in rows {
        let run = pipeline_row(&cfg, &params, b.seq, (schedule, p, v, recompute, m))?;
        if schedule == Schedule::OneFOneB && recompute == Recompute::None && m == 8 {
            let predicted = simulate(
                &build(schedule, p, m, 1)?,
                &[ActionCosts::uniform(1.0, 2.0)],
            )?;
            breakdown = Some((run, predicted));
        }
    }
    if let Some((run, predicted)) = breakdown {
        print_stage_breakdown(&run, &predicted, p);
    }
    super::bench_async::run(&cfg, &params, p, b.seq)
}

/// One row of the pipeline table: a schedule over `p` stages (`v` chunks each) with `m`
/// micro-batches, measured and beside the simulator's bubble.
fn pipeline_row(
    cfg: &ferrotron_core::model::ModelConfig,
    params: &ParamStore,
    seq: usize,
    (schedule, p, v, recompute, m): (
        ferrotron_core::layout::Schedule,
        usize,
        usize,
        ferrotron_core::layout::Recompute,
        usize,
    ),
) -> Result<ferrotron_engine::parallel::PipelineRun> {
    use ferrotron_core::layout::Layout;
    use ferrotron_core::schedule::{build, simulate, ActionCosts, StagePartition};
    let batch = TokenBatch {
        ids: (0..m * seq).map(|i| (i * 7 % 64) as u32).collect(),
        batch: m,
        seq,
    };
    let layout = Layout {
        pp: p,
        vpp: v,
        micro_batch_size: 1,
        schedule,
        recompute,
        ..Layout::default()
    };
    let part = StagePartition::for_model(cfg, p * v)?;
    let run = ferrotron_engine::parallel::pipeline_steps(
        cfg,
        params,
        &batch,
        &layout,
        &part,
        std::time::Duration::from_secs(600),
        1,
    )?;
    let vf = v as f64;
    let predicted = simulate(
        &build(schedule, p, m, v)?,
        &[ActionCosts::uniform(1.0 / vf, 2.0 / vf)],
    )?
    .bubble_fraction();
    println!(
        "| {}{} | {} | {m} | {:.1}% | {:.1}% | {} | {:.2} MB | {:.3} | {:.3} |",
        schedule.name(),
        if v > 1 {
            format!(" (v={v})")
        } else {
            String::new()
        },
        recompute.name(),
        predicted * 100.0,
        run.bubble_fraction() * 100.0,
        run.peak_stashed[0],
        run.peak_stash_bytes[0] as f64 / 1e6,
        run.step_time_s(),
        run.wall_time_s
    );
    Ok(run)
}

/// Per stage of a measured 1F1B step: computing, waiting on neighbours, in collectives, and idle
/// beside the simulator's.
fn print_stage_breakdown(
    run: &ferrotron_engine::parallel::PipelineRun,
    predicted: &ferrotron_core::schedule::Timeline,
    p: usize,
) {
    println!("\n1f1b, 8 micro-batches, per stage (device time):");
    println!("| stage | computing (s) | waiting on neighbours (s) | in collectives (s) | idle measured | idle predicted |\n|---|---|---|---|---|---|");
    for s in 0..p {
        let blocked = |p2p: bool| -> f64 {
            run.stats[s]
                .by_op
                .iter()
                .filter(|(k, _)| k.starts_with("p2p/") == p2p)
                .map(|(_, o)| o.time_blocked_s)
                .sum::<f64>()
                + 0.0
        };
        println!(
            "| {s} | {:.3} | {:.3} | {:.3} | {:.1}% | {:.1}% |",
            run.busy_s(s),
            blocked(true),
            blocked(false),
            run.idle_fraction(s) * 100.0,
            predicted.idle_fraction(s) * 100.0
        );
    }
}

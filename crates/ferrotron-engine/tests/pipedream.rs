//! The asynchronous schedules against their delayed-update reference: PipeDream and PipeDream-2BW
//! pipelines, with tensor and data parallelism, give the parameters of a separate single-device
//! trainer that applies the same delays (AdamW, global-norm clipping of the delayed gradients).

mod common;

use common::*;
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_engine::hf;
use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
use ferrotron_engine::runtime::{train_steps, DelayedReference};
use ferrotron_engine::transformer::{ParamStore, TokenBatch};

/// f32 relative tolerance per parameter tensor after six AdamW steps (reduction orders differ).
const TOL: f64 = 1e-5;
const STEPS: usize = 6;
/// Steps of the bf16 Mixtral case (see where it is used).
const MOE_STEPS: usize = 3;

fn adam() -> AdamWConfig {
    // eps 1e-6 as in data_parallel.rs: Adam's g/(|g| + eps) is steep where |g| ≈ eps.
    AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay: 0.1,
    }
}

fn lr() -> LrSchedule {
    LrSchedule {
        peak_lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        total_steps: STEPS,
    }
}

/// The parameters after `STEPS` steps of `layout` on the threads backend (gathered on rank 0).
fn pipeline(
    cfg: &ModelConfig,
    params: &ParamStore,
    layout: &Layout,
    batches: &[TokenBatch],
    clip: f64,
    drain_after: &(dyn Fn(usize) -> bool + Sync),
    precision: MixedPrecision,
) -> ParamStore {
    train_steps(
        cfg,
        params,
        layout,
        batches,
        adam(),
        &lr(),
        clip,
        drain_after,
        precision,
    )
    .unwrap()
}

fn check(model: &str, spec: &str, clip: f64, drain_after: &(dyn Fn(usize) -> bool + Sync)) {
    let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
    let layout = LayoutSpec::parse(spec).unwrap().layout;
    let batch = layout.dp * layout.micro_batch_size * 4;
    let batches: Vec<TokenBatch> = (0..STEPS)
        .map(|k| random_batch(cfg.vocab_size, batch, 16, 40 + k as u64))
        .collect();
    let got = pipeline(
        &cfg,
        &params,
        &layout,
        &batches,
        clip,
        drain_after,
        MixedPrecision::F32,
    );
    let lr = lr();
    let reference = DelayedReference {
        cfg: &cfg,
        layout: &layout,
        adam: adam(),
        lr: &lr,
        clip,
        precision: MixedPrecision::F32,
    };
    let want = reference
        .train(&params, STEPS, &|k| batches[k].clone(), drain_after)
        .unwrap();
    let mut worst = (String::new(), 0f64);
    for (s, (a, b)) in want.specs.iter().zip(got.tensors.iter().zip(&want.tensors)) {
        let e = rel_err(a, b);
        if e > worst.1 {
            worst = (s.name.clone(), e);
        }
    }
    // The run moved the parameters, and the delays are real: the synchronous schedule (1F1B,
    // no delay) trains to other parameters.
    assert!(rel_err(&want.tensors[1], &params.tensors[1]) > 1e-3);
    let sync = Layout {
        schedule: ferrotron_core::layout::Schedule::OneFOneB,
        ..layout
    };
    let undelayed = pipeline(
        &cfg,
        &params,
        &sync,
        &batches,
        clip,
        drain_after,
        MixedPrecision::F32,
    );
    let apart = rel_err(&undelayed.tensors[1], &want.tensors[1]);
    assert!(
        apart > 1e-4,
        "{model} {spec}: no delay visible ({apart:.1e})"
    );
    println!(
        "{model} {spec} clip {clip}: worst {} {:.1e}",
        worst.0, worst.1
    );
    assert!(
        worst.1 <= TOL,
        "{model} {spec}: {} differs by {:.2e}",
        worst.0,
        worst.1
    );
}

#[test]
fn two_bw_pipelines_equal_the_delayed_update_reference() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        for pp in [2, 3, 4] {
            check(model, &format!("pp={pp},schedule=2bw"), 0.5, &|_| false);
        }
    }
}

#[test]
fn pipedream_pipelines_equal_the_delayed_update_reference() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        for pp in [2, 3, 4] {
            check(model, &format!("pp={pp},schedule=pipedream"), 0.5, &|_| {
                false
            });
        }
    }
}

#[test]
fn asynchronous_pipelines_compose_with_tensor_and_data_parallelism() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        for kind in ["2bw", "pipedream"] {
            check(model, &format!("pp=2,tp=2,schedule={kind}"), 0.5, &|_| {
                false
            });
            check(model, &format!("pp=2,dp=2,schedule={kind}"), 0.5, &|_| {
                false
            });
            check(
                model,
                &format!("pp=2,dp=2,zero=1,schedule={kind}"),
                0.5,
                &|_| false,
            );
        }
    }
}

/// A mixture of experts (the Mixtral fixture) on the asynchronous schedules: its router statistics
/// travel with each micro-batch as on the synchronous ones (summed over the replicas' i-th
/// micro-batches, whose load-balancing loss the reference takes over all of them at once). Under
/// expert parallelism each device keeps the versions of its two states (dense tensors over dp,
/// its experts over dp/ep), ZeRO-1 sharding each over its own group.
#[test]
fn asynchronous_pipelines_of_a_mixture_of_experts_equal_the_delayed_update_reference() {
    for spec in [
        "pp=2,schedule=2bw",
        "pp=2,schedule=pipedream",
        "pp=2,dp=2,zero=1,schedule=2bw",
        "pp=2,tp=2,etp=1,schedule=pipedream",
        "pp=2,dp=2,ep=2,schedule=2bw",
        "pp=2,dp=2,ep=2,zero=1,schedule=pipedream",
        "pp=2,dp=4,ep=2,zero=1,schedule=2bw",
    ] {
        check("variants/mixtral", spec, 0.5, &|_| false);
    }
}

#[test]
fn a_drain_restarts_the_delays_the_same_way_in_pipeline_and_reference() {
    // A checkpoint or an evaluation after step 2 drains the pipeline: the next step starts from
    // the weights at hand, on both sides; without clipping PipeDream's updates wait for nobody.
    for kind in ["2bw", "pipedream"] {
        check("llama_tiny", &format!("pp=3,schedule={kind}"), 0.0, &|k| {
            k == 2
        });
        check("gpt2_tiny", &format!("pp=2,schedule={kind}"), 0.5, &|k| {
            k == 2
        });
    }
}

fn run_config(tag: &str, layout: &str, steps: usize) -> ferrotron_engine::runtime::TrainConfig {
    let dir = std::env::temp_dir().join(format!("ferrotron-async-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("manual.txt");
    std::fs::write(&corpus, &ferrotron_engine::data::BUILTIN_CORPUS[..60_000]).unwrap();
    {
        let mut c = ferrotron_engine::runtime::TrainConfig::default();
        c.input.model = fixture("gpt2_tiny").display().to_string();
        c.input.data = corpus.display().to_string();
        c.optimizer.steps = steps;
        c.optimizer.batch_size = 8;
        c.input.seq_len = 32;
        c.optimizer.warmup_steps = 2;
        c.optimizer.adam_eps = 1e-6;
        c.logging.eval_every = 0;
        c.logging.eval_batches = 2;
        c.parallelism.layout = layout.parse().unwrap();
        c.checkpointing.out_dir = dir.join("run");
        c
    }
}

#[test]
fn an_asynchronous_run_resumes_bitwise_from_its_drained_checkpoint() {
    use ferrotron_engine::runtime::{train, TrainConfig};
    let layout = "pp=2,dp=2,zero=1,mbs=2,schedule=2bw";
    let full = {
        let mut c = run_config("full", layout, 6);
        c.checkpointing.checkpoint_every = 3;
        c
    };
    train(&full, &mut |_| {}).unwrap();
    let resumed = {
        let mut c = run_config("resumed", layout, 6);
        c.checkpointing.resume = Some(
            full.checkpointing
                .out_dir
                .join("checkpoints")
                .join("step-000003"),
        );
        c.checkpointing.checkpoint_every = 3;
        c
    };
    train(&resumed, &mut |_| {}).unwrap();
    let load = |c: &TrainConfig| {
        hf::load_model(&c.checkpointing.out_dir.join("model"))
            .unwrap()
            .1
    };
    assert_eq!(load(&full), load(&resumed));
    // Every step was reported, with a loss.
    let lines = std::fs::read_to_string(full.checkpointing.out_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 6);
    assert!(lines.lines().all(|l| l.contains("\"loss\":")));
}

#[test]
fn what_the_asynchronous_executor_does_not_run_is_refused_by_name() {
    use ferrotron_engine::runtime::train;
    for (layout, precision, want) in [
        ("pp=2,dp=2,zero=3,schedule=2bw", "f32", "zero"),
        ("pp=2,schedule=pipedream", "fp16", "fp16's loss scaling"),
        ("pp=2,vpp=2,schedule=2bw", "f32", "vpp"),
        ("pp=4,mbs=4,schedule=2bw", "f32", "needs at least pp=4"),
    ] {
        let cfg = {
            let mut c = run_config("refused", layout, 2);
            c.numerics.precision = MixedPrecision::parse(precision).unwrap();
            c
        };
        let e = train(&cfg, &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains(want), "{layout} {precision}: {e}");
    }
    let lora = {
        let mut c = run_config("refused-lora", "pp=2,schedule=2bw", 2);
        c.lora.lora_rank = Some(2);
        c
    };
    let e = train(&lora, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("LoRA"), "{e}");
    // One step's gradients mean nothing under a schedule that spans steps.
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let layout = LayoutSpec::parse("pp=2,schedule=2bw").unwrap().layout;
    let batch = random_batch(cfg.vocab_size, 4, 16, 1);
    let Err(e) = ferrotron_engine::runtime::layout_step(
        &cfg,
        &params,
        &batch,
        &layout,
        &ferrotron_engine::kernels::CpuBackend::default(),
    ) else {
        panic!("one step of an asynchronous schedule ran")
    };
    let e = e.to_string();
    assert!(e.contains("verify --steps"), "{e}");
}

/// Per device: computing and span (device time) over `steps` steps of `layout`, and the peak
/// memory by term.
fn measured(
    cfg: &ModelConfig,
    params: &ParamStore,
    layout: &Layout,
    batch: &TokenBatch,
    steps: usize,
    precision: MixedPrecision,
) -> Vec<(f64, f64, ferrotron_engine::memory::MemoryTerms)> {
    use ferrotron_engine::comm::ThreadWorld;
    use ferrotron_engine::parallel::{MeshStep, Training};
    let part = ferrotron_core::schedule::StagePartition::for_layout(cfg, layout).unwrap();
    let lr = lr();
    // Memory accounts of this run's own (tests run side by side in one process).
    let accounts = ferrotron_engine::memory::Accounts::claim(layout.world_size());
    ThreadWorld::new(layout.world_size())
        .run(|c| {
            let mut step = MeshStep::new(cfg, params, batch, layout, &part)?
                .with_account_base(accounts.base)
                .with_precision(precision);
            let (mut busy, mut span, mut mem) = (0.0, 0.0, Default::default());
            step.train_device(
                c,
                &Training {
                    steps,
                    batch_of: &|_| batch.clone(),
                    adam: adam(),
                    lr: &lr,
                    clip: 1.0,
                    stop: &|| false,
                },
                &mut |_, _, _, r| {
                    busy += r.busy_s;
                    span += r.span_s;
                    mem = r.memory.peak_terms();
                    Ok(())
                },
            )?;
            Ok::<_, ferrotron_engine::EngineError>((busy, span, mem))
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect()
}

#[test]
fn the_stashed_versions_take_the_memory_the_planner_predicts() {
    // Four stages of two layers, 4 micro-batches a step: PipeDream stashes up to p − s − 1
    // versions on stage s, 2BW one (none on the last stage) and holds two gradient stores.
    // (Idle time is measured by `bench pipeline`, side by side with 1F1B: a timed quantity.)
    let p = 4;
    let cfg = ModelConfig::llama(64, 128, 352, 2 * p, 4, 4, 64, 10000.0);
    let params = ParamStore::init_random(&cfg, 3);
    let batch = random_batch(64, 4, 32, 9);
    // bf16: the versions are 16-bit compute copies (a stashed one is copied when the next update
    // writes), the updates' stores 16-bit, beside the f32 main gradients of the update applied.
    for (precision, storage) in [
        (
            "weights=fp32,grads=fp32,master=fp32,optimizer=fp32",
            MixedPrecision::F32,
        ),
        (
            "weights=bf16,grads=bf16,master=fp32,optimizer=fp32",
            MixedPrecision::Bf16,
        ),
    ] {
        let input = ferrotron_core::plan::PlanInput {
            memory_reserve: 0.0,
            precision: ferrotron_core::plan::StateDtypes::parse(precision).unwrap(),
            ..f32_plan_input(&cfg, 32, 4)
        };
        for schedule in ["1f1b", "2bw", "pipedream"] {
            let layout = LayoutSpec::parse(&format!("pp={p},schedule={schedule}"))
                .unwrap()
                .layout;
            let run = measured(&cfg, &params, &layout, &batch, 4, storage);
            let plan = ferrotron_core::plan::evaluate(&input, &layout).unwrap();
            for (s, got) in run.iter().map(|r| r.2).enumerate() {
                let what = format!("{precision} {schedule} stage {s}");
                assert_versions_near(&what, &got, &plan.memory_bytes_per_stage[s]);
            }
        }
    }
}

/// Under expert parallelism each stage stashes versions of its dense tensors and of its share of
/// the experts (÷ ep), as the planner prices them (the Mixtral fixture, ZeRO-1 over dp for the
/// dense state and over dp/ep for the experts'; 1F1B, which stashes none, beside them).
#[test]
fn the_stashed_versions_of_split_experts_take_the_memory_the_planner_predicts() {
    let (cfg, params) = hf::load_model(&fixture("variants/mixtral")).unwrap();
    let batch = random_batch(cfg.vocab_size, 16, 16, 9);
    let input = f32_plan_input(&cfg, 16, 16);
    for schedule in ["1f1b", "2bw", "pipedream"] {
        let spec = format!("pp=2,dp=4,ep=2,zero=1,schedule={schedule}");
        let layout = LayoutSpec::parse(&spec).unwrap().layout;
        let run = measured(&cfg, &params, &layout, &batch, 4, MixedPrecision::F32);
        let plan = ferrotron_core::plan::evaluate(&input, &layout).unwrap();
        for (rank, got) in run.iter().map(|r| r.2).enumerate() {
            let s = layout.rank_grid(layout.world_size()).coords(rank).pp;
            let what = format!("{spec} device {rank} (stage {s})");
            assert_versions_near(&what, &got, &plan.memory_bytes_per_stage[s]);
        }
    }
}

/// The terms weight versions and update stores live in (weights, gradients), measured within 1%
/// of the planner's.
fn assert_versions_near(
    what: &str,
    got: &ferrotron_core::plan::MemoryTerms,
    want: &ferrotron_core::plan::MemoryTerms,
) {
    for (term, a, b) in [
        ("weights", got.weights, want.weights),
        ("gradients", got.gradients, want.gradients),
    ] {
        let e = (a as f64 / b as f64 - 1.0).abs();
        println!("{what}: {term} {a} vs {b} ({e:.3})");
        assert!(e <= 0.01, "{what}: {term} measured {a}, predicted {b}");
    }
}

#[test]
fn two_bw_is_the_published_update_rule() {
    // W(t+1) = W(t) − ν·Adam(∇f(W(t−1))), W(−1) = W(0): written out here from the paper, not read
    // from the schedule, against the 4-stage pipeline.
    use ferrotron_engine::kernels::CpuBackend;
    use ferrotron_engine::optim::AdamW;
    use ferrotron_engine::transformer::Transformer;
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let layout = LayoutSpec::parse("pp=4,schedule=2bw").unwrap().layout;
    let batches: Vec<TokenBatch> = (0..STEPS)
        .map(|k| random_batch(cfg.vocab_size, 4, 16, 70 + k as u64))
        .collect();
    let got = pipeline(
        &cfg,
        &params,
        &layout,
        &batches,
        0.0,
        &|_| false,
        MixedPrecision::F32,
    );
    let (be, lr) = (CpuBackend::default(), lr());
    let mut opt = AdamW::new(adam(), &params);
    let (mut previous, mut w) = (params.clone(), params.clone());
    for (t, batch) in batches.iter().enumerate() {
        let mut g = params.zeros_like();
        let n = batch.predicted_tokens() as f32;
        // Micro-batches of one sequence, summed in order, as the pipeline accumulates them.
        let tf = Transformer::new(&cfg, &previous);
        for i in 0..batch.batch {
            let micro = TokenBatch {
                ids: batch.ids[i * batch.seq..(i + 1) * batch.seq].to_vec(),
                batch: 1,
                seq: batch.seq,
            };
            let state = tf.forward(&be, &previous, &micro);
            tf.backward(&be, &previous, &mut g, state, &micro.targets(), 1.0 / n);
        }
        let next_previous = w.clone();
        opt.step_serial(&mut w, &g, lr.lr(t) as f32);
        if t >= 1 {
            previous = next_previous; // from the second step on, the gradient is one update old
        }
    }
    for (s, (a, b)) in w.specs.iter().zip(got.tensors.iter().zip(&w.tensors)) {
        let e = rel_err(a, b);
        assert!(e <= TOL, "{}: {e:.2e}", s.name);
    }
}

/// bf16's unit roundoff: 8 significant bits, rounding to nearest.
const U: f64 = 1.0 / 256.0;

/// The asynchronous schedules in bf16 against the delayed-update reference computing each version
/// in bf16 (its compute copy, bf16 products and stash; f32 sums, master and Adam).
///
/// The tolerance. With Adam's `eps` (1) far above `√v̂` (the gradients' elements are ~1e-3), AdamW's
/// step `lr·m̂/(√v̂ + eps)` is `(lr/eps)·m̂` to within 0.1%: linear in the gradients, without Adam's
/// sign-like amplification of an element whose gradient is near zero. The change of the weights
/// over the run, `Δw`, is then a positive combination of the updates' gradients, which point the
/// same way over six steps, so its norm-wise relative error is that of the gradients: `√D·u`, `D`
/// counting the roundings on a gradient's path that can fall differently in the two runs (see
/// `tests/bf16.rs`): per block 6 (and 4 more under tensor parallelism), 2 per pipeline boundary,
/// one per micro-batch summed into the bf16 store, `dp − 1` in the ring, one for the version's
/// compute copy (rounded from masters that differ by the error itself). Clipping scales each
/// gradient by `clip/‖g‖`, whose own relative error is at most that of `g`: twice the bound.
/// The synchronous schedule (no delays) is farther off than five times that.
///
/// A mixture of experts adds per block the experts' outputs (kept in 16 bits for the routing
/// weights' gradient) and, under expert parallelism, its two all-to-alls each way (as
/// `tests/mixture_of_experts.rs` counts them).
fn bf16_async_tolerance(cfg: &ModelConfig, l: &Layout, micro_batches: usize) -> f64 {
    let experts = if cfg.moe.is_some() {
        1 + if l.ep > 1 { 2 * 2 } else { 0 }
    } else {
        0
    };
    let layers = cfg.num_layers;
    let per_block = 6 + if l.tp > 1 { 4 } else { 0 } + experts;
    let stages = layers * per_block + 2 * (l.pp - 1) + micro_batches + (l.dp - 1) + 1;
    2.0 * (stages as f64).sqrt() * U
}

/// `n` whole sequences of `batch`, starting at its `k`-th and wrapping around.
fn rotated(batch: &TokenBatch, k: usize, n: usize) -> TokenBatch {
    let seq = batch.seq;
    let ids = (0..n)
        .flat_map(|j| {
            let b = (k + j) % batch.batch;
            batch.ids[b * seq..(b + 1) * seq].iter().copied()
        })
        .collect();
    TokenBatch { ids, batch: n, seq }
}

#[test]
fn asynchronous_pipelines_in_bf16_train_as_the_bf16_delayed_reference() {
    let adam = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1.0,
        weight_decay: 0.0,
    };
    let lr = LrSchedule {
        peak_lr: 0.3,
        min_lr: 0.3,
        warmup_steps: 0,
        total_steps: STEPS,
    };
    // Clipping engaged (the gradients' norms are above it) keeps every update's size in bounds:
    // unclipped, lr 0.3 makes a 4-stage PipeDream's stale updates diverge.
    let (clip, never) = (0.5, |_: usize| false);
    let dense = [
        "pp=2,schedule=2bw",
        "pp=4,schedule=2bw",
        "pp=2,schedule=pipedream",
        "pp=4,schedule=pipedream",
        "pp=2,tp=2,schedule=2bw",
        "pp=2,tp=2,schedule=pipedream",
        "pp=2,dp=2,schedule=2bw",
        "pp=2,dp=2,zero=1,schedule=pipedream",
        "pp=2,tp=2,dp=2,zero=1,schedule=2bw",
    ];
    // The Mixtral whose routing decisions are clear of bf16's rounding, its experts whole and
    // split (two states, each keeping its versions).
    let experts = [
        "pp=2,schedule=2bw",
        "pp=2,dp=2,ep=2,zero=1,schedule=2bw",
        "pp=2,dp=2,ep=2,schedule=pipedream",
    ];
    for (model, specs) in [
        ("llama_tiny", &dense[..]),
        ("gpt2_tiny", &dense[..]),
        ("variants/mixtral_bf16", &experts[..]),
    ] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        // A mixture of experts trains on its reference's sequences, whose every routing decision
        // is clear of bf16's rounding at the start (random ones route tokens on a margin that a
        // rounding flips, and a flipped token moves every gradient past any rounding bound). Not
        // forever: on an AVX512_BF16 CPU (its f32 sums in another order than the f32 GEMM's) a
        // token's experts flip at the fourth step of `pp=2,dp=2,ep=2` under PipeDream (the second
        // router's weight from 1.3e-2 of its change to 2.8e-2, then 5.6e-2). Three steps compare
        // it while every route agrees, the delays visible by then (the synchronous schedule ~10
        // bounds away). A check that both runs route alike would let it run longer.
        let clear = cfg.moe.is_some().then(|| Reference::load(model));
        let steps = if clear.is_some() { MOE_STEPS } else { STEPS };
        for &spec in specs {
            let layout = LayoutSpec::parse(spec).unwrap().layout;
            let m = 4;
            let batches: Vec<TokenBatch> = (0..steps)
                .map(|k| match &clear {
                    Some(r) => rotated(&r.batch, k, layout.dp * m),
                    None => random_batch(cfg.vocab_size, layout.dp * m, 16, 40 + k as u64),
                })
                .collect();
            let run = |l: &Layout| {
                let bf16 = MixedPrecision::Bf16;
                train_steps(&cfg, &params, l, &batches, adam, &lr, clip, &never, bf16).unwrap()
            };
            let got = run(&layout);
            let reference = DelayedReference {
                cfg: &cfg,
                layout: &layout,
                adam,
                lr: &lr,
                clip,
                precision: MixedPrecision::Bf16,
            };
            let want = reference
                .train(&params, steps, &|k| batches[k].clone(), &never)
                .unwrap();
            let sync = Layout {
                schedule: ferrotron_core::layout::Schedule::OneFOneB,
                ..layout
            };
            let undelayed = run(&sync);
            let change = |a: &ParamStore, i: usize| -> Vec<f32> {
                let start = &params.tensors[i];
                a.tensors[i].iter().zip(start).map(|(x, y)| x - y).collect()
            };
            let tol = bf16_async_tolerance(&cfg, &layout, m);
            let (mut worst, mut apart) = ((String::new(), 0f64), 0f64);
            for (i, spec) in params.specs.iter().enumerate() {
                let want_change = change(&want, i);
                let e = rel_err(&change(&got, i), &want_change);
                if e > worst.1 {
                    worst = (spec.name.clone(), e);
                }
                apart = apart.max(rel_err(&change(&undelayed, i), &want_change));
            }
            println!(
                "{model} {spec}: worst {} {:.2e} (tolerance {tol:.2e}); \
                 the synchronous schedule {apart:.2e}",
                worst.0, worst.1
            );
            assert!(
                worst.1 <= tol,
                "{model} {spec}: {} changed {:.2e} from the reference's change, over {tol:.2e}",
                worst.0,
                worst.1
            );
            assert!(
                apart > 5.0 * tol,
                "{model} {spec}: the delays are not visible ({apart:.2e})"
            );
        }
    }
}

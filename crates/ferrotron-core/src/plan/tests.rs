//! The planner against published arithmetic and its own invariants.

use super::*;
use crate::layout::{Layout, Recompute, Schedule};

/// Narayanan et al. 2021, Table 1: (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s).
type Row = (f64, usize, usize, usize, usize, usize, usize, usize, f64);

const TABLE1: [Row; 10] = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
];

fn table_input(row: &Row) -> PlanInput {
    let &(_, heads, hidden, layers, _, _, gpus, batch, _) = row;
    let model = PlanModel::parse(&format!(
        "arch=gpt,layers={layers},hidden={hidden},heads={heads},vocab=51200"
    ))
    .unwrap();
    let cluster = Cluster::parse(&format!("dgx-a100-80g,nodes={}", gpus / 8)).unwrap();
    PlanInput {
        activation_model: ActivationModel::Megatron,
        attention: AttentionKernel::Materialized,
        memory_reserve: 0.0,
        ..PlanInput::new(model, cluster, 2048, batch)
    }
}

/// The best predicted TFLOP/s for a Table 1 row's (tp, pp, dp), over micro-batch sizes and chunk counts,
/// with full recompute and the interleaved schedule as the paper ran them.
fn table_prediction(row: &Row) -> Plan {
    let &(_, _, _, layers, tp, pp, gpus, _, _) = row;
    let input = table_input(row);
    let mut best: Option<Plan> = None;
    for mbs in [1, 2, 4, 8] {
        for vpp in (1..=8).filter(|v| (layers / pp) % v == 0) {
            let schedule = if vpp > 1 {
                Schedule::Interleaved
            } else {
                Schedule::OneFOneB
            };
            if pp == 1 && vpp > 1 {
                continue;
            }
            let l = Layout {
                stages: None,
                dp: gpus / (tp * pp),
                tp,
                pp,
                vpp,
                zero: 0,
                micro_batch_size: mbs,
                schedule,
                sequence_parallel: false,
                recompute: Recompute::Full,
                ..Layout::default()
            };
            let Ok(p) = evaluate(&input, &l) else {
                continue;
            };
            if p.fits && best.as_ref().is_none_or(|b| p.step_time_s < b.step_time_s) {
                best = Some(p);
            }
        }
    }
    best.expect("some configuration fits")
}

#[test]
fn narayanan_table1_parameter_counts_and_throughput() {
    for row in &TABLE1 {
        let PlanModel::Shape(cfg) = table_input(row).model else {
            unreachable!()
        };
        let billions = cfg.num_params() as f64 / 1e9;
        assert!(
            (billions - row.0).abs() < 0.051,
            "{}B row: counted {billions:.2}B",
            row.0
        );
        let p = table_prediction(row);
        let err = p.tflops_per_device / row.8 - 1.0;
        println!(
            "{:>7.1}B: predicted {:6.1} vs published {:5.1} TFLOP/s ({:+.1}%) with {}",
            row.0,
            p.tflops_per_device,
            row.8,
            err * 100.0,
            p.layout
        );
        assert!(
            err.abs() <= 0.10,
            "{}B: predicted {:.1} TFLOP/s vs {}",
            row.0,
            p.tflops_per_device,
            row.8
        );
    }
}

fn params_only(n: f64, devices: usize) -> PlanInput {
    let cluster = Cluster::parse(&format!(
        "nodes={},devices_per_node=8,memory_gib=80,peak_tflops=312,intra_gbs=300,inter_gbs=25",
        devices / 8
    ))
    .unwrap();
    PlanInput {
        memory_reserve: 0.0,
        ..PlanInput::new(PlanModel::ParamsOnly(n), cluster, 2048, devices)
    }
}

#[test]
fn zero_paper_model_state_arithmetic() {
    // 2-byte weights and gradients, K = 12 (fp32 master + two fp32 moments), 7.5B on 64 devices.
    let input = params_only(7.5e9, 64);
    for (zero, want_gb) in [(0u8, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)] {
        let l = Layout {
            dp: 64,
            zero,
            ..Layout::default()
        };
        let m = evaluate(&input, &l).unwrap().memory_bytes;
        let states = (m.weights + m.gradients + m.master_weights + m.optimizer_states) as f64 / 1e9;
        assert!(
            (states - want_gb).abs() < 1e-6,
            "ZeRO-{zero}: {states} GB, want {want_gb}"
        );
    }
    // Megatron's 2 + 4 + 12 with fp32 gradients is expressible too.
    let mut meg = params_only(1e9, 8);
    meg.precision = StateDtypes::parse("grads=fp32").unwrap();
    let m = evaluate(
        &meg,
        &Layout {
            dp: 8,
            ..Layout::default()
        },
    )
    .unwrap()
    .memory_bytes;
    assert_eq!(
        m.weights + m.gradients + m.master_weights + m.optimizer_states,
        18_000_000_000
    );
}

fn small_input(model: &str) -> PlanInput {
    PlanInput::new(
        PlanModel::parse(model).unwrap(),
        Cluster::parse("dgx-a100-80g,nodes=2").unwrap(),
        2048,
        64,
    )
}

#[test]
fn bad_input_names_the_field() {
    let input = small_input("llama2-7b");
    let err = |l: Layout| evaluate(&input, &l).unwrap_err().to_string();
    let e = err(Layout {
        dp: 1,
        tp: 3,
        ..Layout::default()
    });
    assert!(
        e.contains("tp") && (e.contains("heads") || e.contains("divide")),
        "{e}"
    );
    let e = err(Layout {
        dp: 32,
        ..Layout::default()
    });
    assert!(e.contains("dp") && e.contains("16"), "{e}");
    let e = err(Layout {
        dp: 1,
        tp: 16,
        ..Layout::default()
    });
    assert!(e.contains("tp=16") && e.contains("nodes"), "{e}");
    let e = err(Layout {
        dp: 1,
        pp: 3,
        stages: Some(crate::layout::NamedStages::parse("10+10+10").unwrap()),
        ..Layout::default()
    });
    assert!(e.contains("stages") && e.contains("30 layers"), "{e}");
    let e = PlanModel::parse("llama-9000").unwrap_err().to_string();
    assert!(e.contains("llama-9000") && e.contains("preset"), "{e}");
    let e = PlanModel::parse("arch=gpt,layers=4,hidden=-64,heads=4,vocab=100")
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden"), "{e}");
    let e = PlanModel::parse("arch=gpt,layers=4,hidden=64,heads=5,vocab=100")
        .unwrap_err()
        .to_string();
    assert!(e.contains("n_head") || e.contains("heads"), "{e}");
    let e = StateDtypes::parse("weights=int3").unwrap_err().to_string();
    assert!(e.contains("weights") && e.contains("int3"), "{e}");
    // The asynchronous schedules train in f32 or bf16, not under fp16's skipped steps.
    let two_bw = Layout {
        dp: 1,
        pp: 2,
        schedule: crate::layout::Schedule::TwoBw,
        ..Layout::default()
    };
    assert!(evaluate(&input, &two_bw).is_ok());
    let fp16 = PlanInput {
        precision: StateDtypes::parse("weights=fp16,grads=fp16,master=fp32,optimizer=fp32")
            .unwrap(),
        ..small_input("llama2-7b")
    };
    let e = evaluate(&fp16, &two_bw).unwrap_err().to_string();
    assert!(e.contains("fp16") && e.contains("bf16"), "{e}");
}

#[test]
fn a_plan_that_does_not_fit_says_so_with_the_breakdown() {
    let mut input = small_input("llama3-70b");
    input.cluster = Cluster::parse("dgx-a100-80g").unwrap();
    let p = evaluate(
        &input,
        &Layout {
            dp: 8,
            ..Layout::default()
        },
    )
    .unwrap();
    assert!(!p.fits);
    assert!(p.explain.iter().any(|l| l.contains("DOES NOT FIT")));
    assert!(p
        .explain
        .iter()
        .any(|l| l.contains("breakdown") && l.contains("optimizer_states")));
}

#[test]
fn search_finds_fitting_layouts_fast_for_a_trillion_parameters() {
    let row = &TABLE1[9];
    let input = table_input(row);
    let t0 = std::time::Instant::now();
    let plans = search(&input).unwrap();
    let elapsed = t0.elapsed();
    assert!(!plans.is_empty());
    assert!(plans
        .iter()
        .all(|p| p.fits && p.memory_bytes.total <= input.usable_memory()));
    assert!(plans
        .windows(2)
        .all(|w| w[0].step_time_s <= w[1].step_time_s));
    println!(
        "1T on 3072 GPUs: {} candidates in {elapsed:?}; best {}",
        plans.len(),
        plans[0].layout
    );
    // Release builds (the test profile is optimised) answer well under a second.
    assert!(elapsed.as_secs_f64() < if cfg!(debug_assertions) { 30.0 } else { 1.0 });
}

/// A tiny deterministic generator, so the property test needs no dependency.
struct Lcg(u64);
impl Lcg {
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        xs[(self.0 >> 33) as usize % xs.len()]
    }
}

#[test]
fn memory_is_monotone_in_zero_and_tp_and_search_only_returns_fits() {
    let mut rng = Lcg(42);
    for case in 0..60 {
        let heads = rng.pick(&[8usize, 16, 32]);
        let head_dim = rng.pick(&[64usize, 128]);
        let layers = rng.pick(&[8usize, 16, 24]);
        let arch = rng.pick(&["gpt", "llama"]);
        let kv = if arch == "llama" {
            rng.pick(&[heads, heads / 4])
        } else {
            heads
        };
        let spec = format!(
            "arch={arch},layers={layers},hidden={},heads={heads},kv_heads={kv},vocab={},ffn={}",
            heads * head_dim,
            rng.pick(&[32000usize, 50257]),
            4 * heads * head_dim
        );
        let mut input = small_input(&spec);
        input.cluster = Cluster::parse(&format!(
            "nodes={},devices_per_node=8,memory_gib={},peak_tflops=300,intra_gbs=300,inter_gbs=25",
            rng.pick(&[1usize, 2]),
            rng.pick(&[16usize, 40, 80])
        ))
        .unwrap();
        input.global_batch = 32;
        input.seq = rng.pick(&[512usize, 2048]);
        let world = input.cluster.world_size();
        // Monotone in the ZeRO stage, for every term and the total.
        let mut last: Option<MemoryTerms> = None;
        for zero in 0..=3u8 {
            let m = evaluate(
                &input,
                &Layout {
                    dp: world,
                    zero,
                    ..Layout::default()
                },
            )
            .unwrap()
            .memory_bytes;
            if let Some(prev) = last {
                for ((name, a), (_, b)) in m.terms().iter().zip(prev.terms().iter()) {
                    assert!(
                        a <= b || *name == "comm_buffers",
                        "case {case}: {name} grew with ZeRO-{zero}"
                    );
                }
                assert!(
                    m.weights + m.gradients + m.master_weights + m.optimizer_states
                        <= prev.weights
                            + prev.gradients
                            + prev.master_weights
                            + prev.optimizer_states
                );
            }
            last = Some(m);
        }
        // Monotone in tp for the sharded terms.
        let mut last: Option<MemoryTerms> = None;
        for tp in [1usize, 2, 4, 8] {
            let l = Layout {
                dp: world / tp,
                tp,
                ..Layout::default()
            };
            let Ok(p) = evaluate(&input, &l) else {
                continue;
            };
            let m = p.memory_bytes;
            if let Some(prev) = last {
                for (a, b) in [
                    (m.weights, prev.weights),
                    (m.gradients, prev.gradients),
                    (m.optimizer_states, prev.optimizer_states),
                ] {
                    assert!(
                        a <= b,
                        "case {case}: tp={tp} grew a sharded term ({a} > {b})"
                    );
                }
            }
            last = Some(m);
        }
        if let Ok(plans) = search(&input) {
            assert!(
                plans
                    .iter()
                    .all(|p| p.fits && p.memory_bytes.total <= input.usable_memory()),
                "case {case}"
            );
        }
    }
}

#[test]
fn megatron_activations_follow_the_published_multipliers() {
    let input = PlanInput {
        activation_model: ActivationModel::Megatron,
        ..small_input("arch=gpt,layers=16,hidden=1024,heads=16,vocab=51200")
    };
    let (s, b, h, a) = (2048.0, 1.0, 1024.0, 16.0);
    let cfg = match &input.model {
        PlanModel::Shape(c) => c.clone(),
        _ => unreachable!(),
    };
    let per_layer_of = |l: &Layout, attention| {
        layer_activation_bytes(&cfg, l, 2048, (ActivationModel::Megatron, attention), 2.0)
    };
    let per_layer = |l: &Layout| per_layer_of(l, AttentionKernel::Materialized);
    let base = Layout::default();
    assert_eq!(per_layer(&base), s * b * h * (34.0 + 5.0 * a * s / h));
    let tp = Layout { tp: 4, ..base };
    assert_eq!(
        per_layer(&tp),
        s * b * h * (10.0 + 24.0 / 4.0 + 5.0 * a * s / (h * 4.0))
    );
    assert_eq!(
        per_layer(&Layout {
            sequence_parallel: true,
            ..tp
        }),
        s * b * h * (34.0 / 4.0 + 5.0 * a * s / (h * 4.0))
    );
    assert_eq!(
        per_layer(&Layout {
            recompute: Recompute::Selective,
            ..tp
        }),
        s * b * h * (10.0 + 24.0 / 4.0)
    );
    assert_eq!(
        per_layer(&Layout {
            recompute: Recompute::Full,
            ..tp
        }),
        2.0 * s * b * h
    );
    // The first stage of 1F1B holds p micro-batches of its layers; interleaving multiplies by 1 + (p−1)/(p·v).
    let (p, v, m) = (4usize, 2usize, 8usize);
    let ofob = Layout {
        pp: p,
        dp: 4,
        ..base
    };
    assert_eq!(in_flight(&ofob, m, 0), p);
    let inter = Layout {
        vpp: v,
        schedule: Schedule::Interleaved,
        ..ofob
    };
    let stage_equivalents = in_flight(&inter, m, 0) as f64 / v as f64;
    assert!((stage_equivalents - p as f64 * (1.0 + (p - 1) as f64 / (p * v) as f64)).abs() < 1e-12);
    // ...and the simulator measures the same peaks the closed form gives.
    let sim = evaluate(
        &PlanInput {
            global_batch: 32,
            ..input.clone()
        },
        &inter,
    )
    .unwrap();
    let closed = stage_memory(
        &PlanInput {
            global_batch: 32,
            ..input
        },
        &inter,
        0,
        in_flight(&inter, 8, 0),
    );
    assert_eq!(
        sim.memory_bytes_per_stage[0].activations,
        closed.activations
    );
}

#[test]
fn with_no_layout_to_run_the_search_says_what_each_cut_breaks() {
    // 3 devices, 2 layers, 4 heads, a batch of 8: no cut of 3 works (uneven stages are fine, but
    // three stages need three layers).
    let mut input = small_input("arch=llama,layers=2,hidden=64,heads=4,vocab=256");
    input.cluster = Cluster::parse("dgx-a100-80g,devices_per_node=3").unwrap();
    input.global_batch = 8;
    let e = search(&input).unwrap_err().to_string();
    assert!(e.contains("no layout of 3 devices"), "{e}");
    for (cut, why) in [
        ("dp=3,tp=1,pp=1", "does not divide among dp=3 replicas"),
        (
            "dp=1,tp=3,pp=1",
            "4 attention heads do not divide over 3 devices",
        ),
        (
            "dp=1,tp=1,pp=3",
            "pp=3 stages cannot each hold one of the model's 2 layers",
        ),
    ] {
        assert!(
            e.lines().any(|l| l.contains(cut) && l.contains(why)),
            "{cut}: {why}\n{e}"
        );
    }
    // Cuts that keep the rules but do not fit say how much the plainest of them needs.
    let mut big = small_input("arch=llama,layers=4,hidden=64,heads=4,vocab=256");
    big.cluster = Cluster::parse("dgx-a100-80g,devices_per_node=2,memory_gib=0.0001").unwrap();
    let why = why_no_layout(&big);
    assert!(
        why.iter()
            .any(|l| l.contains("dp=2,tp=1,pp=1") && l.contains("keeps the rules; needs")),
        "{why:?}"
    );
    // However many devices, the explanation stays a dozen lines: the rest of the cuts are counted.
    let mut wide = small_input("arch=llama,layers=4,hidden=64,heads=4,vocab=256");
    wide.cluster = Cluster::parse("dgx-a100-80g,nodes=2,devices_per_node=1000").unwrap();
    wide.global_batch = 16;
    let why = why_no_layout(&wide);
    assert_eq!(why.len(), 13, "{why:?}");
    assert!(why[12].contains("more ways to cut 2000 devices"), "{why:?}");
}

#[test]
fn bloom_176b_plans_on_uneven_stages() {
    // BLOOM-176B as trained: 70 layers on 12 stages of 384 A100s, 2048 sequences of 2048 tokens.
    let input = PlanInput::new(
        PlanModel::parse("bloom-176b").unwrap(),
        Cluster::parse("dgx-a100-80g,nodes=48").unwrap(),
        2048,
        2048,
    );
    let l = crate::layout::LayoutSpec::parse("dp=8,tp=4,pp=12,mbs=2,zero=1,recompute=full")
        .unwrap()
        .layout;
    let p = evaluate(&input, &l).unwrap();
    assert_eq!(p.layers_per_stage.iter().sum::<usize>(), 70);
    assert_eq!(p.layers_per_stage.len(), 12);
    let (lo, hi) = (
        *p.layers_per_stage.iter().min().unwrap(),
        *p.layers_per_stage.iter().max().unwrap(),
    );
    assert!(
        hi > lo,
        "70 layers on 12 stages are uneven: {:?}",
        p.layers_per_stage
    );
    // The last stage also runs the 250k-token output layer: it gets fewer layers.
    assert_eq!(p.layers_per_stage[11], lo, "{:?}", p.layers_per_stage);
    assert!(p.fits, "{:?}", p.memory_bytes);
    assert_eq!(p.compute_time_per_stage_s.len(), 12);
    assert_eq!(p.bubble_fraction_per_stage.len(), 12);
    // Memory per stage follows its layers: a stage with more layers holds more weights.
    let more = p.layers_per_stage.iter().position(|&n| n == hi).unwrap();
    assert!(p.memory_bytes_per_stage[more].weights > p.memory_bytes_per_stage[11].weights / 2);
    // A named split is priced as named, and one that does not cover the layers is refused.
    let mut named = l;
    named.stages = Some(crate::layout::NamedStages::parse("6+6+6+6+6+6+6+6+6+6+5+5").unwrap());
    let q = evaluate(&input, &named).unwrap();
    assert_eq!(q.layers_per_stage, vec![6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5]);
    named.stages = Some(crate::layout::NamedStages::parse("6+6").unwrap());
    let e = evaluate(&input, &named).unwrap_err().to_string();
    assert!(e.contains("stages") && e.contains("pp·vpp = 12"), "{e}");
    // The search considers uneven splits too.
    let plans = search(&input).unwrap();
    assert!(!plans.is_empty());
}

#[test]
fn calibration_recovers_constants_that_made_the_runs() {
    use super::calibrate::{fit, FitParam, Measured, MeasuredRun};
    // Runs "measured" on a cluster with known constants, fitted from a wrong start.
    let mut truth = Cluster::parse("dgx-a100-80g").unwrap();
    truth.calibration.gemm_efficiency_max = 0.55;
    truth.calibration.gemm_half_width = 300.0;
    let runs: Vec<MeasuredRun> = TABLE1[..6]
        .iter()
        .map(|row| {
            let p = table_prediction(row);
            let mut r = MeasuredRun {
                name: format!("{}B", row.0),
                model: table_input(row).model,
                layout: p.layout,
                seq: 2048,
                global_batch: row.7,
                nodes: row.6 / 8,
                precision: StateDtypes::default(),
                attention: AttentionKernel::Materialized,
                measured: Measured::StepTime(1.0),
            };
            r.measured = Measured::StepTime(r.predict(&truth).unwrap());
            r
        })
        .collect();
    let start = Cluster::parse("dgx-a100-80g").unwrap();
    let params = [FitParam::GemmEfficiency, FitParam::GemmHalfWidth];
    let fitted = fit(&runs, &start, &params).unwrap();
    for r in &runs {
        let e = r.error(&fitted).unwrap();
        assert!(e.abs() < 0.005, "{}: {e}", r.name);
    }
    assert!((fitted.calibration.gemm_efficiency_max / 0.55 - 1.0).abs() < 0.05);
}

/// ZeRO-3's gathers and reduce-scatters happen inside each unit's forward and backward (one unit
/// ahead), so they are priced inside the actions, not after the step; their transfer is reported as
/// the actions' communication, and it grows as the link slows.
#[test]
fn zero3_collectives_are_priced_inside_the_actions() {
    let plan_on = |link: &str, layout: &str| {
        let input = PlanInput::new(
            PlanModel::Shape(crate::model::preset("llama-small").unwrap()),
            Cluster::parse(&format!(
                "nodes=1,devices_per_node=2,memory_gib=24,peak_tflops=1,inter_gbs=1,{link}"
            ))
            .unwrap(),
            128,
            8,
        );
        let l = crate::layout::LayoutSpec::parse(layout).unwrap().layout;
        evaluate(&input, &l).unwrap()
    };
    let fast = plan_on("intra_gbs=10", "dp=2,zero=3,mbs=2");
    let slow = plan_on("intra_gbs=1", "dp=2,zero=3,mbs=2");
    let zero1 = plan_on("intra_gbs=1", "dp=2,zero=1,mbs=2");
    assert_eq!(slow.dp_comm_time_s, 0.0);
    assert!(zero1.dp_comm_time_s > 0.0 && zero1.action_comm_time_s == (0.0, 0.0));
    let (f, b) = slow.action_comm_time_s;
    // Backward gathers again and reduce-scatters: twice the forward's bytes.
    assert!((b / f - 2.0).abs() < 0.01, "{f} {b}");
    assert!(f > 5.0 * fast.action_comm_time_s.0);
    // On one stage, the exposed transfer adds to the step one for one.
    let added = (f + b) - (fast.action_comm_time_s.0 + fast.action_comm_time_s.1);
    let grew = slow.step_time_s - fast.step_time_s;
    assert!((grew / added - 1.0).abs() < 1e-6, "{grew} {added}");
}

/// The time model prices every tensor-parallel byte the traffic model counts — the layers'
/// all-reduces and the embedding's, the output layer's and the loss's collectives — so on a link
/// with no latency the actions' communication time is exactly those bytes over the bandwidth.
#[test]
fn every_tensor_parallel_byte_is_priced_in_time() {
    for (layout, sp) in [
        ("tp=2,mbs=2", false),
        ("tp=4,mbs=1", false),
        ("tp=2,sp=true,mbs=2", true),
    ] {
        let input = PlanInput::new(
            PlanModel::Shape(crate::model::preset("llama-small").unwrap()),
            Cluster::parse(
                "nodes=1,devices_per_node=4,memory_gib=24,peak_tflops=1,intra_gbs=1,inter_gbs=1,intra_latency_us=0,link_efficiency=1",
            )
            .unwrap(),
            128,
            8,
        );
        let l = crate::layout::LayoutSpec::parse(layout).unwrap().layout;
        let plan = evaluate(&input, &l).unwrap();
        let (f, b) = plan.action_comm_time_s;
        let priced = (f + b) * 1e9;
        let counted = plan.comm_bytes_per_step.tp;
        // Under sequence parallelism the norms' partial gradients are summed after the step, not
        // inside an action.
        let after = if sp { counted - priced } else { 0.0 };
        assert!(
            after >= 0.0 && after < 0.01 * counted,
            "{layout}: {priced} of {counted}"
        );
        assert!(
            ((priced + after) / counted - 1.0).abs() < 1e-9,
            "{layout}: {priced} of {counted}"
        );
    }
}

/// The example: Llama 3 8B at 131072 tokens on two 8-GPU H100 nodes, 16 sequences a step:
/// without splitting the sequences nothing fits without recompute; the search finds a layout with
/// cp > 1 that fits and says that the split is what makes it fit.
#[test]
fn long_sequences_are_split_when_that_is_what_fits() {
    let input = PlanInput::new(
        PlanModel::parse("llama3-8b").unwrap(),
        Cluster::parse("dgx-h100-80g,nodes=2").unwrap(),
        131072,
        16,
    );
    let plans = search(&input).unwrap();
    let best = &plans[0];
    assert!(best.layout.cp > 1 && best.fits, "{}", best.layout);
    let notes = search_notes(&input, Some(best));
    assert!(
        notes
            .iter()
            .any(|n| n.contains("split the sequences") && n.contains("makes this run fit")),
        "{notes:?}"
    );
    assert!(best
        .explain
        .iter()
        .any(|l| l.contains("context parallel cp=")));
    // Each device's activations are the unsplit layout's over cp (plus the blocks in flight).
    let l = best.layout;
    let without = Layout {
        cp: 1,
        dp: l.dp * l.cp,
        ..l
    };
    let (a, b) = (
        stage_memory(&input, &l, 0, 1).activations as f64,
        stage_memory(&input, &without, 0, 1).activations as f64,
    );
    assert!(
        a < b / l.cp as f64 * 1.1 && a > b / l.cp as f64 * 0.9,
        "{a} vs {b} / {}",
        l.cp
    );
}

#[test]
fn context_parallel_rules_are_named() {
    let input = PlanInput::new(
        PlanModel::parse("llama3-8b").unwrap(),
        Cluster::parse("dgx-h100-80g,nodes=2").unwrap(),
        4098,
        16,
    );
    let l = |spec: &str| crate::layout::LayoutSpec::parse(spec).unwrap().layout;
    let e = check_layout(&input, &l("dp=8,cp=2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cp=2") && e.contains("4098 tokens"), "{e}");
    let input = PlanInput { seq: 4096, ..input };
    // cp=16 over two nodes of 8: all-to-all would cross nodes.
    let e = check_layout(&input, &l("cp=16,cp_comm=a2a"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cp_comm=a2a") && e.contains("intra-node"), "{e}");
    assert!(check_layout(&input, &l("cp=16")).is_ok());
    // 32 query heads and 8 KV heads over tp=2: 16 and 4 per device, which a2a over 4 devices
    // of a node splits.
    assert!(check_layout(&input, &l("dp=2,tp=2,cp=4,cp_comm=a2a")).is_ok());
}

#[test]
fn candidates_within_the_measured_error_of_the_best_are_marked_not_ranked() {
    let mut input = PlanInput::new(
        PlanModel::parse("llama2-7b").unwrap(),
        Cluster::parse("dgx-a100-80g,nodes=2").unwrap(),
        2048,
        64,
    );
    let best = evaluate(
        &input,
        &crate::layout::LayoutSpec::parse("dp=4,tp=4,mbs=1")
            .unwrap()
            .layout,
    )
    .unwrap();
    let mut close = best.clone();
    close.step_time_s *= 1.02;
    let mut far = best.clone();
    far.step_time_s *= 1.10;
    let note = explain::within_error_of_best(&input, &best, &close).expect("within 2.75%");
    assert!(note.contains("+2.0%") && note.contains("2.8%"), "{note}");
    assert!(explain::within_error_of_best(&input, &best, &far).is_none());
    // A constant changed by hand: the measured error no longer holds, nothing is marked.
    input.cluster = Cluster::parse("dgx-a100-80g,nodes=2,peak_tflops=400").unwrap();
    assert_eq!(input.cluster.calibration.step_time_error, None);
    assert!(explain::within_error_of_best(&input, &best, &close).is_none());
    assert!(explain::ranking_note(&input).contains("never measured"));
}

#[test]
fn model_flops_count_attention_under_the_causal_mask_and_its_window() {
    use crate::model::ModelConfig;
    // A query sees on average (s + 1) / 2 keys under the causal mask; within a window w < s,
    // (w(w + 1)/2 + (s − w)·w) / s.
    assert_eq!(cost::keys_seen(4, None), 2.5);
    assert_eq!(cost::keys_seen(4, Some(2)), (3.0 + 4.0) / 4.0);
    assert_eq!(cost::keys_seen(4, Some(8)), 2.5);
    let cfg = ModelConfig::llama(32000, 4096, 11008, 32, 32, 32, 4096, 10000.0);
    let l = Layout::default();
    let (seq, batch) = (4096, 1);
    let (model, hardware) = step_flops(&cfg, &l, seq, batch, false, AttentionKernel::Materialized);
    // Materialised attention, no recompute: hardware counts the products in full, model FLOPs
    // the causal half of them (plus the diagonal).
    let full = 3.0 * 4.0 * (seq * seq) as f64 * cfg.q_dim() as f64 * cfg.num_layers as f64;
    let seen = 3.0 * 4.0 * seq as f64 * 2048.5 * cfg.q_dim() as f64 * cfg.num_layers as f64;
    assert!(
        (hardware - model - (full - seen)).abs() < 1e-6 * hardware,
        "{model} {hardware}"
    );
}

/// Expert parallelism: each device holds num_experts / ep of every block's routed experts, ZeRO
/// shards them over the dp·cp / ep replicas holding the same ones (and the rest over all), the
/// all-to-alls are priced at the balanced load, and the search prices ep for Mixtral 8x7B.
#[test]
fn expert_parallelism_divides_the_experts_and_is_searched() {
    let input = PlanInput::new(
        PlanModel::parse("mixtral-8x7b").unwrap(),
        Cluster::parse("dgx-h100-80g,nodes=2").unwrap(),
        4096,
        64,
    );
    let PlanModel::Shape(cfg) = &input.model else {
        unreachable!()
    };
    let m = cfg.moe.as_deref().unwrap();
    let layout = |spec: &str| crate::layout::LayoutSpec::parse(spec).unwrap().layout;
    let (whole, split) = (layout("dp=16,zero=1"), layout("dp=16,ep=8,zero=1"));
    // Every block has experts: 32 blocks × 8 experts × 3 matrices of 4096 × 14336.
    let experts = 32.0 * 8.0 * 3.0 * 4096.0 * 14336.0;
    let held = params_on_device(cfg, &whole, 0) - params_on_device(cfg, &split, 0);
    assert!((held / (experts * 7.0 / 8.0) - 1.0).abs() < 1e-12, "{held}");
    // ZeRO-1: the optimizer state of the experts over the 16 / 8 = 2 replicas holding them.
    let dense = params_on_device(cfg, &split, 0) - experts / 8.0;
    let want = 8.0 * (dense / 16.0 + experts / 8.0 / 2.0);
    let got = stage_memory(&input, &split, 0, 1).optimizer_states as f64;
    assert!((got / want - 1.0).abs() < 1e-9, "{got} vs {want}");
    // All-to-all bytes: four exchanges of k·tokens·(ep−1)/ep rows per block and micro-batch, in the
    // activations' format (the plan's default precision, bf16: 2 bytes), beside the counts.
    assert_eq!(input.precision.weights.bytes(), 2.0);
    let plan = evaluate(&input, &layout("dp=16,ep=8,zero=1,mbs=1")).unwrap();
    let places = 4096.0 * m.top_k as f64 * 7.0 / 8.0;
    let per_micro_batch = 32.0 * (2.0 * 2.0 * places * 4096.0 * 2.0 + 7.0 * 8.0);
    let micro_batches = 64.0 / 16.0;
    assert_eq!(plan.comm_bytes_per_step.ep, micro_batches * per_micro_batch);
    assert!(plan
        .explain
        .iter()
        .any(|l| l.contains("expert parallel ep=8")));
    // Eight consecutive replicas on eight-device nodes: inside a node; with tp=2 they span two.
    let c = &input.cluster;
    assert_eq!(links(c, &split).ep, c.intra_node);
    assert_eq!(links(c, &layout("dp=8,tp=2,ep=8")).ep, c.inter_node);
    // etp=1 over tp=2: each device holds 1 of the 8 experts whole (the same bytes as 2 experts'
    // halves), and sends only its tensor-parallel block's places (half the rows), one count per
    // expert it holds to each of its 3 peers.
    let (columns, experts_whole) = (
        layout("dp=8,tp=2,ep=4,zero=1,mbs=1"),
        layout("dp=8,tp=2,ep=4,etp=1,zero=1,mbs=1"),
    );
    assert_eq!(
        params_on_device(cfg, &columns, 0),
        params_on_device(cfg, &experts_whole, 0)
    );
    let places = 4096.0 * m.top_k as f64 / 2.0 * 3.0 / 4.0;
    let per_micro_batch = 32.0 * (2.0 * 2.0 * places * 4096.0 * 2.0 + 3.0 * 1.0 * 8.0);
    let plan = evaluate(&input, &experts_whole).unwrap();
    assert_eq!(plan.comm_bytes_per_step.ep, 64.0 / 8.0 * per_micro_batch);
    assert!(plan
        .explain
        .iter()
        .any(|l| l.contains("etp=1: the tp=2 devices")));
    // The search prices expert-parallel candidates beside the others, etp=1 among them.
    assert!(super::search::enumerate(&input)
        .iter()
        .any(|l| l.etp == Some(1) && l.ep > 1));
    let plans = search(&input).unwrap();
    assert!(
        plans.iter().any(|p| p.layout.ep > 1 && p.fits),
        "{}",
        plans[0].layout
    );
    // ep must divide the replicas and the experts.
    let e = evaluate(&input, &layout("dp=16,ep=16"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ep=16") && e.contains("8 experts"), "{e}");
    // The asynchronous schedules stash versions of the device's share of the experts: 2BW's first
    // stage holds two versions of what 1F1B holds one of, experts ÷ ep included.
    let weights = |spec: &str| {
        evaluate(&input, &layout(spec))
            .unwrap()
            .memory_bytes_per_stage[0]
            .weights
    };
    let one = weights("dp=8,ep=2,pp=2,zero=1,schedule=1f1b");
    // The experts' part of the weights, shown apart: halved by ep=2, and divided by ZeRO-3 over
    // the dp/ep = 4 replicas holding the same experts.
    let experts = |spec: &str| {
        evaluate(&input, &layout(spec))
            .unwrap()
            .expert_weight_bytes_per_stage[0]
    };
    assert_eq!(2 * experts("dp=8,ep=2,zero=1"), experts("dp=8,zero=1"));
    assert_eq!(4 * experts("dp=8,ep=2,zero=3"), experts("dp=8,ep=2,zero=1"));
    assert_eq!(weights("dp=8,ep=2,pp=2,zero=1,schedule=2bw"), 2 * one);
    assert!(one < weights("dp=8,pp=2,zero=1,schedule=1f1b"));
    // LoRA: the experts' adapters are divided like the experts (dense ones whole), and sharded by
    // ZeRO-1 over the replicas holding them; a 4-bit base is refused, by name.
    let lora = crate::model::LoraConfig::new(cfg, 16, 32.0, &[]).unwrap();
    let with_lora = PlanInput {
        lora: Some(lora),
        ..input.clone()
    };
    let adapters =
        |l: &Layout| memory::lora_params_on_device(cfg, with_lora.lora.as_ref().unwrap(), l, 0);
    // Per block and expert: w1 and w3 (4096 → 14336) and w2 (14336 → 4096), rank 16.
    let expert_adapters = 32.0 * 8.0 * 3.0 * 16.0 * (4096.0 + 14336.0);
    let shed = adapters(&whole) - adapters(&split);
    assert!(
        (shed / (expert_adapters * 7.0 / 8.0) - 1.0).abs() < 1e-12,
        "{shed}"
    );
    let dense = adapters(&split) - expert_adapters / 8.0;
    let want = 8.0 * (dense / 16.0 + expert_adapters / 8.0 / 2.0);
    let got = stage_memory(&with_lora, &split, 0, 1).optimizer_states as f64;
    assert!((got / want - 1.0).abs() < 1e-9, "{got} vs {want}");
    let e = evaluate(
        &PlanInput {
            quantize_base: Some(crate::precision::BaseQuantization::Nf4),
            ..with_lora
        },
        &split,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--quantize-base") && e.contains("mixture of experts"),
        "{e}"
    );
}

/// DeepSeek-V3 is priced as it is built: latent attention's down-projections whole on every
/// tensor-parallel device and its up-projections by heads, its shared expert (no gate) beside
/// the routed ones, attention's products over 192-wide queries and keys and 128-wide values; and
/// the search finds where it fits.
#[test]
fn deepseek_v3_is_priced_with_latent_attention_and_its_experts() {
    let input = PlanInput::new(
        PlanModel::parse("deepseek-v3").unwrap(),
        Cluster::parse("dgx-h100-80g,nodes=32").unwrap(),
        4096,
        512,
    );
    let PlanModel::Shape(cfg) = &input.model else {
        unreachable!()
    };
    let layout = |spec: &str| crate::layout::LayoutSpec::parse(spec).unwrap().layout;
    // One device, one stage: every parameter.
    let whole = params_on_device(cfg, &layout("dp=1"), 0);
    assert!(
        (whole / cfg.num_params() as f64 - 1.0).abs() < 1e-12,
        "{whole}"
    );
    // tp=8 divides q_b, kv_b and o by heads and keeps q_a, kv_a and their norms whole (a block's
    // attention), and divides every expert's columns.
    let (h, t) = (7168.0, 8.0);
    let down = h * 1536.0 + 1536.0 + h * 576.0 + 512.0;
    let by_heads = 1536.0 * 128.0 * 192.0 + 512.0 * 128.0 * 256.0 + 128.0 * 128.0 * h;
    let attention = |t: f64| down + by_heads / t;
    let shed =
        params_on_device(cfg, &layout("dp=1"), 0) - params_on_device(cfg, &layout("tp=8"), 0);
    let mlp = 3.0 * 18432.0 * h * 3.0 + 58.0 * (257.0 * 3.0 * 2048.0 * h);
    let embeddings = 2.0 * 129280.0 * h;
    let want = 61.0 * (attention(1.0) - attention(t)) + (mlp + embeddings) * (1.0 - 1.0 / t);
    assert!((shed / want - 1.0).abs() < 1e-9, "{shed} vs {want}");
    // QKᵀ over 128 heads of 192, PV over 128 of 128: 2·(24576 + 16384) FLOPs per query and key.
    assert_eq!(cfg.attention_score_flops_per_key(), 81920.0);
    let plans = search(&input).unwrap();
    assert!(plans[0].fits, "{}", plans[0].layout);
    assert!(plans[0].layout.ep > 1, "{}", plans[0].layout);
    // The plan says what it priced and that the engine does not train it.
    let said = |what: &str| plans[0].explain.iter().any(|l| l.contains(what));
    assert!(said(
        "multi-head latent attention: queries through a rank-1536 bottleneck"
    ));
    assert!(said("priced only: a deepseek_v3 model"));
}

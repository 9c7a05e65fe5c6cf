//! The training runtime: micro-batching is exact, a short fine-tune learns, metrics are complete,
//! and bad settings or data are refused with clear errors.

mod common;

use common::*;
use ferrotron_engine::data;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::runtime::{run_step, train, TrainConfig};
use ferrotron_engine::transformer::{TokenBatch, Transformer};
use rand::{Rng, SeedableRng};

#[test]
fn micro_batches_accumulate_to_the_full_batch_gradient() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let batch = TokenBatch {
        ids: (0..8 * 24).map(|_| rng.gen_range(0..512)).collect(),
        batch: 8,
        seq: 24,
    };
    let tf = Transformer::new(&cfg, &params);
    let be = CpuBackend::default();
    let mut full = params.zeros_like();
    let a = run_step(&tf, &be, &params, &mut full, &batch, 8).unwrap();
    for mbs in [1, 2, 4] {
        let mut acc = params.zeros_like();
        let b = run_step(&tf, &be, &params, &mut acc, &batch, mbs).unwrap();
        assert!(
            (a.loss - b.loss).abs() / a.loss < 1e-6,
            "mbs {mbs}: loss {} vs {}",
            b.loss,
            a.loss
        );
        assert!(b.peak_activation_bytes < a.peak_activation_bytes);
        for ((s, g), f) in acc.specs.iter().zip(&acc.tensors).zip(&full.tensors) {
            let e = rel_err(g, f);
            assert!(e < 1e-5, "mbs {mbs}: {} rel err {e:e}", s.name);
        }
    }
    assert!(run_step(&tf, &be, &params, &mut full, &batch, 3)
        .unwrap_err()
        .to_string()
        .contains("divisible"));
}

fn tiny_config(tag: &str) -> TrainConfig {
    let corpus = temp_dir(&format!("{tag}-data")).join("manual.txt");
    std::fs::write(&corpus, &data::BUILTIN_CORPUS[..120_000]).unwrap();
    {
        let mut c = TrainConfig::default();
        c.input.model = fixture("llama_tiny").display().to_string();
        c.input.data = corpus.display().to_string();
        c.optimizer.steps = 30;
        c.optimizer.batch_size = 8;
        c.input.seq_len = 32;
        c.optimizer.lr = 3e-3;
        c.optimizer.min_lr = 3e-4;
        c.optimizer.warmup_steps = 5;
        c.logging.eval_every = 10;
        c.logging.eval_batches = 4;
        c.checkpointing.out_dir = temp_dir(tag);
        c
    }
}

#[test]
fn fine_tuning_lowers_validation_loss_and_writes_metrics_and_model() {
    let cfg = tiny_config("finetune");
    let mut steps = 0;
    let summary = train(&cfg, &mut |_| steps += 1).unwrap();
    assert_eq!(steps, 30);
    let (first, last) = (
        summary.initial_val_loss.unwrap(),
        summary.final_val_loss.unwrap(),
    );
    println!("val loss {first} -> {last}");
    assert!(last < first - 0.5);
    let metrics = std::fs::read_to_string(cfg.checkpointing.out_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 30);
    for l in &lines {
        for key in ["step", "loss", "lr", "tokens_per_s"] {
            assert!(l[key].is_number(), "metrics line lacks {key}: {l}");
        }
        let dev = &l["devices"][0];
        for term in [
            "weights",
            "gradients",
            "master_weights",
            "optimizer_states",
            "activations",
            "comm_buffers",
            "total",
        ] {
            assert!(
                dev["peak_memory_bytes"][term].is_u64(),
                "lacks {term}: {dev}"
            );
        }
        assert!(dev["idle_fraction"].is_number() && dev["bytes_sent"].is_number());
    }
    assert!(lines[9]["val_loss"].is_number() && lines[8]["val_loss"].is_null());
    // The saved model loads and scores the same as the last validation.
    let (mcfg, params) = hf::load_model(&summary.model_dir).unwrap();
    assert_eq!(mcfg.vocab_size, 512);
    assert_eq!(params.numel(), summary.num_params);
    assert!(summary.model_dir.join("tokenizer.json").exists());
}

#[test]
fn same_seed_same_run() {
    let a = train(
        &{
            let mut c = tiny_config("det-a");
            c.optimizer.steps = 5;
            c
        },
        &mut |_| {},
    )
    .unwrap();
    let b = train(
        &{
            let mut c = tiny_config("det-b");
            c.optimizer.steps = 5;
            c
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(a.final_train_loss.to_bits(), b.final_train_loss.to_bits());
}

#[test]
fn bad_settings_and_data_are_refused_clearly() {
    let base = tiny_config("bad");
    let err = |c: TrainConfig| train(&c, &mut |_| {}).unwrap_err().to_string();
    let e = err({
        let mut c = base.clone();
        c.input.seq_len = 300;
        c
    });
    assert!(
        e.contains("seq_len 300")
            && e.contains("max_position_embeddings 256")
            && e.contains("config.json"),
        "{e}"
    );
    let empty = base.checkpointing.out_dir.join("empty.txt");
    std::fs::write(&empty, "  \n").unwrap();
    let e = err({
        let mut c = base.clone();
        c.input.data = empty.display().to_string();
        c
    });
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.input.data = "/nonexistent/corpus.txt".into();
        c
    });
    assert!(e.contains("/nonexistent/corpus.txt"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.input.model = "llama-huge".into();
        c
    });
    assert!(e.contains("llama-huge") && e.contains("preset"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.parallelism.layout = "dp=16".parse().unwrap();
        c
    });
    assert!(
        e.contains("16 devices") && e.contains("cluster has 8"),
        "{e}"
    );
    // A tensor-parallel group across two nodes of two devices each.
    let e = err({
        let mut c = base.clone();
        c.parallelism.layout = "tp=4".parse().unwrap();
        c.parallelism.cluster = "this-machine,nodes=2,devices_per_node=2".into();
        c
    });
    assert!(e.contains("tp") && e.contains("node"), "{e}");
    let toml = serde_json::json!({ "backend": "carrier-pigeon" })
        .as_object()
        .cloned();
    let e = TrainConfig::layered(toml, &base, &|_| false, "run.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("backend"), "{e}");
    // A precision is a value from the settings boundary on: a name it does not know is refused
    // there, naming the key and the value.
    let toml = serde_json::json!({ "precision": "fp8" })
        .as_object()
        .cloned();
    let e = TrainConfig::layered(toml, &base, &|_| false, "run.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("precision") && e.contains("fp8"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.numerics.precision = ferrotron_core::precision::MixedPrecision::Fp16;
        c.numerics.loss_scale = 0.0;
        c
    });
    assert!(e.contains("loss_scale"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.parallelism.layout = "dp=2".parse().unwrap();
        c.logging.slow_device = Some(5);
        c
    });
    assert!(e.contains("slow_device") && e.contains("2 devices"), "{e}");
    let e = err({
        let mut c = base.clone();
        c.parallelism.layout = "tp=3".parse().unwrap();
        c
    });
    assert!(e.contains("tp=3") && e.contains("heads"), "{e}");
    // A layout is a value from the settings boundary on: a bad one is refused there.
    let toml = serde_json::json!({ "layout": "tp=zero" })
        .as_object()
        .cloned();
    let e = TrainConfig::layered(toml, &base, &|_| false, "run.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("tp"), "{e}");
    // A tokenizer with more tokens than the model's vocabulary.
    let (_, big) = data::train_or_load_tokenizer(
        &[data::BUILTIN_CORPUS[..100_000].to_string()],
        1024,
        &base.checkpointing.out_dir,
    )
    .unwrap();
    let e = err({
        let mut c = base.clone();
        c.input.tokenizer = Some(big.clone());
        c
    });
    assert!(
        e.contains(&big.display().to_string()) && e.contains("1024") && e.contains("512"),
        "{e}"
    );
}

#[test]
fn recompute_gives_identical_gradients_from_a_smaller_stash() {
    use ferrotron_core::layout::Recompute;
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = TokenBatch {
            ids: (0..4 * 32).map(|i| (i * 13 % 512) as u32).collect(),
            batch: 4,
            seq: 32,
        };
        let be = CpuBackend::default();
        let run = |policy| {
            let tf = Transformer::new(&cfg, &params).with_recompute(policy);
            let mut g = params.zeros_like();
            let out = run_step(&tf, &be, &params, &mut g, &batch, 4).unwrap();
            (out, g)
        };
        let (base, g0) = run(Recompute::None);
        for policy in [Recompute::Selective, Recompute::Full] {
            let (out, g) = run(policy);
            assert_eq!(
                out.loss.to_bits(),
                base.loss.to_bits(),
                "{model} {policy:?}"
            );
            assert_eq!(g, g0, "{model} {policy:?}: gradients must be bit-identical");
            // Memory-efficient attention keeps no probabilities, so selective recompute has
            // nothing to drop: its stash is no recompute's. Full recompute keeps layer inputs only.
            match policy {
                Recompute::Selective => assert_eq!(
                    out.peak_activation_bytes, base.peak_activation_bytes,
                    "{model} {policy:?}"
                ),
                _ => assert!(
                    out.peak_activation_bytes < base.peak_activation_bytes,
                    "{model} {policy:?}"
                ),
            }
            println!(
                "{model} {policy:?}: stash {} -> {} bytes",
                base.peak_activation_bytes, out.peak_activation_bytes
            );
        }
    }
}

/// Per-step training losses from `metrics.jsonl` of a run of `steps` steps under `layout`.
fn losses(layout: &str, steps: usize) -> Vec<f64> {
    let tag: String = layout
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let cfg = {
        let mut c = tiny_config(&format!("track-{steps}-{tag}"));
        c.optimizer.steps = steps;
        c.parallelism.layout = layout.parse().unwrap();
        c
    };
    train(&cfg, &mut |_| {}).unwrap();
    metric_losses(&cfg.checkpointing.out_dir)
}

fn assert_tracks(layouts: &[&str], steps: usize) {
    let unsplit = losses("mbs=2", steps);
    assert_eq!(unsplit.len(), steps);
    for layout in layouts {
        let split = losses(layout, steps);
        assert_eq!(split.len(), steps, "{layout}");
        for (step, (a, b)) in split.iter().zip(&unsplit).enumerate() {
            assert!(
                (a - b).abs() / b <= 1e-5,
                "{layout} step {step}: loss {a} vs unsplit {b}"
            );
        }
    }
}

#[test]
fn pipeline_training_tracks_the_unsplit_run_step_by_step() {
    assert_tracks(
        &[
            "pp=2,schedule=1f1b,mbs=2",
            "pp=4,schedule=zbh1,mbs=2",
            "pp=2,vpp=2,schedule=interleaved,mbs=2",
        ],
        5,
    );
}

#[test]
fn tensor_parallel_training_tracks_the_unsplit_run_for_ten_steps() {
    assert_tracks(&["tp=2,mbs=2", "tp=2,sp=true,mbs=2", "tp=2,pp=2,mbs=2"], 10);
}

#[test]
fn a_capacity_below_the_need_is_an_out_of_memory_error_and_auto_finds_a_layout_that_fits() {
    let base = {
        let mut c = tiny_config("capacity");
        c.input.model = "llama-small".into();
        c.optimizer.steps = 2;
        c.optimizer.batch_size = 8;
        c.input.seq_len = 64;
        c.logging.eval_every = 0;
        c.parallelism.device_memory = Some("40MB".into());
        c
    };
    // dp=2 keeps the whole model state on each device: 4.26M parameters × 16 bytes alone are 68 MB.
    let e = train(
        &{
            let mut c = base.clone();
            c.parallelism.layout = "dp=2".parse().unwrap();
            c
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("out of memory") && e.contains("capacity of 40.00 MB"),
        "{e}"
    );
    assert!(
        e.contains("optimizer_states") && e.contains("the planner predicted"),
        "{e}"
    );
    // The planner picks a layout that fits in 40 MB, and it runs within it.
    let summary = train(
        &{
            let mut c = base.clone();
            c.parallelism.layout = "auto".parse().unwrap();
            c.checkpointing.out_dir = temp_dir("capacity-auto");
            c
        },
        &mut |_| {},
    )
    .unwrap();
    assert!(summary.layout.world_size() > 1, "{}", summary.layout);
    assert_eq!(summary.devices.len(), summary.layout.world_size());
    for d in &summary.devices {
        assert!(d.peak_memory_bytes.total <= 40_000_000, "{d:?}");
        assert!(d.predicted_memory_bytes.total > 0, "{d:?}");
        // What `auto` chose holds what the planner said of it (#43).
        let what = format!("{} device {}", summary.layout, d.device);
        assert_large_terms_near(&what, &d.peak_memory_bytes, &d.predicted_memory_bytes);
    }
}

#[test]
fn an_injected_slow_device_is_named_as_a_straggler() {
    let cfg = {
        let mut c = tiny_config("straggler");
        c.optimizer.steps = 5;
        c.optimizer.batch_size = 8;
        c.parallelism.layout = "dp=2,pp=2".parse().unwrap();
        c.logging.eval_every = 0;
        c.logging.slow_device = Some(3);
        c.logging.slow_device_ms = 5.0;
        c
    };
    let mut warnings = Vec::new();
    train(&cfg, &mut |r| warnings.extend(r.warnings.iter().cloned())).unwrap();
    // Named once three steps in a row show it, and on every step after.
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    for w in &warnings {
        assert!(
            w.starts_with("straggler: device 3 (stage 1, dp rank 1"),
            "{w}"
        );
    }
    let line = std::fs::read_to_string(cfg.checkpointing.out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_string();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert!(v["warnings"][0].as_str().unwrap().contains("device 3"));
}

#[test]
fn mixed_precision_training_reaches_the_f32_validation_loss() {
    let run = |precision: &str, inject: Option<usize>| {
        let cfg = {
            let mut c = tiny_config(&format!("mixed-{precision}"));
            c.optimizer.steps = 200;
            c.optimizer.batch_size = 8;
            c.logging.eval_every = 100;
            c.numerics.precision =
                ferrotron_core::precision::MixedPrecision::parse(precision).unwrap();
            c.numerics.inject_nonfinite_step = inject;
            c
        };
        let summary = train(&cfg, &mut |_| {}).unwrap();
        let lines: Vec<serde_json::Value> =
            std::fs::read_to_string(cfg.checkpointing.out_dir.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        (summary, lines)
    };
    let (f32_run, _) = run("f32", None);
    let (bf16, lines) = run("bf16", None);
    // Stored in 16 bits: the weights term is half the f32 run's (2 bytes per parameter).
    let weights = lines[0]["devices"][0]["peak_memory_bytes"]["weights"]
        .as_u64()
        .unwrap();
    assert!(
        weights < 2 * 260_000 + 20_000,
        "bf16 weights {weights} bytes"
    );
    let (fp16, lines) = run("fp16", Some(50));
    let skipped: Vec<u64> = lines
        .iter()
        .filter(|l| l["skipped"] == true)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        skipped,
        vec![51],
        "the injected inf skips that step, and only that one"
    );
    assert!(lines[51]["loss_scale"].as_f64().unwrap() < lines[49]["loss_scale"].as_f64().unwrap());
    let want = f32_run.final_val_loss.unwrap();
    for (name, s) in [("bf16", &bf16), ("fp16", &fp16)] {
        let got = s.final_val_loss.unwrap();
        let e = (got - want).abs() / want;
        assert!(
            e <= 0.02,
            "{name}: validation loss {got} vs f32 {want} ({e:.4})"
        );
    }
}

/// Every step's MFU in `metrics.jsonl` is the planner's model FLOPs and peak over that step's
/// measured time: `mfu × step_time_s` is the planner's `mfu × step_time_s` for the layout, every step.
#[test]
fn every_step_reports_its_mfu_on_the_planners_flops() {
    let cfg = {
        let mut c = tiny_config("mfu");
        c.optimizer.steps = 3;
        c.logging.eval_every = 0;
        c.parallelism.layout = "dp=2,tp=2,mbs=2".parse().unwrap();
        c
    };
    train(&cfg, &mut |_| {}).unwrap();
    let text = std::fs::read_to_string(cfg.checkpointing.out_dir.join("metrics.jsonl")).unwrap();
    let model = ferrotron_engine::hf::read_config(&fixture("llama_tiny")).unwrap();
    let input = ferrotron_engine::runtime::plan_input(&cfg, &model, None).unwrap();
    let plan = ferrotron_core::plan::evaluate(&input, &cfg.parallelism.layout.layout).unwrap();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (mfu, step) = (
            v["mfu"].as_f64().unwrap(),
            v["step_time_s"].as_f64().unwrap(),
        );
        assert!(mfu > 0.0 && mfu < 1.5, "{line}");
        let (got, want) = (mfu * step, plan.mfu * plan.step_time_s);
        assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    }
}

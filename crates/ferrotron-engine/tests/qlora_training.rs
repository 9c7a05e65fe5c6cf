//! QLoRA fine-tuning runs: adapters trained on an NF4 base resume bit for bit (the base is
//! quantized again from the model, deterministically), continue on another layout, merge as PEFT
//! merges on a 4-bit base, and hold the memory the planner predicts, the base at about half a byte
//! a parameter.

mod common;

use common::*;
use ferrotron_core::model::is_projection_weight;
use ferrotron_core::precision::BaseQuantization;
use ferrotron_engine::checkpoint::Checkpoint;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::runtime::{train, TrainConfig};
use ferrotron_engine::transformer::Trained;

/// f32 relative tolerance after a few AdamW steps on two layouts (reduction orders differ).
const TOL: f64 = 1e-5;

fn config(tag: &str, model: &str, layout: &str, steps: usize) -> TrainConfig {
    let mut c = lora_run_config(tag, model, layout, steps, 3e-3);
    c.lora.adapter = Some(fixture("qlora").join("llama_tiny"));
    c.lora.quantize_base = Some(BaseQuantization::Nf4);
    c
}

fn trained_adapters(cfg: &TrainConfig) -> Adapters {
    let (model, _) = hf::load_model(&fixture("llama_tiny")).unwrap();
    Adapters::load_peft(&cfg.checkpointing.out_dir.join("adapter"), &model).unwrap()
}

#[test]
fn a_qlora_checkpoint_resumes_bit_for_bit_and_continues_on_another_layout() {
    let model = fixture("llama_tiny").display().to_string();
    let full = {
        let mut c = config("resume-full", &model, "tp=2,pp=2,mbs=2", 5);
        c.checkpointing.checkpoint_every = 3;
        c
    };
    train(&full, &mut |_| {}).unwrap();
    let want = trained_adapters(&full);
    let ck = full.checkpointing.out_dir.join("checkpoints/step-000003");
    let manifest = Checkpoint::open(&ck).unwrap().manifest;
    assert_eq!(manifest.quantize_base, Some(BaseQuantization::Nf4));
    for (layout, flag) in [
        ("tp=2,pp=2,mbs=2", None),
        ("tp=2,pp=2,mbs=2", Some(BaseQuantization::Nf4)),
        ("dp=2,zero=3,mbs=2", None),
    ] {
        let tag = format!("{}-{}", layout.replace([',', '='], "-"), flag.is_some());
        let resumed = {
            let mut c = config(&format!("resumed-{tag}"), &model, layout, 5);
            c.checkpointing.resume = Some(ck.clone());
            c.lora.adapter = None;
            // Without the flag, the checkpoint's quantization continues.
            c.lora.quantize_base = flag;
            c
        };
        train(&resumed, &mut |_| {}).unwrap();
        let got = trained_adapters(&resumed);
        if layout == "tp=2,pp=2,mbs=2" {
            assert_eq!(got.params, want.params, "same-layout resume is bitwise");
        } else {
            for (s, (x, y)) in got
                .params
                .specs
                .iter()
                .zip(got.params.tensors.iter().zip(&want.params.tensors))
            {
                let e = rel_err(x, y);
                assert!(e <= TOL, "{layout}: {} differs by {e:.2e}", s.name);
            }
        }
    }
    // The adapters of an unquantized base do not continue on a quantized one.
    let lora_run = {
        let mut c = config("plain", &model, "", 2);
        c.lora.quantize_base = None;
        c
    };
    train(&lora_run, &mut |_| {}).unwrap();
    let mismatched = {
        let mut c = config("mismatched", &model, "", 3);
        c.checkpointing.resume = Some(
            lora_run
                .checkpointing
                .out_dir
                .join("checkpoints/step-000002"),
        );
        c.lora.adapter = None;
        c
    };
    let e = train(&mismatched, &mut |_| {}).unwrap_err().to_string();
    assert!(
        e.contains("--quantize-base nf4") && e.contains("unquantized base"),
        "{e}"
    );
    // A quantized base is frozen: full training refuses it.
    let full_training = {
        let mut c = config("full-training", &model, "", 2);
        c.lora.adapter = None;
        c
    };
    let e = train(&full_training, &mut |_| {}).unwrap_err().to_string();
    assert!(
        e.contains("quantize_base") && e.contains("lora_rank"),
        "{e}"
    );
}

#[test]
fn the_merged_export_of_a_4bit_base_reproduces_peft_s_merged_logits() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, mut base) = hf::load_model(&fixture(model)).unwrap();
        base.quantize_nf4(&cfg);
        let dir = fixture("qlora").join(model);
        let adapters = Adapters::load_peft(&dir, &cfg).unwrap();
        let reference = Reference::from_file(dir.join("qlora_reference.safetensors"));
        let out = temp_dir(&format!("merged-{model}"));
        let merged = adapters.merge(&cfg, &base).unwrap();
        hf::save_model(&out, &cfg, &merged, hf::StorageDtype::F32).unwrap();
        let (mcfg, loaded) = hf::load_model(&out).unwrap();
        let logits = Trained::full(&loaded)
            .unsplit(&mcfg)
            .forward(&CpuBackend::default(), &loaded, &reference.batch)
            .logits;
        let e = rel_err(&logits, reference.get("merged_logits_f32"));
        println!("{model}: merged logits vs PEFT's merge on the dequantized base: {e:.2e}");
        assert!(e <= 1e-5, "{model}: merged logits rel err {e:.2e}");
        // The adapters on the NF4 base compute the merged model's logits.
        let unmerged = Trained::lora(&base, &adapters.config, &adapters.params)
            .unsplit(&cfg)
            .forward(&CpuBackend::default(), &adapters.params, &reference.batch)
            .logits;
        assert!(rel_err(&unmerged, &logits) <= 1e-5, "{model}");
    }
}

/// One step of LoRA rank 8 on llama-small's NF4 base on `layout`: each device's measured and
/// predicted memory per term (`metrics.jsonl`).
fn memory_of(tag: &str, layout: &str) -> Vec<(serde_json::Value, serde_json::Value)> {
    let mut c = config(tag, "llama-small", layout, 1);
    c.lora.adapter = None;
    c.lora.lora_rank = Some(8);
    c.input.seq_len = 128;
    c.optimizer.batch_size = 4;
    c.parallelism.threads = 1;
    train(&c, &mut |_| {}).unwrap();
    let line = std::fs::read_to_string(c.checkpointing.out_dir.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    first["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["peak_memory_bytes"].clone(),
                d["predicted_memory_bytes"].clone(),
            )
        })
        .collect()
}

#[test]
fn zero_3_shards_the_4bit_codes_over_the_replicas() {
    let weights = |layout: &str| -> f64 {
        let devices = memory_of(&layout.replace([',', '='], "-"), layout);
        for (m, p) in &devices {
            let (m, p) = (
                m["weights"].as_f64().unwrap(),
                p["weights"].as_f64().unwrap(),
            );
            assert!(
                (m - p).abs() / m <= 0.10,
                "{layout}: weights {m} vs predicted {p}"
            );
        }
        devices[0].0["weights"].as_f64().unwrap()
    };
    let (z2, z3) = (weights("dp=2,zero=2,mbs=1"), weights("dp=2,zero=3,mbs=1"));
    // llama-small's projections: 3.21M parameters, 1.61 MB of codes; ZeRO-3 keeps half of them
    // (and half of the adapters' compute copy, 0.32 MB).
    assert!(
        z2 - z3 > 0.7e6 + 0.3e6,
        "ZeRO-2 {z2} vs ZeRO-3 {z3} bytes of weights"
    );
}

#[test]
fn measured_memory_is_the_planners_and_the_base_is_half_a_byte_a_parameter() {
    let devices = memory_of("memory", "");
    let (measured, predicted) = (&devices[0].0, &devices[0].1);
    let total = measured["total"].as_f64().unwrap();
    for term in [
        "weights",
        "gradients",
        "optimizer_states",
        "activations",
        "total",
    ] {
        let (m, p) = (
            measured[term].as_f64().unwrap(),
            predicted[term].as_f64().unwrap(),
        );
        let e = (m - p).abs() / m;
        println!("{term}: measured {m} predicted {p} ({e:.3})");
        assert!(e <= 0.10, "{term}: measured {m} vs predicted {p} ({e:.3})");
    }
    // What is not a quantized projection is f32 here: the embeddings, the norms, the head and
    // the adapters. The rest of the weights term is the NF4 base.
    let cfg = ferrotron_core::model::preset("llama-small").unwrap();
    let specs = cfg.param_specs();
    let quantized: usize = specs
        .iter()
        .filter(|s| is_projection_weight(&cfg, &s.name))
        .map(|s| s.numel())
        .sum();
    let f32_params = cfg.num_params() - quantized
        + ferrotron_core::model::LoraConfig::new(&cfg, 8, 16.0, &[])
            .unwrap()
            .num_params(&cfg);
    let base = measured["weights"].as_f64().unwrap() - 4.0 * f32_params as f64;
    let per_param = base / quantized as f64;
    println!("NF4 base: {per_param:.4} bytes a quantized parameter ({total} bytes in all)");
    assert!(per_param <= 0.56, "{per_param} bytes a quantized parameter");
}

fn losses(cfg: &TrainConfig) -> Vec<f64> {
    metric_losses(&cfg.checkpointing.out_dir)
}

#[test]
fn qlora_composes_with_mixed_precision_on_the_3d_mesh_under_zero_3() {
    // The NF4 base dequantizes to the same values under every precision; bf16 then rounds them and
    // the activations to 8 significant bits (2⁻⁹ relative), fp16 to 11: five steps' losses move by
    // well under 0.5% of the f32 run's, with the codes gathered by ZeRO-3.
    let (model, layout) = (
        fixture("llama_tiny").display().to_string(),
        "dp=2,tp=2,pp=2,zero=3,mbs=1",
    );
    let f32_run = config("mp-f32", &model, layout, 5);
    train(&f32_run, &mut |_| {}).unwrap();
    for precision in ["bf16", "fp16"] {
        let cfg = {
            let mut c = config(&format!("mp-{precision}"), &model, layout, 5);
            c.numerics.precision =
                ferrotron_core::precision::MixedPrecision::parse(precision).unwrap();
            c
        };
        train(&cfg, &mut |_| {}).unwrap();
        for (step, (a, b)) in losses(&cfg).iter().zip(losses(&f32_run)).enumerate() {
            assert!(
                (a - b).abs() / b <= 5e-3,
                "{precision} step {step}: loss {a} vs f32 {b}"
            );
        }
    }
}

//! LoRA fine-tuning runs: the base stays frozen, the run writes a PEFT adapter and the merged model,
//! every layout trains the same adapters (AdamW with global-norm clipping over the shards), a loaded
//! adapter continues exactly as the one in memory, a sharded checkpoint resumes on any layout, and
//! the merged export reproduces PEFT's merged logits.

mod common;

use common::*;
use ferrotron_core::model::PEFT_PREFIX;
use ferrotron_engine::checkpoint::{self, Checkpoint};
use ferrotron_engine::data;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::runtime::{train, TrainConfig};
use ferrotron_engine::transformer::{ParamStore, Trained};
use std::path::PathBuf;

/// f32 relative tolerance after a few AdamW steps on two layouts (reduction orders differ).
const TOL: f64 = 1e-5;

fn config(tag: &str, model: &str, layout: &str, steps: usize) -> TrainConfig {
    let mut c = lora_run_config(
        tag,
        &fixture(model).display().to_string(),
        layout,
        steps,
        1e-2,
    );
    c.lora.lora_rank = Some(4);
    c
}

/// The adapters a finished run wrote (`<out_dir>/adapter`, PEFT's format).
fn trained_adapters(cfg: &TrainConfig) -> Adapters {
    let (model, _) = hf::load_model(&fixture_of(cfg)).unwrap();
    Adapters::load_peft(&cfg.checkpointing.out_dir.join("adapter"), &model).unwrap()
}

fn fixture_of(cfg: &TrainConfig) -> PathBuf {
    PathBuf::from(&cfg.input.model)
}

fn losses(cfg: &TrainConfig) -> Vec<f64> {
    metric_losses(&cfg.checkpointing.out_dir)
}

fn assert_close(a: &ParamStore, b: &ParamStore, tol: f64, what: &str) {
    assert_eq!(a.specs, b.specs, "{what}");
    for (s, (x, y)) in a.specs.iter().zip(a.tensors.iter().zip(&b.tensors)) {
        let e = rel_err(x, y);
        assert!(e <= tol, "{what}: {} differs by {e:.2e}", s.name);
    }
}

#[test]
fn a_lora_run_trains_only_the_adapters_and_writes_peft_and_merged_models() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let cfg = {
            let mut c = config(&format!("run-{model}"), model, "", 20);
            c.logging.eval_every = 10;
            c
        };
        let summary = train(&cfg, &mut |_| {}).unwrap();
        let (first, last) = (
            summary.initial_val_loss.unwrap(),
            summary.final_val_loss.unwrap(),
        );
        println!("{model}: LoRA val loss {first} -> {last}");
        assert!(last < first - 0.1, "{model}: {first} -> {last}");
        let (mcfg, base) = hf::load_model(&fixture(model)).unwrap();
        let adapters = trained_adapters(&cfg);
        assert_eq!(summary.trained_params, adapters.params.numel());
        assert!(summary.trained_params < summary.num_params / 5);
        // The merged model is the base plus (alpha/r)·B·A on the targets and the base elsewhere.
        let (_, merged) = hf::load_model(&summary.model_dir).unwrap();
        assert_eq!(merged, adapters.merge(&mcfg, &base).unwrap());
        for (s, (m, b)) in merged
            .specs
            .iter()
            .zip(merged.tensors.iter().zip(&base.tensors))
        {
            let target = adapters.config.target_of_weight(&mcfg, &s.name).is_some();
            assert_eq!(m == b, !target, "{model}: {}", s.name);
        }
        // The last validation loss is the merged model's.
        let batches = data::validation_batches(
            &data::TokenSplit::new(
                {
                    let path = fixture(model).join("tokenizer.json");
                    let tok = data::load_tokenizer(&path).unwrap();
                    let framing = data::DocumentFraming::for_tokenizer(&tok, &path).unwrap();
                    data::encode_documents(
                        &tok,
                        &framing,
                        &data::read_corpus(&cfg.input.data).unwrap(),
                    )
                    .unwrap()
                },
                cfg.input.val_fraction,
                cfg.input.seq_len,
            )
            .unwrap()
            .val,
            cfg.input.seq_len,
            cfg.optimizer.batch_size,
            cfg.logging.eval_batches,
        );
        let tf = Trained::full(&merged).unsplit(&mcfg);
        let be = CpuBackend::default();
        let (mut sum, mut n) = (0.0, 0);
        for b in &batches {
            sum += tf.loss(&be, &merged, b) * b.predicted_tokens() as f64;
            n += b.predicted_tokens();
        }
        let merged_loss = sum / n as f64;
        assert!(
            (merged_loss - last).abs() / last < 1e-5,
            "{model}: merged model's loss {merged_loss} vs the run's {last}"
        );
    }
}

/// A run from PEFT's reference adapters (random `B`): every gradient is well away from zero from
/// the first step, where Adam's `g / (√v + eps)` would turn f32 rounding into visible differences
/// (a fresh adapter's `A` gets exactly zero gradient at step 0 and a tiny one at step 1).
fn from_reference(tag: &str, layout: &str, steps: usize) -> TrainConfig {
    {
        let mut c = config(tag, "llama_tiny", layout, steps);
        c.lora.lora_rank = None;
        c.lora.adapter = Some(fixture("lora").join("llama_tiny"));
        c.optimizer.lr = 3e-3;
        c
    }
}

#[test]
fn every_layout_trains_the_same_adapters() {
    let steps = 4;
    let unsplit = from_reference("layout-unsplit", "mbs=2", steps);
    train(&unsplit, &mut |_| {}).unwrap();
    let want = trained_adapters(&unsplit);
    for layout in [
        "tp=2,sp=true,mbs=2",
        "pp=2,schedule=zbh1,mbs=2",
        "dp=2,zero=1,mbs=2",
        "dp=2,tp=2,pp=2,zero=3,mbs=1",
    ] {
        let tag = layout.replace([',', '='], "-");
        let cfg = from_reference(&format!("layout-{tag}"), layout, steps);
        train(&cfg, &mut |_| {}).unwrap();
        for (step, (a, b)) in losses(&cfg).iter().zip(losses(&unsplit)).enumerate() {
            assert!((a - b).abs() / b <= TOL, "{layout} step {step}: {a} vs {b}");
        }
        assert_close(&trained_adapters(&cfg).params, &want.params, TOL, layout);
    }
}

#[test]
fn a_loaded_peft_adapter_continues_exactly_as_the_one_in_memory() {
    // Run A starts from fresh adapters made in memory; run B from the same adapters written as a
    // PEFT directory and loaded back.
    let a = config("continue-a", "gpt2_tiny", "dp=2,mbs=2", 5);
    let (mcfg, _) = hf::load_model(&fixture("gpt2_tiny")).unwrap();
    let lora = ferrotron_core::model::LoraConfig::new(&mcfg, 4, 8.0, &[]).unwrap();
    let fresh = Adapters::init(&mcfg, lora, a.input.seed);
    let dir = temp_dir("continue-peft");
    fresh.save_peft(&dir, &mcfg, None).unwrap();
    let loaded = Adapters::load_peft(&dir, &mcfg).unwrap();
    assert_eq!(loaded.params, fresh.params, "the PEFT round trip is exact");
    train(&a, &mut |_| {}).unwrap();
    let b = {
        let mut c = config("continue-b", "gpt2_tiny", "dp=2,mbs=2", 5);
        c.lora.lora_rank = None;
        c.lora.adapter = Some(dir);
        c
    };
    train(&b, &mut |_| {}).unwrap();
    assert_eq!(losses(&a), losses(&b));
    assert_eq!(trained_adapters(&a).params, trained_adapters(&b).params);
}

#[test]
fn a_lora_checkpoint_resumes_exactly_on_its_layout_and_reshards_to_another() {
    // Five steps with a checkpoint after the third: the uninterrupted run, and where to resume.
    let full = {
        let mut c = from_reference("resume-full", "tp=2,pp=2,mbs=2", 5);
        c.checkpointing.checkpoint_every = 3;
        c
    };
    train(&full, &mut |_| {}).unwrap();
    let want = trained_adapters(&full);
    let ck = full
        .checkpointing
        .out_dir
        .join("checkpoints")
        .join("step-000003");
    let manifest = Checkpoint::open(&ck).unwrap().manifest;
    assert_eq!(manifest.lora.as_ref().map(|l| l.rank), Some(4));
    assert_eq!(manifest.tensors.len(), want.params.specs.len());
    for layout in ["tp=2,pp=2,mbs=2", "dp=2,zero=2,mbs=2"] {
        let tag = layout.replace([',', '='], "-");
        let resumed = {
            let mut c = from_reference(&format!("resumed-{tag}"), layout, 5);
            c.checkpointing.resume = Some(ck.clone());
            c.lora.adapter = None;
            c
        };
        train(&resumed, &mut |_| {}).unwrap();
        let got = trained_adapters(&resumed);
        if layout == "tp=2,pp=2,mbs=2" {
            assert_eq!(got.params, want.params, "same-layout resume is bitwise");
        } else {
            assert_close(&got.params, &want.params, TOL, layout);
        }
    }
    // Resharded offline, the checkpoint holds the same adapters.
    let out = temp_dir("resharded");
    let layout = ferrotron_core::layout::LayoutSpec::parse("dp=2,tp=2,zero=1")
        .unwrap()
        .layout;
    let written = checkpoint::reshard(&ck, &layout, &out, false).unwrap();
    let (a, b) = (
        Checkpoint::open(&ck).unwrap(),
        Checkpoint::open(&written).unwrap(),
    );
    assert_eq!(a.params().unwrap(), b.params().unwrap());
    // Resuming adapters and starting from a PEFT adapter at once is ambiguous: refused.
    let both = {
        let mut c = config("resume-both", "llama_tiny", "", 5);
        c.checkpointing.resume = Some(ck.clone());
        c.lora.adapter = Some(full.checkpointing.out_dir.join("adapter"));
        c.lora.lora_rank = None;
        c
    };
    let e = train(&both, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("--adapter and --resume"), "{e}");
}

#[test]
fn the_merged_export_reproduces_peft_s_merged_logits() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, base) = hf::load_model(&fixture(model)).unwrap();
        let adapters = Adapters::load_peft(&fixture("lora").join(model), &cfg).unwrap();
        let reference = Reference::lora(model);
        let dir = temp_dir(&format!("merged-{model}"));
        hf::save_model(
            &dir,
            &cfg,
            &adapters.merge(&cfg, &base).unwrap(),
            hf::StorageDtype::F32,
        )
        .unwrap();
        let (mcfg, merged) = hf::load_model(&dir).unwrap();
        let logits = Trained::full(&merged)
            .unsplit(&mcfg)
            .forward(&CpuBackend::default(), &merged, &reference.batch)
            .logits;
        let e = rel_err(&logits, reference.get("merged_logits_f32"));
        println!("{model}: merged logits vs PEFT's merge_and_unload: {e:.2e}");
        assert!(e <= 1e-5, "{model}: merged logits rel err {e:.2e}");
        // The adapters with the base compute the same logits as the merged model.
        let unmerged = Trained::lora(&base, &adapters.config, &adapters.params)
            .unsplit(&cfg)
            .forward(&CpuBackend::default(), &adapters.params, &reference.batch)
            .logits;
        assert!(rel_err(&unmerged, &logits) <= 1e-5);
        // A PEFT export names every tensor as PEFT does.
        let out = temp_dir(&format!("peft-{model}"));
        adapters.save_peft(&out, &cfg, Some("base")).unwrap();
        let written = hf::read_tensors_f32(&out.join("adapter_model.safetensors")).unwrap();
        let original = hf::read_tensors_f32(
            &fixture("lora")
                .join(model)
                .join("adapter_model.safetensors"),
        )
        .unwrap();
        assert_eq!(written, original);
        assert!(written.keys().all(|k| k.starts_with(PEFT_PREFIX)));
    }
}

#[test]
fn lora_composes_with_mixed_precision_on_the_3d_mesh() {
    // bf16 keeps 8 significant bits (rounding 2⁻⁹ relative), fp16 11: a 16-bit base, adapters,
    // activations and transfers move five steps' losses by well under 0.5% of the f32 run's.
    let layout = "dp=2,tp=2,pp=2,zero=1,mbs=1";
    let f32_run = from_reference("mp-f32", layout, 5);
    train(&f32_run, &mut |_| {}).unwrap();
    for precision in ["bf16", "fp16"] {
        let cfg = {
            let mut c = from_reference(&format!("mp-{precision}"), layout, 5);
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

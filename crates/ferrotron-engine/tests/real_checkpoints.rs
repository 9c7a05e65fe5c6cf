//! The features real checkpoints carry, against transformers: RoPE scaling (llama3, yarn, linear,
//! dynamic), Qwen2's q/k/v biases, Llama's attention and MLP biases, Qwen3's per-head q/k norms and
//! sliding windows. Each tiny random model (`tests/fixtures/variants/`, made by
//! `make_variant_references.py`) is checked on one device, tp=2 (with and without sequence
//! parallelism) and pp=2, and each reference is one where dropping the feature moves some gradient
//! by more than 1e-3, so a dropped feature fails the test.

mod common;

use common::*;
use ferrotron_core::layout::{Layout, LayoutSpec, Schedule};
use ferrotron_core::model::{ModelConfig, RopeScaling, PEFT_PREFIX};
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::parallel::pipeline_step;
use ferrotron_engine::runtime::layout_step_of;
use ferrotron_engine::transformer::{ParamStore, Trained, Transformer};
use std::time::Duration;

/// f32 against transformers' f32, summed in other orders: relative error per tensor.
const TOL: f64 = 1e-5;
/// What dropping a feature must move some gradient by, at least.
const FEATURE_MATTERS: f64 = 1e-3;

const VARIANTS: &[&str] = &[
    "llama3_rope",
    "linear_rope",
    "dynamic_rope",
    "yarn_rope",
    "llama_bias",
    "qwen2_window",
    "qwen3_qk_norm",
    "mistral_window",
];

fn load(name: &str) -> (ModelConfig, ParamStore, Reference) {
    let dir = fixture("variants").join(name);
    let (cfg, params) = hf::load_model(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference = Reference::from_file(dir.join("reference_grads.safetensors"));
    (cfg, params, reference)
}

fn check(what: &str, loss: f64, grads: &ParamStore, reference: &Reference) {
    let want = reference.get("loss_f32")[0] as f64;
    let e = (loss - want).abs() / want.abs();
    assert!(
        e <= TOL,
        "{what}: loss {loss} vs transformers {want} ({e:e})"
    );
    let (name, worst) = worst_grad_err(grads, reference);
    assert!(worst <= TOL, "{what}: {name} vs transformers {worst:e}");
}

#[test]
fn every_feature_matches_transformers_on_one_device() {
    for name in VARIANTS {
        let (cfg, params, reference) = load(name);
        let (loss, grads) = unsplit(&cfg, &params, &reference.batch);
        check(name, loss, &grads, &reference);
        let logits = Transformer::new(&cfg, &params)
            .forward(&CpuBackend::default(), &params, &reference.batch)
            .logits;
        let e = rel_err(&logits, reference.get("logits_f32"));
        assert!(e <= TOL, "{name}: logits vs transformers {e:e}");
    }
}

#[test]
fn every_feature_matches_transformers_split_over_tensor_and_pipeline_parallelism() {
    let layouts = [
        Layout {
            tp: 2,
            ..Layout::default()
        },
        Layout {
            tp: 2,
            sequence_parallel: true,
            ..Layout::default()
        },
        Layout {
            pp: 2,
            micro_batch_size: 1,
            schedule: Schedule::OneFOneB,
            ..Layout::default()
        },
    ];
    for name in VARIANTS {
        let (cfg, params, reference) = load(name);
        for l in &layouts {
            let l = Layout {
                micro_batch_size: if l.pp > 1 { 1 } else { reference.batch.batch },
                ..*l
            };
            let part = StagePartition::for_model(&cfg, l.pp * l.vpp).unwrap();
            let r = pipeline_step(
                &cfg,
                &params,
                &reference.batch,
                &l,
                &part,
                Duration::from_secs(60),
            )
            .unwrap_or_else(|e| panic!("{name} {l}: {e}"));
            check(&format!("{name} {l}"), r.loss, &r.grads, &reference);
        }
    }
}

/// The model as an implementation that ignored the feature would compute it.
fn without_feature(
    name: &str,
    cfg: &ModelConfig,
    params: &ParamStore,
) -> (ModelConfig, ParamStore) {
    let (mut cfg, mut params) = (cfg.clone(), params.clone());
    match name {
        "llama3_rope" | "linear_rope" | "yarn_rope" => cfg.rope_scaling = RopeScaling::Default,
        "dynamic_rope" => {
            // Unscaled frequencies carried past the positions the model was trained on.
            cfg.rope_scaling = RopeScaling::Default;
            cfg.max_position_embeddings = 64;
        }
        "llama_bias" => {
            for (spec, t) in params.specs.iter().zip(params.tensors.iter_mut()) {
                if spec.name.ends_with(".bias") {
                    t.iter_mut().for_each(|x| *x = 0.0);
                }
            }
        }
        "qwen2_window" | "mistral_window" => cfg.sliding_window = None,
        "qwen3_qk_norm" => {
            for (spec, t) in params.specs.iter().zip(params.tensors.iter_mut()) {
                if spec.name.ends_with("q_norm.weight") || spec.name.ends_with("k_norm.weight") {
                    t.iter_mut().for_each(|x| *x = 1.0);
                }
            }
        }
        other => panic!("no way to drop the feature of {other}"),
    }
    (cfg, params)
}

#[test]
fn dropping_any_feature_moves_some_gradient_past_the_tolerance() {
    for name in VARIANTS {
        let (cfg, params, reference) = load(name);
        let (cfg, params) = without_feature(name, &cfg, &params);
        let (_, grads) = unsplit(&cfg, &params, &reference.batch);
        let (tensor, worst) = worst_grad_err(&grads, &reference);
        assert!(
            worst > FEATURE_MATTERS,
            "{name}: without the feature the worst gradient ({tensor}) is only {worst:e} off"
        );
    }
}

#[test]
fn rope_tables_use_the_scaled_frequencies() {
    // The dynamic model's sequences (64) are longer than its positions (32): its table must follow
    // the sequence, and the batch must be accepted.
    let (cfg, _, reference) = load("dynamic_rope");
    assert_eq!(cfg.max_position_embeddings, 32);
    assert!(reference.batch.check(&cfg).is_ok());
    let (llama, _, _) = load("llama3_rope");
    assert!(matches!(llama.rope_scaling, RopeScaling::Llama3 { .. }));
}

/// An export carries every feature: written as a Hugging Face directory and read back, the model
/// is the same function (same config, same loss). The exports stay in the temporary directory
/// (`ferrotron-variant-exports/<name>`), where `scripts/check_hf_export.py DIR BINARY` checks that
/// transformers loads each one with the same loss and gradients.
#[test]
fn exports_carry_every_feature() {
    let root = std::env::temp_dir().join("ferrotron-variant-exports");
    for name in VARIANTS {
        let (cfg, params, reference) = load(name);
        let dir = root.join(name);
        hf::save_model(&dir, &cfg, &params, hf::StorageDtype::F32).unwrap();
        let (back, back_params) = hf::load_model(&dir).unwrap();
        assert_eq!(back, cfg, "{name}: the config read back differs");
        let (loss, _) = unsplit(&back, &back_params, &reference.batch);
        let (want, _) = unsplit(&cfg, &params, &reference.batch);
        assert_eq!(
            loss, want,
            "{name}: the exported model computes another loss"
        );
    }
}

/// LoRA beside biased projections (Qwen2's q/k/v, with a sliding window) against PEFT's own
/// adapters (`variants/lora/qwen2_window`, made by `make_lora_reference.py`): the loss and every
/// adapter gradient, on one device, tp=2 with sequence parallelism and pp=2.
#[test]
fn lora_on_biased_projections_matches_peft() {
    let (cfg, base, _) = load("qwen2_window");
    let dir = fixture("variants/lora/qwen2_window");
    let adapters = Adapters::load_peft(&dir, &cfg).unwrap();
    let reference = Reference::from_file(dir.join("lora_reference.safetensors"));
    for layout in ["tp=1", "tp=2,sp=true", "pp=2,mbs=1"] {
        let l = LayoutSpec::parse(layout).unwrap().layout;
        let trained = Trained::lora(&base, &adapters.config, &adapters.params);
        let (loss, grads, _) =
            layout_step_of(&cfg, trained, &reference.batch, &l, &CpuBackend::default())
                .unwrap_or_else(|e| panic!("{layout}: {e}"));
        assert_eq!(grads.specs.len(), adapters.params.specs.len());
        let want = reference.get("loss_f32")[0] as f64;
        let e = (loss - want).abs() / want;
        assert!(
            e <= TOL,
            "LoRA {layout}: loss {loss} vs PEFT {want} ({e:e})"
        );
        for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
            let name = format!("grad_f32.{PEFT_PREFIX}{}", spec.name);
            let e = rel_err(g, reference.get(&name));
            assert!(e <= TOL, "LoRA {layout}: {} vs PEFT {e:e}", spec.name);
        }
    }
}

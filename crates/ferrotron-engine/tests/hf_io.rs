//! Hugging Face directories: round trips, bf16 storage, sharded checkpoints, and clear errors.

mod common;

use common::*;
use ferrotron_engine::hf::{self, StorageDtype};
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::transformer::Transformer;
use std::path::Path;

#[test]
fn save_then_load_gives_bit_identical_logits() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let dir = temp_dir(&format!("roundtrip-{model}"));
        hf::save_model(&dir, &cfg, &params, StorageDtype::F32).unwrap();
        let (cfg2, params2) = hf::load_model(&dir).unwrap();
        assert_eq!(cfg, cfg2);
        assert_eq!(params, params2);
        let batch = Reference::load(model).batch;
        let be = CpuBackend::default();
        let a = Transformer::new(&cfg, &params)
            .forward(&be, &params, &batch)
            .logits;
        let b = Transformer::new(&cfg2, &params2)
            .forward(&be, &params2, &batch)
            .logits;
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{model}: logits differ"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}

/// bf16 keeps 8 significant bits: each stored weight moves by at most u = 2⁻⁹ ≈ 2e-3 relative.
/// Loss and gradients are smooth in the weights, so their relative change is a small multiple of
/// u. We allow 8u = 1.6e-2 per gradient tensor and 2u for the loss (measured: see the test output),
/// and check separately that the bf16 file loads to exactly the bf16-rounded values, so the only
/// difference from the f32 run is that rounding.
#[test]
fn bf16_stored_weights_load_exactly_and_stay_close_to_pytorch() {
    let u = 2f64.powi(-9);
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let dir = temp_dir(&format!("bf16-{model}"));
        hf::save_model(&dir, &cfg, &params, StorageDtype::Bf16).unwrap();
        let (_, p16) = hf::load_model(&dir).unwrap();
        for (a, b) in params.tensors.iter().zip(&p16.tensors) {
            for (&x, &y) in a.iter().zip(b) {
                assert_eq!(half::bf16::from_f32(x).to_f32().to_bits(), y.to_bits());
            }
        }
        let reference = Reference::load(model);
        let mut grads = p16.zeros_like();
        let loss = Transformer::new(&cfg, &p16).forward_backward(
            &CpuBackend::default(),
            &p16,
            &mut grads,
            &reference.batch,
        );
        let ref_loss = reference.get("loss_f32")[0] as f64;
        let loss_err = (loss - ref_loss).abs() / ref_loss;
        let (worst_name, worst) = worst_grad_err(&grads, &reference);
        println!(
            "{model} bf16: loss rel err {loss_err:.2e}, worst gradient {worst_name} {worst:.2e}"
        );
        assert!(
            loss_err <= 2.0 * u,
            "{model}: bf16 loss rel err {loss_err:e}"
        );
        assert!(
            worst <= 8.0 * u,
            "{model}: bf16 gradient {worst_name} rel err {worst:e}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let dir = temp_dir("sharded");
    std::fs::copy(
        fixture("llama_tiny").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let (first, second): (Vec<_>, Vec<_>) = params
        .specs
        .iter()
        .zip(&params.tensors)
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let tensors: Vec<(String, Vec<usize>, &[f32])> = part
            .iter()
            .map(|(_, (s, t))| (s.name.clone(), s.shape.clone(), t.as_slice()))
            .collect();
        for (name, _, _) in &tensors {
            weight_map.insert(name.clone(), file.into());
        }
        hf::write_tensors(&dir.join(file), &tensors, StorageDtype::F16).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let (cfg2, loaded) = hf::load_model(&dir).unwrap();
    assert_eq!(cfg, cfg2);
    for (a, b) in params.tensors.iter().zip(&loaded.tensors) {
        assert!(a
            .iter()
            .zip(b)
            .all(|(&x, &y)| half::f16::from_f32(x).to_f32() == y));
    }
    // An index that names a file outside the model directory is refused, though the file is there.
    let outside = dir.parent().unwrap().join(format!(
        "ferrotron-outside-{}.safetensors",
        std::process::id()
    ));
    std::fs::rename(dir.join("model-00002-of-00002.safetensors"), &outside).unwrap();
    let escaped = index.to_string().replace(
        "model-00002-of-00002.safetensors",
        &format!("../{}", outside.file_name().unwrap().to_str().unwrap()),
    );
    std::fs::write(dir.join("model.safetensors.index.json"), escaped).unwrap();
    let e = hf::load_model(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("must lie inside"),
        "{e}"
    );
    std::fs::remove_file(outside).ok();
    std::fs::remove_dir_all(dir).ok();
}

fn load_err(dir: &Path) -> String {
    hf::load_model(dir).unwrap_err().to_string()
}

#[test]
fn bad_model_directories_give_errors_naming_file_and_field() {
    let src = fixture("llama_tiny");
    let dir = temp_dir("bad");
    // Missing config.json.
    let e = load_err(&dir);
    assert!(e.contains("config.json"), "{e}");
    // Malformed config.json.
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("JSON"), "{e}");
    // Unknown model_type.
    std::fs::write(dir.join("config.json"), r#"{"model_type": "t5"}"#).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("model_type") && e.contains("t5"),
        "{e}"
    );
    // A field of the wrong type.
    let cfg_text = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg_text.replace("\"hidden_size\": 64", "\"hidden_size\": \"64\""),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("hidden_size"), "{e}");
    // Heads that do not divide: 4 heads, 3 KV heads.
    std::fs::write(
        dir.join("config.json"),
        cfg_text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("num_key_value_heads"), "{e}");
    // No weights at all.
    std::fs::write(dir.join("config.json"), &cfg_text).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors"), "{e}");
    // A tensor missing.
    let (_, params) = hf::load_model(&src).unwrap();
    let keep: Vec<(String, Vec<usize>, &[f32])> = params
        .specs
        .iter()
        .zip(&params.tensors)
        .filter(|(s, _)| s.name != "model.layers.2.mlp.up_proj.weight")
        .map(|(s, t)| (s.name.clone(), s.shape.clone(), t.as_slice()))
        .collect();
    hf::write_tensors(&dir.join("model.safetensors"), &keep, StorageDtype::F32).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.layers.2.mlp.up_proj.weight")
            && e.contains("missing"),
        "{e}"
    );
    // A tensor of the wrong shape.
    let mut wrong: Vec<(String, Vec<usize>, &[f32])> = params
        .specs
        .iter()
        .zip(&params.tensors)
        .map(|(s, t)| (s.name.clone(), s.shape.clone(), t.as_slice()))
        .collect();
    let i = wrong
        .iter()
        .position(|t| t.0 == "model.norm.weight")
        .unwrap();
    wrong[i].1 = vec![8, 8];
    hf::write_tensors(&dir.join("model.safetensors"), &wrong, StorageDtype::F32).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.norm.weight") && e.contains("[8, 8]") && e.contains("[64]"),
        "{e}"
    );
    // Not a safetensors file at all.
    std::fs::write(dir.join("model.safetensors"), b"garbage").unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).ok();
}

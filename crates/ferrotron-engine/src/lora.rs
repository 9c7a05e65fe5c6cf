//! LoRA adapters as data: fresh ones (PEFT's initialisation), PEFT adapter directories in and out
//! (`adapter_config.json` + `adapter_model.safetensors`, tensors named as PEFT names them), and the
//! merged model `W + (alpha/r)·B·A`. The arithmetic of training them is the executor's
//! (`transformer`); which devices hold which half is the tensor-parallel layer's.
//!
//! ferrotron's LoRA has no dropout (PEFT's `lora_dropout = 0`): an adapter configured with dropout
//! is refused rather than trained differently.

use crate::error::{EngineError, Result};
use crate::hf;
use crate::transformer::ParamStore;
use ferrotron_core::model::{
    adapter_parts, AdapterHalf, Arch, LoraConfig, ModelConfig, WeightLayout, PEFT_PREFIX,
};
use rand::{Rng, SeedableRng};
use std::path::Path;

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// A model's LoRA adapters: their configuration and their tensors (in
/// [`LoraConfig::adapter_specs`] order, by their names less PEFT's `base_model.model.` prefix).
#[derive(Debug, Clone)]
pub struct Adapters {
    pub config: LoraConfig,
    pub params: ParamStore,
}

impl Adapters {
    /// Fresh adapters as PEFT initialises them: `A` Kaiming-uniform (`a = √5`, so uniform in
    /// ±1/√in), `B` zero — the adapted model starts as the base. Deterministic in `seed`.
    pub fn init(cfg: &ModelConfig, config: LoraConfig, seed: u64) -> Self {
        let mut params = ParamStore::zeros(config.adapter_specs(cfg));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x10_4a);
        for (spec, t) in params.specs.iter().zip(params.tensors.iter_mut()) {
            if let Some((_, AdapterHalf::A)) = adapter_parts(&spec.name) {
                let bound = 1.0 / (spec.shape[1] as f32).sqrt();
                t.iter_mut()
                    .for_each(|x| *x = rng.gen_range(-bound..=bound));
            }
        }
        Self { config, params }
    }

    /// Reads a PEFT adapter directory for `cfg`'s model, refusing what ferrotron's LoRA does not
    /// implement (another PEFT method, dropout, DoRA, rsLoRA, biases, per-module ranks, extra
    /// trained modules) and any tensor that is missing, misshapen or not an adapter, naming it.
    pub fn load_peft(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        // A local directory or an `s3://` prefix.
        let dir = crate::storage::Location::parse(&dir.to_string_lossy())?;
        let config_at = dir.join(ADAPTER_CONFIG);
        let config_path = config_at.as_error_path();
        let text = String::from_utf8(config_at.read(ferrotron_core::bounded::SETTINGS)?)
            .map_err(|_| EngineError::format(&config_path, "not UTF-8 text"))?;
        let config =
            parse_peft_config(&text, cfg).map_err(|msg| EngineError::format(&config_path, msg))?;
        let weights_at = dir.join(ADAPTER_WEIGHTS);
        let weights = weights_at.as_error_path();
        let mut tensors = hf::read_tensors_f32_at(&weights_at)?;
        let specs = config.adapter_specs(cfg);
        let mut params = ParamStore::zeros(specs);
        for (spec, t) in params.specs.iter().zip(params.tensors.iter_mut()) {
            let key = format!("{PEFT_PREFIX}{}", spec.name);
            let (shape, data) = tensors
                .remove(&key)
                .ok_or_else(|| EngineError::MissingTensor {
                    file: weights.clone(),
                    name: key.clone(),
                })?;
            if shape != spec.shape {
                return Err(EngineError::Shape {
                    file: weights.clone(),
                    name: key,
                    expected: spec.shape.clone(),
                    found: shape,
                });
            }
            *t = data;
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(EngineError::format(
                &weights,
                format!(
                    "tensor `{extra}` is not a LoRA adapter of the configured targets ({}) of \
                     this {:?} model",
                    config.targets.join(", "),
                    cfg.arch
                ),
            ));
        }
        Ok(Self { config, params })
    }

    /// Writes a PEFT adapter directory (`peft.PeftModel.from_pretrained` loads it onto the base
    /// model `base_model`, recorded as PEFT records it).
    pub fn save_peft(&self, dir: &Path, cfg: &ModelConfig, base_model: Option<&str>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
        let c = &self.config;
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": c.rank,
            "lora_alpha": c.alpha,
            "target_modules": c.targets,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": cfg.arch == Arch::Gpt2,
            "use_dora": false,
            "use_rslora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "init_lora_weights": true,
            "inference_mode": true,
            "revision": null,
        });
        let text = serde_json::to_string_pretty(&config).expect("a config serialises");
        hf::write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())?;
        let tensors: Vec<(String, Vec<usize>, &[f32])> = self
            .params
            .specs
            .iter()
            .zip(&self.params.tensors)
            .map(|(s, t)| (format!("{PEFT_PREFIX}{}", s.name), s.shape.clone(), &t[..]))
            .collect();
        hf::write_tensors(&dir.join(ADAPTER_WEIGHTS), &tensors, hf::StorageDtype::F32)
    }

    /// The base with every adapter merged in: `W + (alpha/r)·B·A` for each target (in the base's
    /// own layout: GPT-2's Conv1D weights are `[in, out]`).
    pub fn merge(&self, cfg: &ModelConfig, base: &ParamStore) -> Result<ParamStore> {
        // A QLoRA base merges as PEFT's `merge_and_unload` does on a 4-bit base: dequantized, then
        // the scaled product added (kept in f32 here, not quantized again).
        let mut merged = base.dequantized();
        let scale = self.config.scale() as f64;
        let r = self.config.rank;
        for t in self.config.modules(cfg) {
            let get = |half| {
                self.params.get(&t.adapter_name(half)).ok_or_else(|| {
                    EngineError::Invalid(format!("adapters lack {}", t.adapter_name(half)))
                })
            };
            let (a, b) = (get(AdapterHalf::A)?, get(AdapterHalf::B)?);
            let id = merged.id(&t.weight_name()).ok_or_else(|| {
                EngineError::Invalid(format!("the base lacks {}", t.weight_name()))
            })?;
            let layout = merged.specs[id].layout;
            let w = &mut merged.tensors[id];
            for o in 0..t.out_dim {
                for i in 0..t.in_dim {
                    let delta: f64 = (0..r)
                        .map(|k| b[o * r + k] as f64 * a[k * t.in_dim + i] as f64)
                        .sum();
                    let at = match layout {
                        WeightLayout::InOut => i * t.out_dim + o,
                        _ => o * t.in_dim + i,
                    };
                    w[at] = (w[at] as f64 + scale * delta) as f32;
                }
            }
        }
        Ok(merged)
    }
}

/// A PEFT `adapter_config.json` as a [`LoraConfig`] for `cfg`, or why it cannot be one.
fn parse_peft_config(text: &str, cfg: &ModelConfig) -> std::result::Result<LoraConfig, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    let peft_type = field("peft_type").and_then(|x| x.as_str()).unwrap_or("");
    if peft_type != "LORA" {
        return Err(format!(
            "`peft_type` is `{peft_type}`: ferrotron loads LoRA adapters (`LORA`)"
        ));
    }
    let rank = field("r")
        .and_then(|x| x.as_u64())
        .ok_or("field `r` (the rank) is missing or not a positive integer")?;
    let alpha = field("lora_alpha")
        .and_then(|x| x.as_f64())
        .ok_or("field `lora_alpha` is missing or not a number")?;
    let dropout = field("lora_dropout")
        .and_then(|x| x.as_f64())
        .unwrap_or(0.0);
    if dropout != 0.0 {
        return Err(format!(
            "`lora_dropout` is {dropout}: ferrotron trains LoRA without dropout (set it to 0)"
        ));
    }
    let refuse_true = |k: &str, what: &str| match field(k).and_then(|x| x.as_bool()) {
        Some(true) => Err(format!("`{k}` is true: {what} is not implemented")),
        _ => Ok(()),
    };
    refuse_true("use_dora", "DoRA")?;
    refuse_true("use_rslora", "rank-stabilised LoRA (scale alpha/√r)")?;
    if let Some(b) = field("bias").and_then(|x| x.as_str()) {
        if b != "none" {
            return Err(format!(
                "`bias` is `{b}`: only the adapters train (bias `none`)"
            ));
        }
    }
    for k in [
        "modules_to_save",
        "layers_to_transform",
        "rank_pattern",
        "alpha_pattern",
        "target_parameters",
    ] {
        let set = match field(k) {
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(serde_json::Value::Object(o)) => !o.is_empty(),
            Some(_) => true,
            None => false,
        };
        if set {
            return Err(format!(
                "`{k}` is set: ferrotron trains one rank and alpha on whole projections only"
            ));
        }
    }
    let targets: Vec<String> = match field("target_modules") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| "`target_modules` holds a non-string".to_string())
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(serde_json::Value::String(s)) => {
            return Err(format!(
                "`target_modules` is the pattern `{s}`: list the projections instead \
                 (e.g. [\"q_proj\", \"v_proj\"])"
            ))
        }
        _ => return Err("field `target_modules` is missing".into()),
    };
    if targets.is_empty() {
        // An empty list would read as "every projection" further on: an adapter that adapts
        // nothing is not what the file says either.
        return Err(
            "`target_modules` is empty: an adapter must name the projections it adapts".into(),
        );
    }
    let rank = usize::try_from(rank).map_err(|_| "field `r` is too large".to_string())?;
    LoraConfig::new(cfg, rank, alpha, &targets).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::model::preset;

    #[test]
    fn peft_configs_ferrotron_cannot_train_are_refused_by_name() {
        let cfg = preset("llama-tiny").unwrap();
        let ok = r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj","v_proj"],"lora_dropout":0.0,"bias":"none"}"#;
        let c = parse_peft_config(ok, &cfg).unwrap();
        assert_eq!((c.rank, c.alpha, c.targets.len()), (4, 8.0, 2));
        for (patch, want) in [
            (r#""lora_dropout":0.1"#, "lora_dropout"),
            (r#""use_dora":true"#, "DoRA"),
            (r#""bias":"all""#, "bias"),
            (r#""modules_to_save":["lm_head"]"#, "modules_to_save"),
            (r#""target_modules":"all-linear""#, "pattern"),
            (r#""target_modules":["embed_tokens"]"#, "embed_tokens"),
            (r#""target_modules":[]"#, "`target_modules` is empty"),
            (r#""peft_type":"IA3""#, "IA3"),
        ] {
            let key = patch.split(':').next().unwrap();
            let mut v: serde_json::Value = serde_json::from_str(ok).unwrap();
            let p: serde_json::Value = serde_json::from_str(&format!("{{{patch}}}")).unwrap();
            v[key.trim_matches('"')] = p[key.trim_matches('"')].clone();
            let e = parse_peft_config(&v.to_string(), &cfg).unwrap_err();
            assert!(e.contains(want), "{patch}: {e}");
        }
    }

    #[test]
    fn fresh_adapters_leave_the_model_unchanged_and_merge_adds_b_times_a() {
        let cfg = preset("gpt2-tiny").unwrap();
        let base = ParamStore::init_random(&cfg, 1);
        let lora = LoraConfig::new(&cfg, 2, 4.0, &[]).unwrap();
        let fresh = Adapters::init(&cfg, lora.clone(), 0);
        assert_eq!(fresh.merge(&cfg, &base).unwrap(), base);
        let mut ad = fresh;
        for t in ad.params.tensors.iter_mut() {
            t.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = 0.01 * (i % 7) as f32);
        }
        let merged = ad.merge(&cfg, &base).unwrap();
        // One element of a Conv1D weight ([in, out]): W[i][o] + (alpha/r)·Σ_k B[o][k]·A[k][i].
        let name = "transformer.h.0.mlp.c_fc";
        let (a, b) = (
            ad.params.get(&format!("{name}.lora_A.weight")).unwrap(),
            ad.params.get(&format!("{name}.lora_B.weight")).unwrap(),
        );
        let (i, o, inn, out) = (3, 5, cfg.hidden_size, cfg.intermediate_size);
        let want = base.get(&format!("{name}.weight")).unwrap()[i * out + o]
            + 2.0 * (b[o * 2] * a[i] + b[o * 2 + 1] * a[inn + i]);
        let got = merged.get(&format!("{name}.weight")).unwrap()[i * out + o];
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}

//! Hugging Face `config.json`, read and written. Every key that transformers' implementation of a
//! family reads is either implemented here or refused by name, and so is every key this module does
//! not know: a checkpoint never trains silently as a different function.

mod keys;
mod rope;

use super::config::{
    Arch, Family, ModelConfig, MoeConfig, ProjectionBias, SlidingWindow, MAX_DIMENSION,
};
use crate::error::{ConfigError, Result};
use keys::{family_keys, FAMILIES, INERT_EVERYWHERE, LLAMA_SHAPE};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

impl ModelConfig {
    /// Reads a Hugging Face `config.json`. Every error names the file and the field.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text =
            crate::bounded::read_to_string(path, crate::bounded::SETTINGS).map_err(|source| {
                ConfigError::Io {
                    file: path.to_path_buf(),
                    source,
                }
            })?;
        Self::from_hf_json(&text, path)
    }

    pub fn from_hf_json(text: &str, file: &Path) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            file: file.to_path_buf(),
            msg: e.to_string(),
        })?;
        let obj = v.as_object().ok_or_else(|| ConfigError::Json {
            file: file.to_path_buf(),
            msg: "expected a JSON object".into(),
        })?;
        let r = Reader {
            v: obj,
            file: file.to_path_buf(),
        };
        let model_type = r.string("model_type")?;
        let family = FAMILIES
            .iter()
            .copied()
            .find(|f| f.model_type() == model_type)
            .ok_or_else(|| {
                let known: Vec<_> = FAMILIES.iter().map(|f| f.model_type()).collect();
                r.field(
                    "model_type",
                    format!(
                        "unknown model_type `{model_type}` (supported: {})",
                        known.join(", ")
                    ),
                )
            })?;
        r.check_keys(family)?;
        let cfg = match family {
            Family::Gpt2 => r.gpt2()?,
            _ => r.llama_shaped(family)?,
        };
        cfg.validate().map_err(|msg| ConfigError::Field {
            file: file.to_path_buf(),
            field: msg.0,
            msg: msg.1,
        })?;
        Ok(cfg)
    }

    /// Writes a `config.json` that Hugging Face transformers loads as the same function.
    pub fn to_hf_json(&self) -> Value {
        let family = self.family();
        let mut v = match self.arch {
            Arch::Llama => {
                let mut rope = self.rope_scaling.to_hf_json();
                rope["rope_theta"] = self.rope_theta.into();
                serde_json::json!({
                    "vocab_size": self.vocab_size,
                    "hidden_size": self.hidden_size,
                    "intermediate_size": self.intermediate_size,
                    "num_hidden_layers": self.num_layers,
                    "num_attention_heads": self.num_heads,
                    "num_key_value_heads": self.num_kv_heads,
                    "head_dim": self.head_dim,
                    "max_position_embeddings": self.max_position_embeddings,
                    "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta,
                    "rope_parameters": rope,
                    "tie_word_embeddings": self.tie_word_embeddings,
                    "hidden_act": "silu",
                    "attention_dropout": 0.0,
                })
            }
            Arch::Gpt2 => serde_json::json!({
                "vocab_size": self.vocab_size,
                "n_embd": self.hidden_size,
                "n_inner": self.intermediate_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": "gelu_new",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": true,
            }),
        };
        let window = self.sliding_window;
        let extra = match family {
            Family::Llama => serde_json::json!({
                "attention_bias": self.bias.qkv,
                "mlp_bias": self.bias.mlp,
            }),
            Family::Mistral => serde_json::json!({ "sliding_window": window.map(|w| w.size) }),
            Family::Qwen2 | Family::Qwen3 => {
                let mut e = serde_json::json!({
                    "use_sliding_window": window.is_some(),
                    "sliding_window": window.map(|w| w.size),
                    "max_window_layers": window.map_or(self.num_layers, |w| w.first_layer),
                });
                if family == Family::Qwen3 {
                    e["attention_bias"] = self.bias.qkv.into();
                }
                e
            }
            Family::Mixtral => {
                let m = self.moe.as_ref().expect("a Mixtral has experts");
                serde_json::json!({
                    "sliding_window": window.map(|w| w.size),
                    "num_local_experts": m.num_experts,
                    "num_experts_per_tok": m.top_k,
                    "router_aux_loss_coef": m.aux_loss_coef,
                    "router_jitter_noise": 0.0,
                    "output_router_logits": true,
                })
            }
            Family::Qwen2Moe | Family::Qwen3Moe => {
                let m = self.moe.as_ref().expect("a Qwen-MoE has experts");
                let mut e = serde_json::json!({
                    "use_sliding_window": window.is_some(),
                    "sliding_window": window.map(|w| w.size),
                    "num_experts": m.num_experts,
                    "num_experts_per_tok": m.top_k,
                    "norm_topk_prob": m.norm_topk_prob,
                    "moe_intermediate_size": m.expert_size,
                    "decoder_sparse_step": m.sparse_step,
                    "mlp_only_layers": m.dense_layers,
                    "router_aux_loss_coef": m.aux_loss_coef,
                    "output_router_logits": true,
                });
                if family == Family::Qwen2Moe {
                    e["qkv_bias"] = self.bias.qkv.into();
                    e["shared_expert_intermediate_size"] = m.shared_expert_size.into();
                    e["max_window_layers"] =
                        window.map_or(self.num_layers, |w| w.first_layer).into();
                } else {
                    e["attention_bias"] = self.bias.qkv.into();
                }
                e
            }
            // The routing keys (`n_group`, `topk_group`, `routed_scaling_factor`, sigmoid scores)
            // are left to transformers' defaults, which are DeepSeek-V3's.
            Family::DeepseekV3 => {
                let m = self.moe.as_ref().expect("a DeepSeek-V3 has experts");
                let a = self
                    .latent_attention
                    .expect("a DeepSeek-V3 has latent attention");
                serde_json::json!({
                    "q_lora_rank": a.q_lora_rank,
                    "kv_lora_rank": a.kv_lora_rank,
                    "qk_nope_head_dim": self.head_dim - a.qk_rope_head_dim,
                    "qk_rope_head_dim": a.qk_rope_head_dim,
                    "v_head_dim": a.v_head_dim,
                    "n_routed_experts": m.num_experts,
                    "n_shared_experts": m.shared_expert_size / m.expert_size.max(1),
                    "num_experts_per_tok": m.top_k,
                    "moe_intermediate_size": m.expert_size,
                    "first_k_dense_replace": m.dense_layers.len(),
                    "norm_topk_prob": m.norm_topk_prob,
                })
            }
            Family::Gpt2 => serde_json::json!({}),
        };
        let o = v.as_object_mut().expect("an object");
        o.extend(extra.as_object().expect("an object").clone());
        o.insert(
            "architectures".into(),
            serde_json::json!([family.architecture()]),
        );
        o.insert("model_type".into(), family.model_type().into());
        o.insert("bos_token_id".into(), 0.into());
        o.insert("eos_token_id".into(), 0.into());
        o.insert("torch_dtype".into(), "float32".into());
        v
    }
}

struct Reader<'a> {
    v: &'a Map<String, Value>,
    file: PathBuf,
}

impl Reader<'_> {
    fn field(&self, field: &str, msg: String) -> ConfigError {
        ConfigError::Field {
            file: self.file.clone(),
            field: field.into(),
            msg,
        }
    }

    /// Every key is implemented, inert, or refused by name.
    fn check_keys(&self, family: Family) -> Result<()> {
        let (implemented, inert) = family_keys(family);
        let shape: &[&str] = if family == Family::Gpt2 {
            &[]
        } else {
            LLAMA_SHAPE
        };
        for key in self.v.keys() {
            let known = [shape, implemented, inert, INERT_EVERYWHERE]
                .iter()
                .any(|list| list.contains(&key.as_str()));
            if known {
                continue;
            }
            let msg = if key == "quantization_config" {
                "a quantized checkpoint is not supported: give ferrotron the unquantized model"
                    .into()
            } else {
                format!(
                    "ferrotron does not implement this key of model_type `{}`: it may change what \
                     the model computes, so the model is refused rather than trained as a different \
                     function (if transformers ignores it too, remove it from config.json)",
                    family.model_type()
                )
            };
            return Err(self.field(key, msg));
        }
        Ok(())
    }

    fn gpt2(&self) -> Result<ModelConfig> {
        let hidden = self.usize("n_embd")?;
        let heads = self.usize("n_head")?;
        if let Some(act) = self.opt_string("activation_function")? {
            if act != "gelu_new" && act != "gelu_pytorch_tanh" {
                return Err(self.field(
                    "activation_function",
                    format!("`{act}` is not supported (only gelu_new)"),
                ));
            }
        }
        self.require_bool("scale_attn_weights", true)?;
        self.require_bool("scale_attn_by_inverse_layer_idx", false)?;
        self.require_bool("add_cross_attention", false)?;
        let mut cfg = ModelConfig::gpt2(
            self.usize("vocab_size")?,
            hidden,
            self.opt_usize("n_inner")?.unwrap_or(4 * hidden),
            self.usize("n_layer")?,
            heads,
            self.usize("n_positions")?,
        );
        cfg.norm_eps = self.non_negative("layer_norm_epsilon", 1e-5)?;
        cfg.tie_word_embeddings = self.opt_bool("tie_word_embeddings")?.unwrap_or(true);
        Ok(cfg)
    }

    fn llama_shaped(&self, family: Family) -> Result<ModelConfig> {
        let hidden = self.usize("hidden_size")?;
        let heads = self.usize("num_attention_heads")?;
        let kv_heads = self.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        // Qwen3's head_dim defaults to 128, the others' to hidden / heads.
        let head_dim = match self.opt_usize("head_dim")? {
            Some(d) => d,
            None if family == Family::Qwen3 => 128,
            // Without `head_dim`, heads cut the hidden size: it must divide (and the head size it
            // gives is the hidden size's doing, so the error names that field).
            None if heads > 0 && hidden % heads != 0 => {
                return Err(self.field(
                    "hidden_size",
                    format!(
                        "{hidden} does not split into num_attention_heads = {heads} equal heads (there is no `head_dim`, so each head is hidden_size / heads wide): give a multiple of {heads}, or `head_dim`"
                    ),
                ))
            }
            None if heads > 0 && (hidden / heads) % 2 == 1 => {
                return Err(self.field(
                    "hidden_size",
                    format!(
                        "{hidden} / {heads} heads gives heads {} wide, and rotary embeddings need an even head size: give another hidden_size, or `head_dim`",
                        hidden / heads
                    ),
                ))
            }
            None => hidden / heads.max(1),
        };
        if let Some(act) = self.opt_string("hidden_act")? {
            if act != "silu" {
                return Err(self.field(
                    "hidden_act",
                    format!("`{act}` is not supported (only silu)"),
                ));
            }
        }
        if let Some(f) = self.opt_f64("partial_rotary_factor")? {
            if f != 1.0 {
                return Err(self.field(
                    "partial_rotary_factor",
                    format!("{f} is not implemented (only 1.0: every dimension rotated)"),
                ));
            }
        }
        let max_positions = self.opt_usize("max_position_embeddings")?.unwrap_or(2048);
        // transformers' defaults when the key is absent.
        let (default_theta, default_eps) = match family {
            Family::Mixtral => (1e6, 1e-5),
            _ => (10000.0, 1e-6),
        };
        let (rope_theta, rope_scaling) = self.rope(max_positions, default_theta)?;
        let num_layers = self.usize("num_hidden_layers")?;
        let attention_bias = self.opt_bool("attention_bias")?.unwrap_or(false);
        let bias = match family {
            Family::Llama => ProjectionBias {
                qkv: attention_bias,
                o: attention_bias,
                mlp: self.opt_bool("mlp_bias")?.unwrap_or(false),
            },
            // transformers' Qwen2 has q/k/v biases always, and none elsewhere.
            Family::Qwen2 => ProjectionBias {
                qkv: true,
                o: false,
                mlp: false,
            },
            Family::Qwen3 | Family::Qwen3Moe | Family::DeepseekV3 => ProjectionBias {
                qkv: attention_bias,
                o: attention_bias,
                mlp: false,
            },
            // transformers' Qwen2-MoE: q/k/v biases under `qkv_bias` (true by default), none else.
            Family::Qwen2Moe => ProjectionBias {
                qkv: self.opt_bool("qkv_bias")?.unwrap_or(true),
                o: false,
                mlp: false,
            },
            Family::Mistral | Family::Mixtral | Family::Gpt2 => ProjectionBias::default(),
        };
        Ok(ModelConfig {
            arch: Arch::Llama,
            vocab_size: self.usize("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: self.usize("intermediate_size")?,
            num_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            max_position_embeddings: max_positions,
            norm_eps: self.non_negative("rms_norm_eps", default_eps)?,
            rope_theta,
            tie_word_embeddings: self.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            family: Some(family),
            rope_scaling,
            bias,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            latent_attention: None,
            sliding_window: self.sliding_window(family, num_layers)?,
            moe: self.experts(family, num_layers)?,
        })
    }

    /// The experts of a mixture-of-experts family, with transformers' defaults: Mixtral's (8
    /// experts, 2 per token, coefficient 0.001, the top-k probabilities always renormalised, every
    /// block, experts as wide as `intermediate_size`) and Qwen3-MoE's (128 experts, 8 per token,
    /// `norm_topk_prob` false, `moe_intermediate_size` 768, every `decoder_sparse_step`-th block but
    /// `mlp_only_layers`).
    fn experts(&self, family: Family, layers: usize) -> Result<Option<Box<MoeConfig>>> {
        let coef = self.opt_f64("router_aux_loss_coef")?.unwrap_or(0.001);
        match family {
            Family::Mixtral => {
                if let Some(noise) = self.opt_f64("router_jitter_noise")? {
                    if noise != 0.0 {
                        return Err(self.field(
                            "router_jitter_noise",
                            format!(
                                "{noise} is not implemented (only 0: random noise on the router's \
                                 input in training)"
                            ),
                        ));
                    }
                }
                Ok(Some(Box::new(MoeConfig {
                    num_experts: self.opt_usize("num_local_experts")?.unwrap_or(8),
                    top_k: self.opt_usize("num_experts_per_tok")?.unwrap_or(2),
                    norm_topk_prob: true,
                    aux_loss_coef: coef,
                    expert_size: self.usize("intermediate_size")?,
                    sparse_step: 1,
                    dense_layers: Vec::new(),
                    shared_expert_size: 0,
                    held: Default::default(),
                    capacity_factor: None,
                })))
            }
            Family::Qwen2Moe | Family::Qwen3Moe => {
                let qwen2 = family == Family::Qwen2Moe;
                let dense_layers = match self.get("mlp_only_layers") {
                    None => Vec::new(),
                    Some(v) => v
                        .as_array()
                        .and_then(|a| {
                            a.iter()
                                .map(|x| x.as_u64().map(|n| n as usize))
                                .collect::<Option<Vec<usize>>>()
                        })
                        .filter(|l| l.iter().all(|&n| n < layers))
                        .ok_or_else(|| {
                            self.field(
                                "mlp_only_layers",
                                format!(
                                    "expected a list of layer indices below {layers}, found {v}"
                                ),
                            )
                        })?,
                };
                // transformers 5 writes the count as `num_local_experts`; published configs as
                // `num_experts`.
                let num_experts = match (
                    self.opt_usize("num_experts")?,
                    self.opt_usize("num_local_experts")?,
                ) {
                    (Some(a), Some(b)) if a != b => {
                        return Err(self.field(
                            "num_local_experts",
                            format!("{b}, and num_experts says {a}: give one of them"),
                        ))
                    }
                    (a, b) => a.or(b).unwrap_or(if qwen2 { 60 } else { 128 }),
                };
                Ok(Some(Box::new(MoeConfig {
                    num_experts,
                    top_k: self.opt_usize("num_experts_per_tok")?.unwrap_or(if qwen2 {
                        4
                    } else {
                        8
                    }),
                    norm_topk_prob: self.opt_bool("norm_topk_prob")?.unwrap_or(false),
                    aux_loss_coef: coef,
                    expert_size: self
                        .opt_usize("moe_intermediate_size")?
                        .unwrap_or(if qwen2 { 1408 } else { 768 }),
                    sparse_step: self.opt_usize("decoder_sparse_step")?.unwrap_or(1),
                    dense_layers,
                    shared_expert_size: match qwen2 {
                        true => self
                            .opt_usize("shared_expert_intermediate_size")?
                            .unwrap_or(5632),
                        false => 0,
                    },
                    held: Default::default(),
                    capacity_factor: None,
                })))
            }
            _ => Ok(None),
        }
    }

    /// The window as transformers derives it: Mistral's `sliding_window` (4096 when absent) on every
    /// layer; Qwen's only under `use_sliding_window`, on the layers `layer_types` marks (by default
    /// those from `max_window_layers` on).
    fn sliding_window(&self, family: Family, layers: usize) -> Result<Option<SlidingWindow>> {
        let size = |default: Option<usize>| -> Result<Option<usize>> {
            match self.v.get("sliding_window") {
                None => Ok(default),
                Some(Value::Null) => Ok(None),
                Some(_) => self.opt_usize("sliding_window"),
            }
        };
        match family {
            Family::Mistral => Ok(size(Some(4096))?.map(|size| SlidingWindow {
                size,
                first_layer: 0,
            })),
            // Mixtral's window is off unless given.
            Family::Mixtral => Ok(size(None)?.map(|size| SlidingWindow {
                size,
                first_layer: 0,
            })),
            // Qwen3-MoE's: on every layer, under use_sliding_window.
            Family::Qwen3Moe => {
                let enabled = self.opt_bool("use_sliding_window")?.unwrap_or(false);
                Ok(size(Some(4096))?
                    .filter(|_| enabled)
                    .map(|size| SlidingWindow {
                        size,
                        first_layer: 0,
                    }))
            }
            Family::Qwen2 | Family::Qwen3 | Family::Qwen2Moe => {
                let enabled = self.opt_bool("use_sliding_window")?.unwrap_or(false);
                let size = size(Some(4096))?.filter(|_| enabled);
                let from = self.opt_usize("max_window_layers")?.unwrap_or(28);
                let first_layer = match self.v.get("layer_types").filter(|v| !v.is_null()) {
                    None => from.min(layers),
                    Some(types) => self.first_sliding_layer(types, layers)?,
                };
                Ok(size
                    .filter(|_| first_layer < layers)
                    .map(|size| SlidingWindow { size, first_layer }))
            }
            Family::Llama | Family::Gpt2 | Family::DeepseekV3 => Ok(None),
        }
    }

    /// `layer_types` as the first layer of a run of sliding layers that lasts to the end: the one
    /// pattern ferrotron implements (and the one transformers derives by default).
    fn first_sliding_layer(&self, types: &Value, layers: usize) -> Result<usize> {
        let bad = |msg: String| self.field("layer_types", msg);
        let types = types
            .as_array()
            .ok_or_else(|| bad(format!("expected a list, found {types}")))?;
        if types.len() != layers {
            return Err(bad(format!("{} entries for {layers} layers", types.len())));
        }
        let mut sliding = Vec::with_capacity(layers);
        for t in types {
            sliding.push(match t.as_str() {
                Some("full_attention") => false,
                Some("sliding_attention") => true,
                _ => {
                    return Err(bad(format!(
                        "`{t}` is not implemented (only full_attention and sliding_attention)"
                    )))
                }
            });
        }
        let first = sliding.iter().position(|&s| s).unwrap_or(layers);
        if sliding[first..].iter().any(|&s| !s) {
            return Err(bad(
                "full-attention layers after sliding ones are not implemented (sliding layers must \
                 run from one layer to the last)"
                    .into(),
            ));
        }
        Ok(first)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn string(&self, key: &str) -> Result<String> {
        self.opt_string(key)?
            .ok_or_else(|| self.field(key, "missing".into()))
    }
    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.field(key, format!("expected a string, found {other}"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.field(key, "missing".into()))
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                // Bounded here, before any size is multiplied out of it.
                Some(n) if n as usize > MAX_DIMENSION => Err(self.field(
                    key,
                    format!("{n} is beyond the largest size handled ({MAX_DIMENSION})"),
                )),
                Some(n) => Ok(Some(n as usize)),
                None => Err(self.field(key, format!("expected a non-negative integer, found {v}"))),
            },
        }
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.field(key, format!("expected a finite number, found {v}"))),
            },
        }
    }
    /// A norm's epsilon: absent means `default`; negative is refused (it would take the root of a
    /// negative number on a zero row).
    fn non_negative(&self, key: &str, default: f64) -> Result<f64> {
        match self.opt_f64(key)? {
            None => Ok(default),
            Some(x) if x >= 0.0 => Ok(x),
            Some(x) => Err(self.field(key, format!("{x} must not be negative"))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.field(key, format!("expected true or false, found {v}"))),
        }
    }
    /// A boolean key whose other value is not implemented.
    fn require_bool(&self, key: &str, implemented: bool) -> Result<()> {
        match self.opt_bool(key)? {
            Some(b) if b != implemented => {
                Err(self.field(key, format!("{b} is not implemented (only {implemented})")))
            }
            _ => Ok(()),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeScaling;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(text, Path::new("config.json"))
    }

    #[test]
    fn a_mixtral_reads_its_experts_with_transformers_defaults_and_refuses_router_noise() {
        let base = r#""model_type":"mixtral","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2"#;
        let m = parse(&format!("{{{base}}}")).unwrap();
        let moe = m.moe.clone().unwrap();
        assert_eq!((moe.num_experts, moe.top_k), (8, 2));
        assert_eq!(moe.aux_loss_coef, 0.001);
        assert!(moe.norm_topk_prob);
        // transformers' Mixtral defaults: rope_theta 1e6, rms_norm_eps 1e-5, no window.
        assert_eq!((m.rope_theta, m.norm_eps), (1e6, 1e-5));
        assert_eq!(m.sliding_window, None);
        let e = parse(&format!("{{{base},\"router_jitter_noise\":0.01}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("router_jitter_noise"), "{e}");
        let e = parse(&format!("{{{base},\"num_experts_per_tok\":9}}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
        // Written back, read again: the same model.
        let again = parse(&m.to_hf_json().to_string()).unwrap();
        assert_eq!(again, m);
        // LoRA adapts attention and the experts (Mixtral's w1, w3, w2), never the router.
        let lora = crate::model::LoraConfig::new(&m, 4, 8.0, &[]).unwrap();
        assert_eq!(
            lora.targets,
            ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"]
        );
        let names: Vec<String> = lora.adapter_specs(&m).into_iter().map(|s| s.name).collect();
        assert!(
            names.contains(&"model.layers.0.block_sparse_moe.experts.7.w2.lora_B.weight".into())
        );
        // Under expert parallelism a device's adapters are its experts'.
        let held = lora.adapter_specs(&m.expert_shard(crate::model::ExpertShard::new(1, 2)));
        assert!(held.iter().all(|s| m
            .routed_expert_of(&s.name)
            .is_none_or(|e| (4..8).contains(&e))));
        let e = crate::model::LoraConfig::new(&m, 4, 8.0, &["gate".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`gate`") && e.contains("router"), "{e}");
        assert!(m.experts_split(1, 1, 1).is_ok());
        assert!(m.experts_split(4, 8, 1).is_ok());
        // The router and the shared expert's gate, told by name.
        assert!(m.is_router_param("model.layers.3.block_sparse_moe.gate.weight"));
        assert!(!m.is_router_param("model.layers.3.block_sparse_moe.experts.0.w1.weight"));
        // ep divides the replicas and the experts (8 of them here).
        let (key, why) = m.experts_split(4, 6, 1).unwrap_err();
        assert!(key == "ep" && why.contains("does not divide 6"), "{why}");
        let (key, why) = m.experts_split(3, 3, 1).unwrap_err();
        assert!(key == "ep" && why.contains("8 experts"), "{why}");
        let dense = crate::model::preset("llama-tiny").unwrap();
        let none = dense.experts_split(2, 2, 1).unwrap_err();
        assert!(none.1.contains("has none"));
    }

    /// Which blocks have experts, counted and walked alike; which tensors are experts', told by name
    /// and by the block's names alike.
    #[test]
    fn expert_blocks_and_tensors_are_told_apart_from_dense_ones() {
        let q = parse(
            r#"{"model_type":"qwen2_moe","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":7,"num_attention_heads":2,"num_experts":3,"num_experts_per_tok":2,
            "moe_intermediate_size":4,"shared_expert_intermediate_size":6,"decoder_sparse_step":2,
            "mlp_only_layers":[3, 3, 4, 6]}"#,
        )
        .unwrap();
        let moe = q.moe.clone().unwrap();
        let walked = (0..7).filter(|&l| moe.has_experts(l)).count();
        assert_eq!((moe.expert_layers(7), walked), (2, 2)); // blocks 1 and 5
        for spec in q.param_specs() {
            let layer: Option<usize> = spec
                .name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next()?.parse().ok());
            let listed = layer.is_some_and(|l| match q.layer_names(l).ffn {
                crate::model::FfnNames::Experts {
                    router,
                    experts,
                    shared,
                } => {
                    let of = |e: &crate::model::ExpertNames| {
                        [&e.gate, &e.up, &e.down].contains(&&spec.name)
                    };
                    router == spec.name
                        || experts.iter().any(of)
                        || shared.is_some_and(|(e, g)| g == Some(spec.name.clone()) || of(&e))
                }
                crate::model::FfnNames::Dense { .. } => false,
            });
            assert_eq!(q.is_expert_param(&spec.name), listed, "{}", spec.name);
            let routed = spec.name.contains(".experts.");
            assert_eq!(
                q.routed_expert_of(&spec.name).is_some(),
                routed,
                "{}",
                spec.name
            );
        }
        // A block index past the model, or two experts counts that disagree, are named.
        let base = r#""model_type":"qwen3_moe","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2,"num_experts_per_tok":1"#;
        for (extra, field) in [
            (r#","mlp_only_layers":[2]"#, "mlp_only_layers"),
            (r#","mlp_only_layers":"all""#, "mlp_only_layers"),
            (
                r#","num_experts":4,"num_local_experts":8"#,
                "num_local_experts",
            ),
            (r#","decoder_sparse_step":0"#, "decoder_sparse_step"),
        ] {
            let e = parse(&format!("{{{base}{extra}}}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        // A layer count at the bound is counted, not walked.
        let mut huge = moe.clone();
        huge.dense_layers.clear();
        assert_eq!(huge.expert_layers(MAX_DIMENSION), MAX_DIMENSION / 2);
    }

    #[test]
    fn rope_theta_top_level_or_nested() {
        let base = r#""model_type":"llama","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2"#;
        let top = parse(&format!("{{{base},\"rope_theta\":500000.0}}")).unwrap();
        assert_eq!(top.rope_theta, 500000.0);
        let nested = parse(&format!(
            "{{{base},\"rope_parameters\":{{\"rope_theta\":1234.0}}}}"
        ))
        .unwrap();
        assert_eq!(nested.rope_theta, 1234.0);
        assert_eq!(nested.num_kv_heads, 2);
        assert_eq!(nested.head_dim, 4);
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = parse(r#"{"model_type":"bert"}"#).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("model_type") && e.contains("bert"),
            "{e}"
        );
        let e = parse(r#"{"model_type":"gpt2","n_embd":"x"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_embd"), "{e}");
        let e = parse(r#"{"model_type":"gpt2","n_embd":64}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_head") && e.contains("missing"), "{e}");
        let e = parse("{not json").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }

    fn refusal(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    fn llama_with(extra: &str) -> String {
        format!(
            r#"{{"model_type":"llama","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2{extra}}}"#
        )
    }

    /// Published configs beyond the presets, as their model cards give them.
    #[test]
    fn published_configs_load_with_their_features() {
        // Llama 3.2 1B: tied embeddings, llama3 scaling by 32.
        let llama32 = parse(
            r#"{"architectures":["LlamaForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
            "bos_token_id":128000,"eos_token_id":128001,"head_dim":64,"hidden_act":"silu",
            "hidden_size":2048,"initializer_range":0.02,"intermediate_size":8192,
            "max_position_embeddings":131072,"mlp_bias":false,"model_type":"llama",
            "num_attention_heads":32,"num_hidden_layers":16,"num_key_value_heads":8,
            "pretraining_tp":1,"rms_norm_eps":1e-05,"rope_scaling":{"factor":32.0,
            "high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,
            "rope_type":"llama3"},"rope_theta":500000.0,"tie_word_embeddings":true,
            "torch_dtype":"bfloat16","transformers_version":"4.45.0.dev0","use_cache":true,
            "vocab_size":128256}"#,
        )
        .unwrap();
        assert_eq!(llama32.num_params(), 1_235_814_400);
        assert!(
            matches!(llama32.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0)
        );
        // Qwen2.5 with YaRN as its model card tells users to enable it (old `type` key).
        let qwen = parse(
            r#"{"model_type":"qwen2","vocab_size":32,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2,"rope_theta":1000000.0,
            "rope_scaling":{"factor":4.0,"original_max_position_embeddings":32768,"type":"yarn"},
            "use_sliding_window":false,"sliding_window":131072,"max_window_layers":28}"#,
        )
        .unwrap();
        match qwen.rope_scaling {
            RopeScaling::Yarn {
                factor,
                attention_factor,
                original_max_position_embeddings,
                ..
            } => {
                assert_eq!((factor, original_max_position_embeddings), (4.0, 32768.0));
                assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(qwen.rope_theta, 1e6);
        assert!(qwen.sliding_window.is_none() && qwen.bias.qkv);
    }

    #[test]
    fn every_unimplemented_key_or_value_is_refused_by_name() {
        let cases = [
            (
                llama_with(r#","rope_scaling":{"rope_type":"longrope","factor":2.0}"#),
                "longrope",
            ),
            (
                llama_with(r#","rope_parameters":{"rope_type":"su","factor":2.0}"#),
                "`su`",
            ),
            (
                llama_with(r#","rope_scaling":{"rope_type":"linear"}"#),
                "rope_scaling.factor",
            ),
            (
                llama_with(r#","rope_scaling":{"rope_type":"linear","factor":2.0,"beta_fast":4}"#),
                "rope_scaling.beta_fast",
            ),
            (llama_with(r#","some_new_key":1"#), "some_new_key"),
            (
                llama_with(r#","quantization_config":{"bits":4}"#),
                "quantized",
            ),
            (
                llama_with(r#","partial_rotary_factor":0.5"#),
                "partial_rotary_factor",
            ),
            (llama_with(r#","hidden_act":"gelu""#), "hidden_act"),
            (llama_with(r#","rope_theta":0"#), "rope_theta"),
            (llama_with(r#","rms_norm_eps":-1"#), "rms_norm_eps"),
            // Keys that exist in another family are not this family's.
            (llama_with(r#","sliding_window":4096"#), "sliding_window"),
            (
                llama_with(r#","attention_bias":false"#).replace("llama", "mistral"),
                "attention_bias",
            ),
            (
                llama_with(
                    r#","use_sliding_window":true,"sliding_window":8,
                    "layer_types":["sliding_attention","full_attention"]"#,
                )
                .replace("llama", "qwen2"),
                "layer_types",
            ),
            (
                llama_with(r#","mlp_bias":true"#).replace("llama", "qwen3"),
                "mlp_bias",
            ),
            (
                r#"{"model_type":"gpt2","vocab_size":32,"n_embd":8,"n_layer":1,"n_head":2,
                "n_positions":16,"rotary_dim":4}"#
                    .to_string(),
                "rotary_dim",
            ),
            (llama_with("").replace("llama", "phi3"), "phi3"),
            (llama_with("").replace("llama", "gemma2"), "gemma2"),
        ];
        for (text, named) in cases {
            let e = refusal(&text);
            assert!(e.contains(named), "{named}: {e}");
        }
    }

    #[test]
    fn windows_and_biases_follow_transformers_defaults() {
        // Mistral without the key: transformers' default window of 4096, on every layer.
        let m = parse(&llama_with("").replace("llama", "mistral")).unwrap();
        assert_eq!(
            (m.attention_window(0), m.attention_window(1)),
            (Some(4096), Some(4096))
        );
        let m =
            parse(&llama_with(r#","sliding_window":null"#).replace("llama", "mistral")).unwrap();
        assert_eq!(m.attention_window(0), None);
        // Qwen2: a window only under use_sliding_window, from max_window_layers on.
        let q = parse(
            &llama_with(r#","sliding_window":8,"max_window_layers":1"#).replace("llama", "qwen2"),
        )
        .unwrap();
        assert_eq!(q.sliding_window, None);
        let q = parse(
            &llama_with(r#","use_sliding_window":true,"sliding_window":8,"max_window_layers":1"#)
                .replace("llama", "qwen2"),
        )
        .unwrap();
        assert_eq!(
            (q.attention_window(0), q.attention_window(1)),
            (None, Some(8))
        );
        assert!(q.bias.qkv && !q.bias.o && !q.bias.mlp);
        // Qwen3's head_dim defaults to 128, whatever hidden / heads is.
        let q3 = parse(&llama_with("").replace("llama", "qwen3")).unwrap();
        assert_eq!(q3.head_dim, 128);
        assert!(q3.qk_norm);
        let l = parse(&llama_with(r#","attention_bias":true,"mlp_bias":true"#)).unwrap();
        assert_eq!(
            l.bias,
            ProjectionBias {
                qkv: true,
                o: true,
                mlp: true
            }
        );
    }

    #[test]
    fn the_written_config_reads_back_as_the_same_model() {
        for name in crate::model::PRESET_NAMES {
            let cfg = crate::model::preset(name).unwrap();
            if !FAMILIES.contains(&cfg.family()) {
                continue; // deepseek-v3: a preset only, no `config.json` of its family is read
            }
            let text = serde_json::to_string(&cfg.to_hf_json()).unwrap();
            let mut back = parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            back.family = cfg.family;
            assert_eq!(back, cfg, "{name}");
        }
    }
}

use crate::error::{ConfigError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The largest single dimension (vocabulary, width, layers, positions…) a model may have: every
/// shape product then fits a 64-bit count.
pub const MAX_DIMENSION: usize = 1 << 31;
/// The largest parameter count: 16 bytes each still fit a 64-bit byte count many times over.
pub const MAX_PARAMS: f64 = 1e15;

/// The two transformer families ferrotron implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.
    Llama,
    /// LayerNorm, learned positions, GELU-tanh MLP, biases everywhere, Conv1D `[in, out]` weights.
    Gpt2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    RmsNorm,
    LayerNorm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PositionKind {
    Rotary,
    Learned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) * up
    SwiGlu,
    /// GPT-2's `gelu_new`: 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³)))
    GeluTanh,
}

/// Everything about a model's shape that the engine and the planner need.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    /// A Llama-family shape (untied head, head_dim = hidden / heads).
    #[allow(clippy::too_many_arguments)] // a shape reads best positionally, as published tables give it
    pub fn llama(
        vocab: usize,
        hidden: usize,
        ffn: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        ctx: usize,
        rope_theta: f64,
    ) -> Self {
        Self {
            arch: Arch::Llama,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: hidden / heads.max(1),
            max_position_embeddings: ctx,
            norm_eps: 1e-5,
            rope_theta,
            tie_word_embeddings: false,
        }
    }

    /// A GPT-2 shape (tied embeddings, learned positions).
    pub fn gpt2(
        vocab: usize,
        hidden: usize,
        ffn: usize,
        layers: usize,
        heads: usize,
        positions: usize,
    ) -> Self {
        Self {
            arch: Arch::Gpt2,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: hidden / heads.max(1),
            max_position_embeddings: positions,
            norm_eps: 1e-5,
            rope_theta: 0.0,
            tie_word_embeddings: true,
        }
    }

    pub fn norm(&self) -> NormKind {
        match self.arch {
            Arch::Llama => NormKind::RmsNorm,
            Arch::Gpt2 => NormKind::LayerNorm,
        }
    }
    pub fn positions(&self) -> PositionKind {
        match self.arch {
            Arch::Llama => PositionKind::Rotary,
            Arch::Gpt2 => PositionKind::Learned,
        }
    }
    pub fn activation(&self) -> Activation {
        match self.arch {
            Arch::Llama => Activation::SwiGlu,
            Arch::Gpt2 => Activation::GeluTanh,
        }
    }
    pub fn has_bias(&self) -> bool {
        self.arch == Arch::Gpt2
    }
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Reads a Hugging Face `config.json`. Every error names the file and the field.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        Self::from_hf_json(&text, path)
    }

    pub fn from_hf_json(text: &str, file: &Path) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            file: file.to_path_buf(),
            msg: e.to_string(),
        })?;
        let r = Reader {
            v: &v,
            file: file.to_path_buf(),
        };
        let model_type = r.string("model_type")?;
        let cfg = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" => {
                let hidden = r.usize("hidden_size")?;
                let heads = r.usize("num_attention_heads")?;
                let kv_heads = r.opt_usize("num_key_value_heads")?.unwrap_or(heads);
                let head_dim = r
                    .opt_usize("head_dim")?
                    .unwrap_or_else(|| hidden / heads.max(1));
                // Newer transformers nest rope_theta under rope_parameters; older ones keep it top-level.
                let rope_theta = match v.get("rope_parameters") {
                    Some(p) if p.get("rope_theta").is_some() => {
                        r.f64_at(p, "rope_parameters.rope_theta", "rope_theta")?
                    }
                    _ => r.opt_f64("rope_theta")?.unwrap_or(10000.0),
                };
                if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
                    if act != "silu" {
                        return Err(r.field(
                            "hidden_act",
                            format!("`{act}` is not supported (only silu)"),
                        ));
                    }
                }
                for flag in ["attention_bias", "mlp_bias"] {
                    if v.get(flag).and_then(Value::as_bool) == Some(true) {
                        return Err(
                            r.field(flag, "biased Llama projections are not supported".into())
                        );
                    }
                }
                ModelConfig {
                    arch: Arch::Llama,
                    vocab_size: r.usize("vocab_size")?,
                    hidden_size: hidden,
                    intermediate_size: r.usize("intermediate_size")?,
                    num_layers: r.usize("num_hidden_layers")?,
                    num_heads: heads,
                    num_kv_heads: kv_heads,
                    head_dim,
                    max_position_embeddings: r
                        .opt_usize("max_position_embeddings")?
                        .unwrap_or(2048),
                    norm_eps: r.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
                    rope_theta,
                    tie_word_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(false),
                }
            }
            "gpt2" => {
                let hidden = r.usize("n_embd")?;
                let heads = r.usize("n_head")?;
                if let Some(act) = v.get("activation_function").and_then(Value::as_str) {
                    if act != "gelu_new" && act != "gelu_pytorch_tanh" {
                        return Err(r.field(
                            "activation_function",
                            format!("`{act}` is not supported (only gelu_new)"),
                        ));
                    }
                }
                ModelConfig {
                    arch: Arch::Gpt2,
                    vocab_size: r.usize("vocab_size")?,
                    hidden_size: hidden,
                    intermediate_size: r.opt_usize("n_inner")?.unwrap_or(4 * hidden),
                    num_layers: r.usize("n_layer")?,
                    num_heads: heads,
                    num_kv_heads: heads,
                    head_dim: hidden / heads.max(1),
                    max_position_embeddings: r.usize("n_positions")?,
                    norm_eps: r.opt_f64("layer_norm_epsilon")?.unwrap_or(1e-5),
                    rope_theta: 0.0,
                    tie_word_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(true),
                }
            }
            other => {
                return Err(r.field(
                    "model_type",
                    format!("unknown model_type `{other}` (supported: llama, gpt2)"),
                ))
            }
        };
        cfg.validate().map_err(|msg| ConfigError::Field {
            file: file.to_path_buf(),
            field: msg.0,
            msg: msg.1,
        })?;
        Ok(cfg)
    }

    /// Shape rules every model must satisfy; returns (field, message) on failure.
    pub fn validate(&self) -> std::result::Result<(), (String, String)> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err((name.into(), "must be positive".into()));
            }
        }
        for (name, value) in positive {
            if value > MAX_DIMENSION {
                return Err((
                    name.into(),
                    format!("{value} is beyond the largest size handled ({MAX_DIMENSION})"),
                ));
            }
        }
        let params = self.approx_num_params();
        if params > MAX_PARAMS {
            return Err((
                "num_hidden_layers".into(),
                format!(
                    "this shape has ~{params:.2e} parameters, beyond the {MAX_PARAMS:.0e} whose byte counts the planner and engine hold"
                ),
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err((
                "num_key_value_heads".into(),
                format!(
                    "{} attention heads are not divisible by {} KV heads",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if self.arch == Arch::Gpt2 && self.num_heads * self.head_dim != self.hidden_size {
            return Err((
                "n_head".into(),
                format!(
                    "n_embd {} is not divisible by n_head {}",
                    self.hidden_size, self.num_heads
                ),
            ));
        }
        if self.arch == Arch::Llama && !self.head_dim.is_multiple_of(2) {
            return Err((
                "head_dim".into(),
                "rotary embeddings need an even head_dim".into(),
            ));
        }
        Ok(())
    }

    /// The parameter count in floating point, which cannot overflow: what `validate` bounds before
    /// any exact (integer) count is taken.
    pub fn approx_num_params(&self) -> f64 {
        let f = |x: usize| x as f64;
        let (h, q, kv) = (
            f(self.hidden_size),
            f(self.num_heads) * f(self.head_dim),
            f(self.num_kv_heads) * f(self.head_dim),
        );
        let mlp = if self.arch == Arch::Llama { 3.0 } else { 2.0 };
        let layer = 2.0 * h * q + 2.0 * h * kv + mlp * h * f(self.intermediate_size);
        let tables = if self.tie_word_embeddings { 1.0 } else { 2.0 };
        f(self.num_layers) * layer
            + tables * f(self.vocab_size) * h
            + f(self.max_position_embeddings) * h
    }

    /// Writes a `config.json` that Hugging Face transformers loads.
    pub fn to_hf_json(&self) -> Value {
        match self.arch {
            Arch::Llama => serde_json::json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
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
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
                "tie_word_embeddings": self.tie_word_embeddings,
                "hidden_act": "silu",
                "attention_bias": false,
                "mlp_bias": false,
                "bos_token_id": 0,
                "eos_token_id": 0,
                "torch_dtype": "float32",
            }),
            Arch::Gpt2 => serde_json::json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
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
                "bos_token_id": 0,
                "eos_token_id": 0,
                "torch_dtype": "float32",
            }),
        }
    }
}

struct Reader<'a> {
    v: &'a Value,
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
    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn string(&self, key: &str) -> Result<String> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(self.field(key, format!("expected a string, found {other}"))),
            None => Err(self.field(key, "missing".into())),
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
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.field(key, format!("expected a number, found {v}"))),
        }
    }
    fn f64_at(&self, obj: &Value, path: &str, key: &str) -> Result<f64> {
        obj.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| self.field(path, "expected a number".into()))
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(text, Path::new("config.json"))
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
}

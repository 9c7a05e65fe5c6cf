use super::config::{Arch, ModelConfig};
use crate::error::{ConfigError, Result};

pub const PRESET_NAMES: &[&str] = &["llama-tiny", "gpt2-tiny", "llama-small", "llama-bench"];

fn llama(
    vocab: usize,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    ctx: usize,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hidden / heads,
        max_position_embeddings: ctx,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_word_embeddings: false,
    }
}

/// Named model shapes. `llama-small` is the embedded default run's model; `llama-bench` is the
/// benchmark shape shared with the PyTorch peer script.
pub fn preset(name: &str) -> Result<ModelConfig> {
    Ok(match name {
        "llama-tiny" => llama(512, 64, 176, 4, 4, 2, 256),
        "gpt2-tiny" => ModelConfig {
            arch: Arch::Gpt2,
            vocab_size: 512,
            hidden_size: 64,
            intermediate_size: 256,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 4,
            head_dim: 16,
            max_position_embeddings: 256,
            norm_eps: 1e-5,
            rope_theta: 0.0,
            tie_word_embeddings: true,
        },
        "llama-small" => llama(2048, 256, 704, 4, 4, 4, 256),
        "llama-bench" => llama(8192, 512, 1408, 8, 8, 8, 256),
        other => {
            return Err(ConfigError::Invalid(format!(
                "unknown model preset `{other}` (known: {})",
                PRESET_NAMES.join(", ")
            )))
        }
    })
}

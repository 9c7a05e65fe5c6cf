use super::config::ModelConfig;
use crate::error::{ConfigError, Result};

pub const PRESET_NAMES: &[&str] = &["llama-tiny", "gpt2-tiny", "llama-small", "llama-bench"];

/// Named model shapes. `llama-small` is the embedded default run's model; `llama-bench` is the
/// benchmark shape shared with the PyTorch peer script.
pub fn preset(name: &str) -> Result<ModelConfig> {
    Ok(match name {
        "llama-tiny" => ModelConfig::llama(512, 64, 176, 4, 4, 2, 256, 10000.0),
        "gpt2-tiny" => ModelConfig::gpt2(512, 64, 256, 4, 4, 256),
        "llama-small" => ModelConfig::llama(2048, 256, 704, 4, 4, 4, 256, 10000.0),
        "llama-bench" => ModelConfig::llama(8192, 512, 1408, 8, 8, 8, 256, 10000.0),
        other => {
            return Err(ConfigError::Invalid(format!(
                "unknown model preset `{other}` (known: {})",
                PRESET_NAMES.join(", ")
            )))
        }
    })
}

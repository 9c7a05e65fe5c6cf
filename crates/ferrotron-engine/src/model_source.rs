//! The model a run starts from: a Hugging Face directory, or a preset drawn from a seed.

use crate::error::{EngineError, Result};
use crate::hf;
use crate::transformer::ParamStore;
use ferrotron_core::model::{preset, ModelConfig, PRESET_NAMES};
use std::path::{Path, PathBuf};

/// Where a model came from: a Hugging Face directory (fine-tuning) or a preset (from scratch).
#[derive(Debug, Clone)]
pub enum ModelSource {
    HfDir(PathBuf),
    Preset(String),
}

/// `spec` is a preset name or a Hugging Face model directory. Presets start from seeded random weights.
pub fn resolve_model(spec: &str, seed: u64) -> Result<(ModelConfig, ParamStore, ModelSource)> {
    let path = Path::new(spec);
    if path.is_dir() {
        let (cfg, params) = hf::load_model(path)?;
        return Ok((cfg, params, ModelSource::HfDir(path.to_path_buf())));
    }
    if PRESET_NAMES.contains(&spec) {
        let cfg = preset(spec)?;
        let params = ParamStore::init_random(&cfg, seed);
        return Ok((cfg, params, ModelSource::Preset(spec.to_string())));
    }
    Err(EngineError::Invalid(format!(
        "model `{spec}` is neither a directory nor a preset (presets: {})",
        PRESET_NAMES.join(", ")
    )))
}

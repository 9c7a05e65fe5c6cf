//! The model a run starts from: a Hugging Face directory (local, or a prefix on an object store),
//! or a preset drawn from a seed.

use crate::error::{EngineError, Result};
use crate::hf;
use crate::storage::{self, Location};
use crate::transformer::ParamStore;
use ferrotron_core::model::{preset, ModelConfig, PRESET_NAMES};
use ferrotron_core::precision::BaseQuantization;
use std::path::Path;

/// Where a model came from: a Hugging Face directory (fine-tuning) or a preset (from scratch).
#[derive(Debug, Clone)]
pub enum ModelSource {
    HfDir(Location),
    Preset(String),
}

/// `spec` is a preset name or a Hugging Face model directory. Presets start from seeded random weights.
pub fn resolve_model(spec: &str, seed: u64) -> Result<(ModelConfig, ParamStore, ModelSource)> {
    let (cfg, source) = resolve_config(spec)?;
    let params = source.load(&cfg, seed, None)?;
    Ok((cfg, params, source))
}

/// The configuration of `spec` (a preset name, a Hugging Face model directory or an
/// `s3://bucket/prefix` holding one) and where its weights are, without reading them.
pub fn resolve_config(spec: &str) -> Result<(ModelConfig, ModelSource)> {
    let (cfg, source) = find_config(spec)?;
    if let Some(why) = cfg.engine_refusal() {
        return Err(EngineError::Invalid(format!("model `{spec}`: {why}")));
    }
    Ok((cfg, source))
}

/// Preset `name`, if the engine runs it (the benchmarks' models).
pub fn engine_preset(name: &str) -> Result<ModelConfig> {
    let cfg = preset(name)?;
    match cfg.engine_refusal() {
        Some(why) => Err(EngineError::Invalid(format!("model `{name}`: {why}"))),
        None => Ok(cfg),
    }
}

/// The configuration of `spec` and where its weights are, whether or not the engine runs it.
fn find_config(spec: &str) -> Result<(ModelConfig, ModelSource)> {
    if storage::is_remote(spec) {
        let model = Location::parse(spec)?;
        // A missing bucket or wrong credentials are said now, before any work.
        model.check_reachable()?;
        return Ok((hf::read_config_at(&model)?, ModelSource::HfDir(model)));
    }
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok((
            hf::read_config(path)?,
            ModelSource::HfDir(Location::Local(path.to_path_buf())),
        ));
    }
    if PRESET_NAMES.contains(&spec) {
        return Ok((preset(spec)?, ModelSource::Preset(spec.to_string())));
    }
    Err(EngineError::Invalid(format!(
        "model `{spec}` is neither a directory, an s3:// URL nor a preset (presets: {})",
        PRESET_NAMES.join(", ")
    )))
}

impl ModelSource {
    /// The weights of `cfg` (this source's configuration): read, or (a preset) drawn from `seed`;
    /// with `quantize`, the projections quantized as they are read (QLoRA).
    pub fn load(
        &self,
        cfg: &ModelConfig,
        seed: u64,
        quantize: Option<BaseQuantization>,
    ) -> Result<ParamStore> {
        let mut params = match self {
            ModelSource::HfDir(dir) => return hf::load_params_as(dir, cfg, quantize),
            ModelSource::Preset(_) => ParamStore::init_random(cfg, seed),
        };
        if let Some(BaseQuantization::Nf4) = quantize {
            params.quantize_nf4(cfg);
        }
        Ok(params)
    }
}

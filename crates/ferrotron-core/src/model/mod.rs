//! Architecture description only: which parameters a model has (by their Hugging Face names), their
//! shapes, and how much work and memory a layer costs. No parallelism and no arithmetic on tensors.

mod config;
mod flops;
mod hf_config;
mod lora;
mod params;
mod presets;
mod rope;

pub use config::{
    Activation, Arch, AttentionWidths, ExpertShard, Family, LatentAttention, ModelConfig,
    MoeConfig, NormKind, PositionKind, ProjectionBias, SlidingWindow, MAX_DIMENSION, MAX_PARAMS,
};
pub use flops::{head_forward_flops, layer_forward_flops, layer_matmul_params};
pub use lora::{
    adapter_parts, check_quantized_base, is_projection_weight, projection_split, AdapterHalf,
    LoraConfig, LoraTarget, TargetSplit, MAX_RANK, PEFT_PREFIX,
};
pub use params::{ExpertNames, FfnNames, LatentNames, LayerParamNames, ParamSpec, WeightLayout};
pub use presets::{preset, PRESET_NAMES};
pub use rope::{RopeFrequencies, RopeScaling};

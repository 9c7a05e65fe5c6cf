//! The FLOPs of a layer and of the output head: what the planner prices and what the stage partition
//! balances.

use super::{Arch, ModelConfig};

/// Matmul parameters one token meets in one layer (full, unsharded): with a mixture of experts, the
/// router and its `top_k` experts (the active parameters).
pub fn layer_matmul_params(cfg: &ModelConfig) -> f64 {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    let mlp = match cfg.moe {
        Some(m) => m.top_k as f64 * 3.0 * h * f + m.num_experts as f64 * h,
        None => 3.0 * h * f,
    };
    match cfg.arch {
        Arch::Llama => 2.0 * h * cfg.q_dim() as f64 + 2.0 * h * cfg.kv_dim() as f64 + mlp,
        Arch::Gpt2 => 4.0 * h * h + 2.0 * h * f,
    }
}

/// Forward FLOPs of one layer for one micro-batch: 2·params·tokens plus QKᵀ and PV (4·b·s²·q_dim,
/// counted full as in Narayanan et al. 2021).
pub fn layer_forward_flops(cfg: &ModelConfig, mbs: usize, seq: usize) -> f64 {
    let tok = (mbs * seq) as f64;
    2.0 * layer_matmul_params(cfg) * tok + 4.0 * tok * seq as f64 * cfg.q_dim() as f64
}

pub fn head_forward_flops(cfg: &ModelConfig, mbs: usize, seq: usize) -> f64 {
    2.0 * (mbs * seq) as f64 * cfg.hidden_size as f64 * cfg.vocab_size as f64
}

//! The FLOPs of a layer and of the output head: what the planner prices and what the stage partition
//! balances.

use super::{Arch, ModelConfig};

/// Matmul parameters one token meets in one layer (full, unsharded): with a mixture of experts, the
/// router and its `top_k` experts (the active parameters).
pub fn layer_matmul_params(cfg: &ModelConfig) -> f64 {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    // A mixture of experts: a token's `top_k` experts and the router, averaged with the dense blocks.
    let mlp = match &cfg.moe {
        Some(m) => {
            let layers = cfg.num_layers.max(1) as f64;
            let sparse = m.expert_layers(cfg.num_layers) as f64;
            let expert = m.top_k as f64 * 3.0 * h * m.expert_size as f64
                + m.num_experts as f64 * h
                + 3.0 * h * m.shared_expert_size as f64;
            (sparse * expert + (layers - sparse) * 3.0 * h * f) / layers
        }
        None => 3.0 * h * f,
    };
    match cfg.arch {
        Arch::Llama => cfg.attention_matmul_params() + mlp,
        Arch::Gpt2 => 4.0 * h * h + 2.0 * h * f,
    }
}

/// Forward FLOPs of one layer for one micro-batch: 2·params·tokens plus QKᵀ and PV (4·b·s²·q_dim,
/// counted full as in Narayanan et al. 2021).
pub fn layer_forward_flops(cfg: &ModelConfig, mbs: usize, seq: usize) -> f64 {
    let tok = (mbs * seq) as f64;
    2.0 * layer_matmul_params(cfg) * tok + tok * seq as f64 * cfg.attention_score_flops_per_key()
}

pub fn head_forward_flops(cfg: &ModelConfig, mbs: usize, seq: usize) -> f64 {
    2.0 * (mbs * seq) as f64 * cfg.hidden_size as f64 * cfg.vocab_size as f64
}

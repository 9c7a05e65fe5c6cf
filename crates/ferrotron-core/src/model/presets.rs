use super::config::ModelConfig;
use crate::error::{ConfigError, Result};
use std::path::Path;

pub const PRESET_NAMES: &[&str] = &[
    "llama-tiny",
    "gpt2-tiny",
    "llama-small",
    "llama-bench",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.1-405b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "mistral-7b",
    "mixtral-tiny",
    "mixtral-bench",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3",
];

/// The published `config.json` of each real checkpoint preset, as its model card gives it: a
/// preset is exactly what loading that checkpoint's config gives.
const PUBLISHED: &[(&str, &str)] = &[
    ("llama3.1-8b", include_str!("configs/llama3.1-8b.json")),
    ("llama3.1-70b", include_str!("configs/llama3.1-70b.json")),
    ("llama3.1-405b", include_str!("configs/llama3.1-405b.json")),
    ("qwen2.5-7b", include_str!("configs/qwen2.5-7b.json")),
    ("qwen2.5-72b", include_str!("configs/qwen2.5-72b.json")),
    ("qwen3-8b", include_str!("configs/qwen3-8b.json")),
    ("qwen3-32b", include_str!("configs/qwen3-32b.json")),
    ("mistral-7b", include_str!("configs/mistral-7b.json")),
    ("mixtral-8x7b", include_str!("configs/mixtral-8x7b.json")),
    ("qwen3-30b-a3b", include_str!("configs/qwen3-30b-a3b.json")),
];

/// Named model shapes. `llama-small` is the embedded default run's model; `llama-bench` and
/// `mixtral-bench` are the benchmark shapes shared with the PyTorch peer script; the others are real
/// checkpoints' configs.
pub fn preset(name: &str) -> Result<ModelConfig> {
    if let Some((_, json)) = PUBLISHED.iter().find(|(n, _)| *n == name) {
        return ModelConfig::from_hf_json(json, Path::new(&format!("{name}/config.json")));
    }
    Ok(match name {
        "llama-tiny" => ModelConfig::llama(512, 64, 176, 4, 4, 2, 256, 10000.0),
        "gpt2-tiny" => ModelConfig::gpt2(512, 64, 256, 4, 4, 256),
        "llama-small" => ModelConfig::llama(2048, 256, 704, 4, 4, 4, 256, 10000.0),
        "llama-bench" => ModelConfig::llama(8192, 512, 1408, 8, 8, 8, 256, 10000.0),
        // llama-tiny's attention with four experts of 96 columns, two per token.
        "mixtral-tiny" => {
            ModelConfig::llama(512, 64, 96, 4, 4, 2, 256, 10000.0).with_experts(super::MoeConfig {
                num_experts: 4,
                top_k: 2,
                norm_topk_prob: true,
                aux_loss_coef: 0.02,
                expert_size: 96,
                sparse_step: 1,
                dense_layers: Vec::new(),
                shared_expert_size: 0,
                held: Default::default(),
                capacity_factor: None,
            })
        }
        // llama-bench's attention with eight experts of 704 columns, two per token: a token's
        // active MLP is llama-bench's (2 × 704 = 1408), the benchmark shape shared with the
        // PyTorch peer script (`--model mixtral`).
        "mixtral-bench" => ModelConfig::llama(8192, 512, 704, 8, 8, 8, 256, 10000.0).with_experts(
            super::MoeConfig {
                num_experts: 8,
                top_k: 2,
                norm_topk_prob: true,
                aux_loss_coef: 0.02,
                expert_size: 704,
                sparse_step: 1,
                dense_layers: Vec::new(),
                shared_expert_size: 0,
                held: Default::default(),
                capacity_factor: None,
            },
        ),
        "deepseek-v3" => deepseek_v3(),
        other => {
            return Err(ConfigError::Invalid(format!(
                "unknown model preset `{other}` (known: {})",
                PRESET_NAMES.join(", ")
            )))
        }
    })
}

/// DeepSeek-V3 as its published `config.json` (deepseek-ai/DeepSeek-V3) describes it: 61 blocks of
/// multi-head latent attention, the first three with a dense MLP, the others with 256 routed
/// experts (eight per token) and one shared expert. Built here rather than read, as ferrotron reads
/// no `deepseek_v3` config yet; its routing (group-limited sigmoid scores, `routed_scaling_factor`)
/// changes no count or cost the planner prices, and the engine refuses the model
/// ([`ModelConfig::engine_refusal`]). The multi-token-prediction module (`num_nextn_predict_layers`)
/// is not part of the 671B.
fn deepseek_v3() -> ModelConfig {
    let mut cfg = ModelConfig::llama(129280, 7168, 18432, 61, 128, 128, 163840, 10000.0)
        .with_experts(super::MoeConfig {
            num_experts: 256,
            top_k: 8,
            norm_topk_prob: true,
            aux_loss_coef: 0.001,
            expert_size: 2048,
            sparse_step: 1,
            dense_layers: vec![0, 1, 2],
            shared_expert_size: 2048,
            held: Default::default(),
            capacity_factor: None,
        });
    cfg.family = Some(super::Family::DeepseekV3);
    cfg.head_dim = 128 + 64; // qk_nope_head_dim + qk_rope_head_dim
    cfg.norm_eps = 1e-6;
    cfg.latent_attention = Some(super::LatentAttention {
        q_lora_rank: Some(1536),
        kv_lora_rank: 512,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
    });
    // YaRN ×40 from 4096 positions; mscale = mscale_all_dim = 1 leave the attention factor at 1.
    cfg.rope_scaling = super::RopeScaling::Yarn {
        factor: 40.0,
        original_max_position_embeddings: 4096.0,
        attention_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
    };
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Family, RopeScaling};

    /// Parameter counts as the model cards and `safetensors` metadata publish them.
    #[test]
    fn published_checkpoints_have_their_published_parameter_counts() {
        let published = [
            ("llama3.1-8b", 8_030_261_248usize),
            ("llama3.1-70b", 70_553_706_496),
            ("llama3.1-405b", 405_853_388_800),
            ("qwen2.5-7b", 7_615_616_512),
            ("qwen2.5-72b", 72_706_203_648),
            ("qwen3-8b", 8_190_735_360),
            ("qwen3-32b", 32_762_123_264),
            ("mistral-7b", 7_241_732_096),
            ("mixtral-8x7b", 46_702_792_704),
            ("qwen3-30b-a3b", 30_532_122_624),
        ];
        for (name, params) in published {
            let cfg = preset(name).unwrap();
            assert_eq!(cfg.num_params(), params, "{name}");
        }
        // Mixtral's "12.9B active": two of the eight experts, and everything else.
        assert_eq!(
            preset("mixtral-8x7b").unwrap().num_active_params(),
            12_879_925_248
        );
        // Qwen3-30B-A3B's "3.3B activated": eight of its 128 experts.
        assert_eq!(
            preset("qwen3-30b-a3b").unwrap().num_active_params(),
            3_353_032_704
        );
        assert_eq!(
            preset("llama3.1-8b").unwrap().num_active_params(),
            8_030_261_248
        );
        // DeepSeek-V3's "671B total parameters with 37B activated" (its technical report): the
        // count transformers' DeepseekV3ForCausalLM gives its default (V3's) config, buffers
        // (`e_score_correction_bias`) and the prediction module apart. Less its input embedding
        // (0.93B), the activated count is the model card's "36.6B".
        let deepseek = preset("deepseek-v3").unwrap();
        assert_eq!(deepseek.num_params(), 671_026_404_352);
        assert_eq!(deepseek.num_active_params(), 37_552_282_624);
        assert_eq!(
            deepseek.num_active_params() - 129280 * 7168,
            36_625_603_584 // 36.6B
        );
    }

    #[test]
    fn published_features_are_read() {
        let llama = preset("llama3.1-8b").unwrap();
        assert!(matches!(llama.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        let qwen = preset("qwen2.5-7b").unwrap();
        assert!(qwen.bias.qkv && !qwen.bias.o && qwen.sliding_window.is_none());
        assert_eq!(qwen.family(), Family::Qwen2);
        let qwen3 = preset("qwen3-8b").unwrap();
        assert!(qwen3.qk_norm && !qwen3.bias.qkv);
        let mistral = preset("mistral-7b").unwrap();
        assert_eq!(mistral.attention_window(0), Some(4096));
    }
}

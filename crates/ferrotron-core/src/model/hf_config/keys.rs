//! Which `config.json` keys each family implements, which are inert, and the parameters of each
//! RoPE type: every other key is refused by name.

use crate::model::config::Family;

/// Keys of every `config.json` that do not change what the model computes in training: names,
/// metadata, token ids, generation defaults, the attention implementation (the same function).
pub(super) const INERT_EVERYWHERE: &[&str] = &[
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "finetuning_task",
    "id2label",
    "label2id",
    "num_labels",
    "task_specific_params",
    "problem_type",
    "tokenizer_class",
    "prefix",
    "attn_implementation",
    "_attn_implementation_autoset",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// The keys of the Llama-shaped families that ferrotron implements (all of them read below).
pub(super) const LLAMA_SHAPE: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    // ferrotron trains without dropout (the function transformers computes in eval mode); every
    // published config of these families has 0.
    "attention_dropout",
];

/// Keys a family implements beyond [`LLAMA_SHAPE`], and keys it carries that change nothing.
pub(super) fn family_keys(f: Family) -> (&'static [&'static str], &'static [&'static str]) {
    match f {
        // Not read from a `config.json` (not in [`FAMILIES`]): the `deepseek-v3` preset only.
        Family::DeepseekV3 => (&[], &[]),
        // pretraining_tp > 1 splits the same products into slices: the same function.
        Family::Llama => (&["attention_bias", "mlp_bias"], &["pretraining_tp"]),
        // transformers warns about and ignores Mistral's layer_types.
        Family::Mistral => (&["sliding_window"], &["layer_types"]),
        Family::Qwen2 => (
            &[
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            ],
            // Published Qwen2/2.5 configs carry `use_mrope: false`; transformers' Qwen2 never reads it.
            &["use_mrope"],
        ),
        Family::Qwen3 => (
            &[
                "attention_bias",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            ],
            &[],
        ),
        // output_router_logits decides whether transformers adds the load-balancing loss: ferrotron
        // always trains with it (and writes `true`, so an export computes the same loss there).
        Family::Mixtral => (
            &[
                "sliding_window",
                "num_local_experts",
                "num_experts_per_tok",
                "router_aux_loss_coef",
                "router_jitter_noise",
            ],
            &["output_router_logits"],
        ),
        // As Qwen2 (q/k/v biases under qkv_bias, windows from max_window_layers), with experts and a
        // shared expert.
        Family::Qwen2Moe => (
            &[
                "qkv_bias",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
                "num_experts",
                "num_local_experts",
                "num_experts_per_tok",
                "norm_topk_prob",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "decoder_sparse_step",
                "mlp_only_layers",
                "router_aux_loss_coef",
            ],
            &["output_router_logits"],
        ),
        // As Qwen3, with experts. transformers' Qwen3-MoE windows every layer under
        // use_sliding_window and never reads max_window_layers (published configs carry it).
        Family::Qwen3Moe => (
            &[
                "attention_bias",
                "use_sliding_window",
                "sliding_window",
                "num_experts",
                "num_local_experts",
                "num_experts_per_tok",
                "norm_topk_prob",
                "moe_intermediate_size",
                "decoder_sparse_step",
                "mlp_only_layers",
                "router_aux_loss_coef",
            ],
            &["output_router_logits", "max_window_layers"],
        ),
        Family::Gpt2 => (
            &[
                "vocab_size",
                "n_embd",
                "n_layer",
                "n_head",
                "n_inner",
                "n_positions",
                "activation_function",
                "layer_norm_epsilon",
                "tie_word_embeddings",
                "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx",
                "add_cross_attention",
                // Dropout is not applied (see docs/models.md).
                "resid_pdrop",
                "embd_pdrop",
                "attn_pdrop",
            ],
            // n_ctx is n_positions' old name; the summary keys belong to the double-heads model;
            // reorder_and_upcast_attn changes the precision of an f16 run, not the function.
            &[
                "n_ctx",
                "reorder_and_upcast_attn",
                "summary_type",
                "summary_use_proj",
                "summary_activation",
                "summary_proj_to_labels",
                "summary_first_dropout",
            ],
        ),
    }
}

pub(super) const FAMILIES: &[Family] = &[
    Family::Llama,
    Family::Mistral,
    Family::Qwen2,
    Family::Qwen3,
    Family::Mixtral,
    Family::Qwen2Moe,
    Family::Qwen3Moe,
    Family::Gpt2,
];

/// Keys of a `rope_parameters` / `rope_scaling` object by rope type (beside `rope_type`/`type`,
/// `rope_theta` and `partial_rotary_factor`, which every type has).
pub(super) fn rope_keys(rope_type: &str) -> Option<&'static [&'static str]> {
    Some(match rope_type {
        "default" => &[],
        "linear" => &["factor"],
        // original_max_position_embeddings is not read by the dynamic type.
        "dynamic" => &["factor", "original_max_position_embeddings"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        _ => return None,
    })
}

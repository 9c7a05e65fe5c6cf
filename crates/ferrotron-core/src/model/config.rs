use super::rope::RopeScaling;

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

/// The Hugging Face family a model belongs to: its `model_type`, which keys its `config.json` may
/// hold, and how it is written back. The computation is the [`Arch`] and the features below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    /// DeepSeek-V3: multi-head latent attention and a shared expert beside the routed ones. `plan`
    /// prices it; the engine refuses it ([`ModelConfig::engine_refusal`]).
    DeepseekV3,
    Gpt2,
}

impl Family {
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Qwen3Moe => "qwen3_moe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::Gpt2 => "gpt2",
        }
    }
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::DeepseekV3 => "DeepseekV3ForCausalLM",
            Family::Gpt2 => "GPT2LMHeadModel",
        }
    }
}

/// Which projections of a Llama-shaped block carry a bias (Llama's `attention_bias` and
/// `mlp_bias`, Qwen2's q/k/v biases). GPT-2 has biases everywhere by its architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ProjectionBias {
    pub qkv: bool,
    pub o: bool,
    pub mlp: bool,
}

/// Sliding-window attention: a query sees itself and the `size − 1` keys before it, in every layer
/// from `first_layer` on (Qwen2's `max_window_layers`; 0 for Mistral).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingWindow {
    pub size: usize,
    pub first_layer: usize,
}

/// One token's attention tensors on one device (see [`ModelConfig::attention_widths`]): its
/// queries, keys, values and output, and latent attention's low-rank latents with their norms'
/// outputs (`q_a`, its norm, `kv_a`'s latent and rotary key, its norm; 0 without).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionWidths {
    pub q: f64,
    pub k: f64,
    pub v: f64,
    pub out: f64,
    pub latent: f64,
}

/// DeepSeek-V2/V3's multi-head latent attention: queries through a rank-`q_lora_rank` bottleneck
/// (`q_a_proj`, an RMSNorm, `q_b_proj`), keys and values from one shared `kv_lora_rank` latent per
/// token (`kv_a_proj_with_mqa`, which also gives the `qk_rope_head_dim` rotary key part shared by
/// every head, an RMSNorm, `kv_b_proj`). A query/key head is `head_dim` = nope + rope wide, a
/// value head `v_head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatentAttention {
    /// `None`: one `q_proj`, no query bottleneck (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// A mixture of experts in place of a block's MLP (Mixtral, Qwen3-MoE): a router (a linear map to
/// one logit per expert, softmax in f32, the `top_k` most probable experts, their probabilities
/// renormalised to sum to 1 when `norm_topk_prob`), and `num_experts` SwiGLU MLPs of `expert_size`
/// columns each; a token's output is its experts' outputs weighted by those probabilities. Every
/// `sparse_step`-th block has experts, except the `dense_layers` (which keep a dense MLP of
/// `intermediate_size`). Training adds `aux_loss_coef` × the load-balancing loss to the
/// cross-entropy.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub aux_loss_coef: f64,
    pub expert_size: usize,
    pub sparse_step: usize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// Qwen2-MoE's shared expert: a SwiGLU MLP of this many columns that every token takes, its
    /// output scaled by a sigmoid gate of the token (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_expert_size: usize,
    /// Which of the routed experts this copy of the model holds: all of them, or under expert
    /// parallelism one device's share ([`ModelConfig::expert_shard`]); never saved.
    #[serde(skip)]
    pub held: ExpertShard,
    /// Token dropping (a training setting, not the checkpoint's: transformers' models are
    /// dropless): each expert takes at most [`MoeConfig::capacity`] of a micro-batch's places on a
    /// device, first choices before second ones, earlier rows first; the places past it are
    /// dropped (the token keeps its other experts' outputs, weights unchanged). `None`: dropless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

/// One device's share of every block's routed experts: the experts are cut into `blocks` equal,
/// contiguous blocks (under `etp=1` one per device of the tensor-parallel group, else one), and
/// block `block` into `size` equal ranges over an expert-parallel group, of which this device holds
/// the `index`-th (the whole model: index 0 of 1 of block 0 of 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShard {
    pub index: usize,
    pub size: usize,
    pub block: usize,
    pub blocks: usize,
}

impl Default for ExpertShard {
    fn default() -> Self {
        Self::new(0, 1)
    }
}

impl ExpertShard {
    /// The `index`-th of `size` shares of all the experts (one block).
    pub fn new(index: usize, size: usize) -> Self {
        Self {
            index,
            size,
            block: 0,
            blocks: 1,
        }
    }

    /// The experts (of `num_experts`) this device's expert-parallel group divides: its block.
    pub fn group_experts(&self, num_experts: usize) -> std::ops::Range<usize> {
        let n = num_experts / self.blocks.max(1);
        self.block * n..(self.block + 1) * n
    }

    /// The experts (of `num_experts`) this share holds.
    pub fn held(&self, num_experts: usize) -> std::ops::Range<usize> {
        let group = self.group_experts(num_experts);
        let n = group.len() / self.size.max(1);
        group.start + self.index * n..group.start + (self.index + 1) * n
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl MoeConfig {
    /// How many of `rows` rows' places one expert takes under the capacity factor F:
    /// ⌈F · rows · top_k / num_experts⌉ (GShard's and Switch's expert capacity); unbounded when
    /// dropless.
    pub fn capacity(&self, rows: usize) -> usize {
        match self.capacity_factor {
            Some(f) => (f * (rows * self.top_k) as f64 / self.num_experts as f64).ceil() as usize,
            None => usize::MAX,
        }
    }

    /// Whether `f` can be a capacity factor, or why not: a positive, finite number.
    pub fn check_capacity_factor(f: f64) -> std::result::Result<(), String> {
        if f.is_finite() && f > 0.0 {
            Ok(())
        } else {
            Err(format!(
                "{f} is not a capacity factor: give a positive number (1.0: each expert takes its \
                 even share of the places; more leaves room for imbalance)"
            ))
        }
    }

    /// Whether block `layer` has experts (transformers' rule for Qwen-MoE; every block for Mixtral).
    pub fn has_experts(&self, layer: usize) -> bool {
        !self.dense_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.sparse_step.max(1))
    }

    /// How many of `layers` blocks have experts: every `sparse_step`-th, less the dense ones among
    /// them (counted, not walked: `validate` asks it of any layer count before bounding anything).
    pub fn expert_layers(&self, layers: usize) -> usize {
        if self.num_experts == 0 {
            return 0;
        }
        let step = self.sparse_step.max(1);
        let mut dense: Vec<usize> = self
            .dense_layers
            .iter()
            .copied()
            .filter(|&d| d < layers && (d + 1).is_multiple_of(step))
            .collect();
        dense.sort_unstable();
        dense.dedup();
        layers / step - dense.len()
    }
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
    /// The Hugging Face family; absent in checkpoints written before families were named (then
    /// the architecture's own: llama or gpt2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<Family>,
    /// How the rotary frequencies are scaled (Llama-shaped models).
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    /// Biases of a Llama-shaped block's projections.
    #[serde(default)]
    pub bias: ProjectionBias,
    /// Qwen3: an RMSNorm over each head of q and of k, before the rotation.
    #[serde(default)]
    pub qk_norm: bool,
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// A mixture of experts in place of a block's MLP (boxed: most models have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Box<MoeConfig>>,
    /// DeepSeek's multi-head latent attention in place of q/k/v projections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latent_attention: Option<LatentAttention>,
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
            family: Some(Family::Llama),
            rope_scaling: RopeScaling::Default,
            bias: ProjectionBias::default(),
            qk_norm: false,
            sliding_window: None,
            moe: None,
            latent_attention: None,
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
            family: Some(Family::Gpt2),
            rope_scaling: RopeScaling::Default,
            bias: ProjectionBias::default(),
            qk_norm: false,
            sliding_window: None,
            moe: None,
            latent_attention: None,
        }
    }

    /// This Llama-shaped model with a mixture of experts in place of each block's MLP (a Mixtral,
    /// each expert `intermediate_size` wide; rope_theta as given).
    pub fn with_experts(self, moe: MoeConfig) -> Self {
        Self {
            family: Some(Family::Mixtral),
            moe: Some(Box::new(moe)),
            ..self
        }
    }

    /// The Hugging Face family (the architecture's own when the config predates families).
    pub fn family(&self) -> Family {
        self.family.unwrap_or(match self.arch {
            Arch::Llama => Family::Llama,
            Arch::Gpt2 => Family::Gpt2,
        })
    }

    /// The window of layer `layer`'s attention, if it has one.
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|w| layer >= w.first_layer)
            .map(|w| w.size)
    }

    /// The longest sequence the model takes: its positions, or, where the rotary frequencies follow
    /// the sequence length (dynamic NTK scaling), any length the engine handles.
    pub fn max_sequence_length(&self) -> usize {
        if self.rope_scaling.depends_on_length() {
            MAX_DIMENSION
        } else {
            self.max_position_embeddings
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
    /// The values' width: the keys' ([`ModelConfig::kv_dim`]) unless latent attention's value
    /// heads are narrower.
    pub fn v_dim(&self) -> usize {
        match self.latent_attention {
            Some(a) => self.num_kv_heads * a.v_head_dim,
            None => self.kv_dim(),
        }
    }
    /// The attention output's width (what `o_proj` takes): one value head per query head.
    pub fn attn_out_dim(&self) -> usize {
        match self.latent_attention {
            Some(a) => self.num_heads * a.v_head_dim,
            None => self.q_dim(),
        }
    }

    /// The widths of one token's attention tensors on one device of a tensor-parallel group of
    /// `tp` (each device its heads; KV heads fewer than the devices replicated): what the planner
    /// prices activations, buffers and traffic by.
    pub fn attention_widths(&self, tp: usize) -> AttentionWidths {
        let t = tp.max(1) as f64;
        let kv = self.head_dim as f64 * (self.num_kv_heads as f64 / t).max(1.0);
        let (q, out) = (self.q_dim() as f64 / t, self.attn_out_dim() as f64 / t);
        match self.latent_attention {
            // Every head its own key (num_kv_heads = heads); the latents are whole per device.
            Some(a) => AttentionWidths {
                q,
                k: q,
                v: out,
                out,
                latent: (2 * a.q_lora_rank.unwrap_or(0) + 2 * a.kv_lora_rank + a.qk_rope_head_dim)
                    as f64,
            },
            None => AttentionWidths {
                q,
                k: kv,
                v: kv,
                out,
                latent: 0.0,
            },
        }
    }

    /// Why the engine cannot train this model, if it cannot: `plan` prices every model it can
    /// describe, the engine runs the ones it implements. The one statement of what it implements.
    pub fn engine_refusal(&self) -> Option<String> {
        (self.latent_attention.is_some() || self.family() == Family::DeepseekV3).then(|| {
            format!(
                "a {} model (multi-head latent attention, group-limited sigmoid routing) is \
                 priced by `ferrotron plan` but not implemented by the engine yet: plan it, or \
                 train a Llama-, Qwen-, Mistral-, Mixtral-, Qwen-MoE- or GPT-2-family model",
                self.family().model_type()
            )
        })
    }

    /// Whether tensor parallelism of degree `tp` can split this model — every device takes whole
    /// query heads, whole KV heads (or whole replicas of them) and some of the MLP's columns — and
    /// if not, why. The one statement of the rule: the planner and the engine both ask it.
    pub fn tensor_parallel_split(&self, tp: usize) -> std::result::Result<(), String> {
        if tp == 0 {
            return Err("tp must be at least 1".into());
        }
        if !self.num_heads.is_multiple_of(tp) {
            return Err(format!(
                "{} attention heads do not divide over {tp} devices (tp must divide the heads)",
                self.num_heads
            ));
        }
        let kv = self.num_kv_heads;
        if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
            return Err(format!(
                "{kv} key/value heads neither divide over {tp} devices nor replicate evenly onto \
                 them (tp must divide the KV heads or be a multiple of them)"
            ));
        }
        if self.intermediate_size < tp {
            return Err(format!(
                "the MLP's {} columns are fewer than the {tp} devices",
                self.intermediate_size
            ));
        }
        Ok(())
    }

    /// Whether this model can run with its experts over `ep` of its `replicas` (dp·cp), and if not,
    /// the layout key at fault and why. A mixture of experts runs on data-parallel replicas,
    /// context-parallel groups (a token's experts do not depend on where its sequence is cut; the
    /// router statistics are summed over both), pipeline stages (its router statistics travel with
    /// each micro-batch) and tensor-parallel groups with or without sequence parallelism (each
    /// expert's columns split, the rows gathered before the block as for a dense MLP), its experts
    /// divided over an expert-parallel group carved from the replicas; under `etp=1` the tp group
    /// first divides the experts into `blocks` (= tp) blocks, each expert whole. The planner and
    /// the engine ask it through [`crate::layout::Layout::experts_fit`].
    pub fn experts_split(
        &self,
        ep: usize,
        replicas: usize,
        blocks: usize,
    ) -> std::result::Result<(), (&'static str, String)> {
        let Some(m) = &self.moe else {
            if blocks > 1 {
                return Err((
                    "etp",
                    "etp=1 keeps a mixture of experts' experts whole over the tp group, and \
                     this model has none: drop etp"
                        .into(),
                ));
            }
            return match ep {
                0 | 1 => Ok(()),
                _ => Err((
                    "ep",
                    format!(
                        "ep={ep} divides a mixture of experts' experts over devices, and this \
                         model has none: drop ep"
                    ),
                )),
            };
        };
        if blocks > 1 && !m.num_experts.is_multiple_of(blocks * ep.max(1)) {
            return Err((
                "etp",
                format!(
                    "etp=1 gives each of the tp={blocks} devices num_experts / tp experts, which \
                     ep={} divides further, and the model's {} experts do not divide by tp·ep = \
                     {}: use the default (each expert's columns over tp)",
                    ep.max(1),
                    m.num_experts,
                    blocks * ep.max(1)
                ),
            ));
        }
        if ep > 1 && !replicas.is_multiple_of(ep) {
            return Err((
                "ep",
                format!(
                    "ep={ep} carves the expert-parallel group from the {replicas} data-parallel \
                     replicas (dp·cp), and {ep} does not divide {replicas}: give a dp that ep \
                     divides"
                ),
            ));
        }
        if ep > 1 && !m.num_experts.is_multiple_of(ep) {
            return Err((
                "ep",
                format!(
                    "ep={ep} gives each device num_experts / ep experts, and the model's {} \
                     experts do not divide by {ep}",
                    m.num_experts
                ),
            ));
        }
        Ok(())
    }

    /// This model as a device holding `shard` of the experts holds it: every block's routed
    /// experts in that device's range only (the rest of the model whole).
    pub fn expert_shard(&self, shard: ExpertShard) -> ModelConfig {
        let mut out = self.clone();
        if let Some(m) = &mut out.moe {
            m.held = shard;
        }
        out
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
        if let Some(m) = &self.moe {
            if m.expert_size == 0 || m.expert_size > MAX_DIMENSION {
                return Err((
                    "moe_intermediate_size".into(),
                    format!("{} must be between 1 and {MAX_DIMENSION}", m.expert_size),
                ));
            }
            if let Some(l) = m.dense_layers.iter().find(|&&l| l >= self.num_layers) {
                return Err((
                    "mlp_only_layers".into(),
                    format!("layer {l} is beyond the model's {} layers", self.num_layers),
                ));
            }
            if m.sparse_step == 0 {
                return Err(("decoder_sparse_step".into(), "must be positive".into()));
            }
            if m.num_experts == 0 || m.num_experts > MAX_DIMENSION {
                return Err((
                    "num_local_experts".into(),
                    format!("{} must be between 1 and {MAX_DIMENSION}", m.num_experts),
                ));
            }
            if m.top_k == 0 || m.top_k > m.num_experts {
                return Err((
                    "num_experts_per_tok".into(),
                    format!(
                        "{} must be between 1 and the {} experts",
                        m.top_k, m.num_experts
                    ),
                ));
            }
            if !(m.aux_loss_coef.is_finite() && m.aux_loss_coef >= 0.0) {
                return Err((
                    "router_aux_loss_coef".into(),
                    format!("{} must be a finite number ≥ 0", m.aux_loss_coef),
                ));
            }
        }
        if let Some(a) = self.latent_attention {
            let widths = [
                ("kv_lora_rank", a.kv_lora_rank),
                ("v_head_dim", a.v_head_dim),
                ("qk_rope_head_dim", a.qk_rope_head_dim),
                ("q_lora_rank", a.q_lora_rank.unwrap_or(1)),
            ];
            for (name, value) in widths {
                if value == 0 || value > MAX_DIMENSION {
                    return Err((
                        name.into(),
                        format!("{value} must be between 1 and {MAX_DIMENSION}"),
                    ));
                }
            }
            if a.qk_rope_head_dim >= self.head_dim {
                return Err((
                    "qk_rope_head_dim".into(),
                    format!(
                        "{} leaves no unrotated part of the {}-wide query/key head",
                        a.qk_rope_head_dim, self.head_dim
                    ),
                ));
            }
        }
        if let Some(w) = self.sliding_window {
            if w.size == 0 {
                return Err(("sliding_window".into(), "must be positive".into()));
            }
        }
        if self.arch == Arch::Llama && !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err((
                "rope_theta".into(),
                format!(
                    "{} must be a positive number (RoPE's frequencies are powers of it; 0 gives NaN angles)",
                    self.rope_theta
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
        let (b, ffn) = (self.bias, f(self.intermediate_size));
        let biases = f(usize::from(b.qkv)) * (q + 2.0 * kv)
            + f(usize::from(b.o)) * h
            + f(usize::from(b.mlp)) * (2.0 * ffn + h);
        let head_norms = f(2 * usize::from(self.qk_norm)) * f(self.head_dim);
        // A mixture of experts: its blocks' experts and routers, its dense blocks' MLPs.
        let ffn_params = match &self.moe {
            Some(m) => {
                let sparse = f(m.expert_layers(self.num_layers));
                let experts = f(m.num_experts) * (mlp * h * f(m.expert_size) + h)
                    + f(usize::from(m.shared_expert_size > 0))
                        * (mlp * h * f(m.shared_expert_size) + h);
                (sparse * experts + (f(self.num_layers) - sparse) * mlp * h * ffn)
                    / f(self.num_layers.max(1))
            }
            None => mlp * h * ffn,
        };
        let attention = match self.latent_attention {
            Some(_) => self.attention_matmul_params(),
            None => 2.0 * h * q + 2.0 * h * kv,
        };
        let layer = attention + ffn_params + biases + head_norms;
        let tables = if self.tie_word_embeddings { 1.0 } else { 2.0 };
        f(self.num_layers) * layer
            + tables * f(self.vocab_size) * h
            + f(self.max_position_embeddings) * h
    }
}

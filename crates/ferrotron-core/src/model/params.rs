use super::config::{Arch, Family, ModelConfig};

/// How a 2-D weight is stored: Hugging Face `nn.Linear` keeps `[out, in]`, GPT-2's `Conv1D` keeps `[in, out]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    OutIn,
    InOut,
    /// Not a matrix used in a matmul: norms, biases, embedding tables.
    Other,
}

/// One parameter tensor as Hugging Face names and shapes it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub layout: WeightLayout,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The Hugging Face names of one transformer block's parameters.
#[derive(Debug, Clone)]
pub struct LayerParamNames {
    pub norm1_weight: String,
    pub norm1_bias: Option<String>,
    pub norm2_weight: String,
    pub norm2_bias: Option<String>,
    /// Llama: separate q/k/v projections; GPT-2: one fused `c_attn`.
    pub qkv: Vec<(String, Option<String>)>,
    pub attn_out: (String, Option<String>),
    /// The feed-forward block.
    pub ffn: FfnNames,
    /// Qwen3: the RMSNorms over each head of q and of k.
    pub qk_norm: Option<(String, String)>,
    /// DeepSeek's multi-head latent attention, in place of `qkv` (then empty).
    pub latent: Option<LatentNames>,
}

/// The projections and norms of multi-head latent attention (see `LatentAttention`).
#[derive(Debug, Clone)]
pub struct LatentNames {
    /// `q_a_proj` and `q_a_layernorm` before `q_b_proj`, or one `q_proj` without a query rank.
    pub q_a: Option<(String, String)>,
    pub q_b: String,
    pub kv_a: String,
    pub kv_a_norm: String,
    pub kv_b: String,
}

/// A block's feed-forward parameters: one MLP, or a router and its experts.
#[derive(Debug, Clone)]
pub enum FfnNames {
    Dense {
        /// Llama: gate and up; GPT-2: c_fc.
        mlp_in: Vec<(String, Option<String>)>,
        mlp_out: (String, Option<String>),
    },
    /// Mixtral's `block_sparse_moe`: `gate` (the router, `[experts, hidden]`) and each expert's
    /// `w1` (gate), `w3` (up) and `w2` (down) projections.
    Experts {
        router: String,
        /// The routed experts this copy holds, by their index in the router: all of them, unless
        /// split by expert parallelism (`MoeConfig::held`).
        experts: Vec<ExpertNames>,
        /// Qwen2-MoE: the shared expert and its gate (`[1, hidden]`); DeepSeek's shared experts
        /// (one MLP as wide as all of them) have no gate.
        shared: Option<(ExpertNames, Option<String>)>,
    },
}

/// One expert's SwiGLU MLP.
#[derive(Debug, Clone)]
pub struct ExpertNames {
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl ModelConfig {
    pub fn embedding_name(&self) -> &'static str {
        match self.arch {
            Arch::Llama => "model.embed_tokens.weight",
            Arch::Gpt2 => "transformer.wte.weight",
        }
    }
    pub fn position_embedding_name(&self) -> Option<&'static str> {
        match self.arch {
            Arch::Llama => None,
            Arch::Gpt2 => Some("transformer.wpe.weight"),
        }
    }
    pub fn final_norm_names(&self) -> (&'static str, Option<&'static str>) {
        match self.arch {
            Arch::Llama => ("model.norm.weight", None),
            Arch::Gpt2 => ("transformer.ln_f.weight", Some("transformer.ln_f.bias")),
        }
    }
    /// The output projection's parameter: `lm_head.weight`, or the input embedding when tied.
    pub fn lm_head_name(&self) -> &'static str {
        if self.tie_word_embeddings {
            self.embedding_name()
        } else {
            "lm_head.weight"
        }
    }

    pub fn layer_names(&self, i: usize) -> LayerParamNames {
        match self.arch {
            Arch::Llama => {
                let p = format!("model.layers.{i}");
                let w = |s: &str, bias: bool| {
                    let b = bias.then(|| format!("{p}.{s}.bias"));
                    (format!("{p}.{s}.weight"), b)
                };
                let b = self.bias;
                LayerParamNames {
                    norm1_weight: format!("{p}.input_layernorm.weight"),
                    norm1_bias: None,
                    norm2_weight: format!("{p}.post_attention_layernorm.weight"),
                    norm2_bias: None,
                    qkv: match self.latent_attention {
                        Some(_) => Vec::new(),
                        None => vec![
                            w("self_attn.q_proj", b.qkv),
                            w("self_attn.k_proj", b.qkv),
                            w("self_attn.v_proj", b.qkv),
                        ],
                    },
                    latent: self.latent_attention.map(|a| {
                        let x = |s: &str| format!("{p}.self_attn.{s}.weight");
                        LatentNames {
                            q_a: a.q_lora_rank.map(|_| (x("q_a_proj"), x("q_a_layernorm"))),
                            q_b: x(if a.q_lora_rank.is_some() {
                                "q_b_proj"
                            } else {
                                "q_proj"
                            }),
                            kv_a: x("kv_a_proj_with_mqa"),
                            kv_a_norm: x("kv_a_layernorm"),
                            kv_b: x("kv_b_proj"),
                        }
                    }),
                    attn_out: w("self_attn.o_proj", b.o),
                    ffn: match self.moe.as_ref().filter(|m| m.has_experts(i)) {
                        Some(m) => {
                            // Mixtral's `block_sparse_moe` (w1 gate, w3 up, w2 down); Qwen-MoE's
                            // `mlp` with gate_proj, up_proj, down_proj.
                            let block = self.moe_block();
                            let [gate, up, down] = match self.family() {
                                Family::Mixtral => ["w1", "w3", "w2"],
                                _ => ["gate_proj", "up_proj", "down_proj"],
                            };
                            let deepseek = self.family() == Family::DeepseekV3;
                            let shared = (m.shared_expert_size > 0).then(|| {
                                let module = if deepseek {
                                    "shared_experts"
                                } else {
                                    "shared_expert"
                                };
                                let x = |w: &str| format!("{p}.mlp.{module}.{w}.weight");
                                let names = ExpertNames {
                                    gate: x("gate_proj"),
                                    up: x("up_proj"),
                                    down: x("down_proj"),
                                };
                                let gate = format!("{p}.mlp.shared_expert_gate.weight");
                                (names, (!deepseek).then_some(gate))
                            });
                            FfnNames::Experts {
                                shared,
                                router: format!("{p}.{block}.gate.weight"),
                                experts: m
                                    .held
                                    .held(m.num_experts)
                                    .map(|e| {
                                        let x =
                                            |w: &str| format!("{p}.{block}.experts.{e}.{w}.weight");
                                        ExpertNames {
                                            gate: x(gate),
                                            up: x(up),
                                            down: x(down),
                                        }
                                    })
                                    .collect(),
                            }
                        }
                        None => FfnNames::Dense {
                            mlp_in: vec![w("mlp.gate_proj", b.mlp), w("mlp.up_proj", b.mlp)],
                            mlp_out: w("mlp.down_proj", b.mlp),
                        },
                    },
                    qk_norm: self.qk_norm.then(|| {
                        (
                            format!("{p}.self_attn.q_norm.weight"),
                            format!("{p}.self_attn.k_norm.weight"),
                        )
                    }),
                }
            }
            Arch::Gpt2 => {
                let p = format!("transformer.h.{i}");
                let wb = |s: &str| (format!("{p}.{s}.weight"), Some(format!("{p}.{s}.bias")));
                LayerParamNames {
                    norm1_weight: format!("{p}.ln_1.weight"),
                    norm1_bias: Some(format!("{p}.ln_1.bias")),
                    norm2_weight: format!("{p}.ln_2.weight"),
                    norm2_bias: Some(format!("{p}.ln_2.bias")),
                    qkv: vec![wb("attn.c_attn")],
                    attn_out: wb("attn.c_proj"),
                    ffn: FfnNames::Dense {
                        mlp_in: vec![wb("mlp.c_fc")],
                        mlp_out: wb("mlp.c_proj"),
                    },
                    qk_norm: None,
                    latent: None,
                }
            }
        }
    }

    /// Every trainable parameter, in Hugging Face order and shape (a tied head appears once).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let h = self.hidden_size;
        let f = self.intermediate_size;
        let mut out = Vec::new();
        let mut push = |name: String, shape: Vec<usize>, layout| {
            out.push(ParamSpec {
                name,
                shape,
                layout,
            })
        };
        push(
            self.embedding_name().into(),
            vec![self.vocab_size, h],
            WeightLayout::Other,
        );
        if let Some(wpe) = self.position_embedding_name() {
            push(
                wpe.into(),
                vec![self.max_position_embeddings, h],
                WeightLayout::Other,
            );
        }
        for i in 0..self.num_layers {
            let n = self.layer_names(i);
            push(n.norm1_weight.clone(), vec![h], WeightLayout::Other);
            if let Some(b) = &n.norm1_bias {
                push(b.clone(), vec![h], WeightLayout::Other);
            }
            match self.arch {
                Arch::Llama => {
                    let (q, kv) = (self.q_dim(), self.kv_dim());
                    // Each projection's weight `[out, in]`, then its bias `[out]` where it has one.
                    let linear = |push: &mut dyn FnMut(String, Vec<usize>, WeightLayout),
                                  names: &(String, Option<String>),
                                  out: usize,
                                  inp: usize| {
                        push(names.0.clone(), vec![out, inp], WeightLayout::OutIn);
                        if let Some(b) = &names.1 {
                            push(b.clone(), vec![out], WeightLayout::Other);
                        }
                    };
                    match (&n.latent, self.latent_attention) {
                        (Some(l), Some(a)) => {
                            let mut matrix = |name: &String, out: usize, inp: usize| {
                                push(name.clone(), vec![out, inp], WeightLayout::OutIn)
                            };
                            let q_in = match (&l.q_a, a.q_lora_rank) {
                                (Some((q_a, norm)), Some(rank)) => {
                                    matrix(q_a, rank, h);
                                    push(norm.clone(), vec![rank], WeightLayout::Other);
                                    rank
                                }
                                _ => h,
                            };
                            let (heads, nope) =
                                (self.num_heads, self.head_dim - a.qk_rope_head_dim);
                            push(l.q_b.clone(), vec![q, q_in], WeightLayout::OutIn);
                            let kv_a = vec![a.kv_lora_rank + a.qk_rope_head_dim, h];
                            push(l.kv_a.clone(), kv_a, WeightLayout::OutIn);
                            push(
                                l.kv_a_norm.clone(),
                                vec![a.kv_lora_rank],
                                WeightLayout::Other,
                            );
                            let kv_b = vec![heads * (nope + a.v_head_dim), a.kv_lora_rank];
                            push(l.kv_b.clone(), kv_b, WeightLayout::OutIn);
                            linear(&mut push, &n.attn_out, h, self.attn_out_dim());
                        }
                        _ => {
                            linear(&mut push, &n.qkv[0], q, h);
                            linear(&mut push, &n.qkv[1], kv, h);
                            linear(&mut push, &n.qkv[2], kv, h);
                            linear(&mut push, &n.attn_out, h, q);
                        }
                    }
                    if let Some((qn, kn)) = &n.qk_norm {
                        push(qn.clone(), vec![self.head_dim], WeightLayout::Other);
                        push(kn.clone(), vec![self.head_dim], WeightLayout::Other);
                    }
                    push(n.norm2_weight.clone(), vec![h], WeightLayout::Other);
                    match &n.ffn {
                        FfnNames::Dense { mlp_in, mlp_out } => {
                            linear(&mut push, &mlp_in[0], f, h);
                            linear(&mut push, &mlp_in[1], f, h);
                            linear(&mut push, mlp_out, h, f);
                        }
                        FfnNames::Experts {
                            router,
                            experts,
                            shared,
                        } => {
                            let moe = self.moe.as_ref().expect("experts have a configuration");
                            let shared_specs =
                                |push: &mut dyn FnMut(String, Vec<usize>, WeightLayout)| {
                                    if let Some((e, gate)) = shared {
                                        let s = moe.shared_expert_size;
                                        push(e.gate.clone(), vec![s, h], WeightLayout::OutIn);
                                        push(e.up.clone(), vec![s, h], WeightLayout::OutIn);
                                        push(e.down.clone(), vec![h, s], WeightLayout::OutIn);
                                        if let Some(gate) = gate {
                                            push(gate.clone(), vec![1, h], WeightLayout::OutIn);
                                        }
                                    }
                                };
                            // The checkpoint's order: Qwen2-MoE's shared expert first,
                            // DeepSeek's shared experts after the routed ones.
                            let deepseek = self.family() == Family::DeepseekV3;
                            if !deepseek {
                                shared_specs(&mut push);
                            }
                            let f = moe.expert_size;
                            push(
                                router.clone(),
                                vec![moe.num_experts, h],
                                WeightLayout::OutIn,
                            );
                            // The checkpoint's order: Mixtral's w1, w2, w3; Qwen's gate, up, down.
                            let mixtral = self.family() == Family::Mixtral;
                            for e in experts {
                                push(e.gate.clone(), vec![f, h], WeightLayout::OutIn);
                                if mixtral {
                                    push(e.down.clone(), vec![h, f], WeightLayout::OutIn);
                                    push(e.up.clone(), vec![f, h], WeightLayout::OutIn);
                                } else {
                                    push(e.up.clone(), vec![f, h], WeightLayout::OutIn);
                                    push(e.down.clone(), vec![h, f], WeightLayout::OutIn);
                                }
                            }
                            if deepseek {
                                shared_specs(&mut push);
                            }
                        }
                    }
                }
                Arch::Gpt2 => {
                    let bias = |p: &(String, Option<String>)| p.1.clone().expect("gpt2 has biases");
                    // q, k and v fused; q_dim() = hidden unless a tensor-parallel shard holds fewer heads.
                    let q = self.q_dim();
                    push(n.qkv[0].0.clone(), vec![h, 3 * q], WeightLayout::InOut);
                    push(bias(&n.qkv[0]), vec![3 * q], WeightLayout::Other);
                    push(n.attn_out.0.clone(), vec![q, h], WeightLayout::InOut);
                    push(bias(&n.attn_out), vec![h], WeightLayout::Other);
                    push(n.norm2_weight.clone(), vec![h], WeightLayout::Other);
                    push(
                        n.norm2_bias.clone().expect("gpt2 has biases"),
                        vec![h],
                        WeightLayout::Other,
                    );
                    let FfnNames::Dense { mlp_in, mlp_out } = &n.ffn else {
                        unreachable!("GPT-2 blocks are dense")
                    };
                    push(mlp_in[0].0.clone(), vec![h, f], WeightLayout::InOut);
                    push(bias(&mlp_in[0]), vec![f], WeightLayout::Other);
                    push(mlp_out.0.clone(), vec![f, h], WeightLayout::InOut);
                    push(bias(mlp_out), vec![h], WeightLayout::Other);
                }
            }
        }
        let (nw, nb) = self.final_norm_names();
        push(nw.into(), vec![h], WeightLayout::Other);
        if let Some(nb) = nb {
            push(nb.into(), vec![h], WeightLayout::Other);
        }
        if !self.tie_word_embeddings {
            push(
                "lm_head.weight".into(),
                vec![self.vocab_size, h],
                WeightLayout::OutIn,
            );
        }
        out
    }

    /// True if the pipeline stage that runs `layers` holds parameter `name`: its layers' parameters,
    /// the embedding on the first stage, the final norm and output layer (the tied embedding's copy
    /// included) on the last.
    pub fn stage_owns(&self, name: &str, layers: &std::ops::Range<usize>) -> bool {
        let (first, last) = (layers.start == 0, layers.end == self.num_layers);
        let (fw, fb) = self.final_norm_names();
        if first && (name == self.embedding_name() || Some(name) == self.position_embedding_name())
        {
            return true;
        }
        if last && (name == fw || Some(name) == fb || name == self.lm_head_name()) {
            return true;
        }
        layers.clone().any(|i| {
            let n = self.layer_names(i);
            let prefix = n
                .norm1_weight
                .rsplit_once(".input_layernorm")
                .or_else(|| n.norm1_weight.rsplit_once(".ln_1"))
                .map(|(p, _)| p);
            prefix.is_some_and(|p| name.starts_with(&format!("{p}.")))
        })
    }

    pub fn num_params(&self) -> usize {
        self.param_specs().iter().map(ParamSpec::numel).sum()
    }

    /// The parameters one token meets: with a mixture of experts, all but the experts it does not
    /// choose (`num_experts − top_k` of them in each block); every parameter otherwise.
    pub fn num_active_params(&self) -> usize {
        let idle = self.moe.as_ref().map_or(0, |m| {
            let expert = 3 * self.hidden_size * m.expert_size;
            m.expert_layers(self.num_layers) * (m.num_experts - m.top_k) * expert
        });
        self.num_params() - idle
    }

    /// The module a block's mixture of experts is under: Mixtral's `block_sparse_moe`, Qwen-MoE's
    /// `mlp` (beside the dense blocks' `mlp`).
    fn moe_block(&self) -> &'static str {
        match self.family() {
            Family::Mixtral => "block_sparse_moe",
            _ => "mlp",
        }
    }

    /// Whether parameter `name` belongs to a mixture of experts (a router, an expert, a shared
    /// expert or its gate), told by its name alone (asked for every tensor: no names are built).
    pub fn is_expert_param(&self, name: &str) -> bool {
        self.expert_block_part(name).is_some_and(|inner| {
            [
                "gate.",
                "experts.",
                "shared_expert.",
                "shared_experts.",
                "shared_expert_gate.",
            ]
            .iter()
            .any(|p| inner.starts_with(p))
        })
    }

    /// Whether a block's shared expert has a gate (Qwen2-MoE's sigmoid of the token; DeepSeek's
    /// shared experts have none).
    pub fn has_shared_expert_gate(&self) -> bool {
        self.moe.as_ref().is_some_and(|m| m.shared_expert_size > 0)
            && self.family() != Family::DeepseekV3
    }

    /// Whether parameter `name` is a mixture of experts' router or its shared expert's gate: the
    /// linear layers every device of a tensor-parallel group computes whole, from every row.
    pub fn is_router_param(&self, name: &str) -> bool {
        self.expert_block_part(name).is_some_and(|inner| {
            inner.starts_with("gate.") || inner.starts_with("shared_expert_gate.")
        })
    }

    /// What follows `model.layers.N.<moe block>.` in `name`, when block N has experts.
    fn expert_block_part<'a>(&self, name: &'a str) -> Option<&'a str> {
        let m = self.moe.as_ref()?;
        let (layer, rest) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)))?;
        let inner = rest
            .strip_prefix(self.moe_block())
            .and_then(|r| r.strip_prefix('.'))?;
        m.has_experts(layer).then_some(inner)
    }

    /// The routed expert parameter `name` belongs to (`…experts.N.…`), told by its name alone;
    /// `None` for every other tensor (a router, a shared expert, anything dense).
    pub fn routed_expert_of(&self, name: &str) -> Option<usize> {
        if !self.is_expert_param(name) {
            return None;
        }
        let (_, rest) = name.split_once(".experts.")?;
        rest.split('.').next()?.parse().ok()
    }

    /// Parameters that take part in a matmul for one token (everything active but the input
    /// embedding tables; the output head counts even when tied). This is the N of the
    /// 6·N·tokens rule.
    pub fn matmul_params(&self) -> usize {
        let mut n = self.num_active_params() - self.vocab_size * self.hidden_size;
        if let Some(_wpe) = self.position_embedding_name() {
            n -= self.max_position_embeddings * self.hidden_size;
        }
        if self.tie_word_embeddings {
            n += self.vocab_size * self.hidden_size;
        }
        n
    }

    /// The forward FLOPs of one query against one key, every head: QKᵀ over the query/key width
    /// and PV over the value width, 2·(q_dim + attn_out_dim) (4·q_dim where they are equal).
    pub fn attention_score_flops_per_key(&self) -> f64 {
        2.0 * (self.q_dim() + self.attn_out_dim()) as f64
    }

    /// The projections' parameters of one block's attention (full, unsharded): q, k, v and o, or
    /// latent attention's down- and up-projections and o.
    pub fn attention_matmul_params(&self) -> f64 {
        let h = self.hidden_size as f64;
        match self.latent_attention {
            Some(a) => {
                let (q, out) = (self.q_dim() as f64, self.attn_out_dim() as f64);
                let query = match a.q_lora_rank {
                    Some(r) => h * r as f64 + r as f64 * q,
                    None => h * q,
                };
                let kv_b_out = self.num_heads * (self.head_dim - a.qk_rope_head_dim + a.v_head_dim);
                query
                    + h * (a.kv_lora_rank + a.qk_rope_head_dim) as f64
                    + (a.kv_lora_rank * kv_b_out) as f64
                    + out * h
            }
            None => 2.0 * h * self.q_dim() as f64 + 2.0 * h * self.kv_dim() as f64,
        }
    }

    /// Training FLOPs of one step over `batch` sequences of `seq` tokens: 6·N·tokens for the matmuls
    /// (forward 2N, backward 4N) plus 3 × the score FLOPs per key (12·layers·q_dim·seq·tokens for
    /// QKᵀ and PV where heads are as wide as values; full, not causal-halved).
    /// The same model as `shared/bench/torch_train_bench.py`, so GFLOP/s figures compare.
    pub fn train_flops(&self, batch: usize, seq: usize) -> f64 {
        let tokens = (batch * seq) as f64;
        let dense = 6.0 * self.matmul_params() as f64 * tokens;
        let attn = 3.0
            * self.num_layers as f64
            * self.attention_score_flops_per_key()
            * seq as f64
            * tokens;
        dense + attn
    }
}

#[cfg(test)]
mod tests {
    use crate::model::preset;

    #[test]
    fn reference_param_counts() {
        // Counts printed by the reference generator (shared/reference/README.md).
        assert_eq!(preset("llama-tiny").unwrap().num_params(), 250_432);
        assert_eq!(preset("gpt2-tiny").unwrap().num_params(), 249_216);
    }
}

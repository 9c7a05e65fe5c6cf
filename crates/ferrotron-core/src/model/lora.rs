//! LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): beside each target
//! projection `y = W x` of a frozen base, two trainable matrices `A` (`[r, in]`) and `B` (`[out, r]`)
//! add `(alpha / r) · B A x`. This file says which modules a configuration targets, the adapter
//! tensors that makes (named as PEFT names them, less its `base_model.model.` prefix), their shapes,
//! and how each half splits under tensor parallelism. No arithmetic.

use super::config::{Arch, ModelConfig};
use super::params::{ExpertNames, FfnNames};
use super::params::{ParamSpec, WeightLayout};
use crate::error::{ConfigError, Result};

/// The prefix PEFT puts before a base model's module names in `adapter_model.safetensors`.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The largest rank accepted (a rank is a matrix dimension: bounded before sizes are multiplied).
pub const MAX_RANK: usize = 1 << 16;

/// A LoRA configuration: the rank, the scale's numerator and the target projections by their short
/// names (`q_proj`, `c_attn`, …; a name targets that projection in every layer, as PEFT's
/// `target_modules` list does).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<String>,
}

/// How a target's base weight is cut under tensor parallelism (Megatron's column/row splits), which
/// decides which half of its adapter is sharded with it: a column-parallel base shards `B` by output
/// rows and replicates `A`; a row-parallel base shards `A` by input columns and replicates `B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetSplit {
    Column,
    Row,
}

/// The two halves of an adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterHalf {
    /// `lora_A`, `[r, in]`: the down projection.
    A,
    /// `lora_B`, `[out, r]`: the up projection.
    B,
}

/// One target module of one layer: its Hugging Face module path (`model.layers.0.self_attn.q_proj`),
/// short name, dimensions (this shape's: a tensor-parallel shard's config gives the shard's) and split.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraTarget {
    pub module: String,
    pub short: String,
    pub layer: usize,
    pub in_dim: usize,
    pub out_dim: usize,
    pub split: TargetSplit,
}

impl LoraTarget {
    /// The base weight's parameter name.
    pub fn weight_name(&self) -> String {
        format!("{}.weight", self.module)
    }
    pub fn adapter_name(&self, half: AdapterHalf) -> String {
        match half {
            AdapterHalf::A => format!("{}.lora_A.weight", self.module),
            AdapterHalf::B => format!("{}.lora_B.weight", self.module),
        }
    }
}

/// The projections of layer `i` that LoRA can target, in the block's order, as [`LoraTarget`]s:
/// attention's, then the MLP's, or under a mixture of experts each held expert's gate, up and down
/// projections (Mixtral's `w1`, `w3`, `w2`) and the shared expert's. The names are the checkpoint's
/// ([`ModelConfig::layer_names`]); a router is not a projection LoRA adapts.
fn projections(cfg: &ModelConfig, i: usize) -> Vec<LoraTarget> {
    let names = cfg.layer_names(i);
    let (h, f, q, kv) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let mut out = Vec::new();
    let mut add = |weight: &str, in_dim: usize, out_dim: usize, split: TargetSplit| {
        let module = weight
            .strip_suffix(".weight")
            .expect("a projection's weight is named `….weight`");
        out.push(LoraTarget {
            module: module.to_string(),
            short: module.rsplit('.').next().unwrap_or(module).to_string(),
            layer: i,
            in_dim,
            out_dim,
            split,
        });
    };
    use TargetSplit::{Column, Row};
    match cfg.arch {
        // Latent attention: the up-projections, split by heads as q/k/v are (the down-projections,
        // whole on every device, are not targets).
        Arch::Llama => match (&names.latent, cfg.latent_attention) {
            (Some(l), Some(a)) => {
                add(&l.q_b, a.q_lora_rank.unwrap_or(h), q, Column);
                let kv_b = cfg.num_heads * (cfg.head_dim - a.qk_rope_head_dim + a.v_head_dim);
                add(&l.kv_b, a.kv_lora_rank, kv_b, Column);
            }
            _ => {
                let [qw, kw, vw] = [0, 1, 2].map(|k| &names.qkv[k].0);
                add(qw, h, q, Column);
                add(kw, h, kv, Column);
                add(vw, h, kv, Column);
            }
        },
        Arch::Gpt2 => add(&names.qkv[0].0, h, 3 * q, Column),
    }
    add(&names.attn_out.0, cfg.attn_out_dim(), h, Row);
    match &names.ffn {
        FfnNames::Dense { mlp_in, mlp_out } => {
            for (w, _) in mlp_in {
                add(w, h, f, Column);
            }
            add(&mlp_out.0, f, h, Row);
        }
        FfnNames::Experts {
            experts, shared, ..
        } => {
            let m = cfg
                .moe
                .as_ref()
                .expect("a block with experts has a MoE config");
            let mut expert = |e: &ExpertNames, width: usize| {
                add(&e.gate, h, width, Column);
                add(&e.up, h, width, Column);
                add(&e.down, width, h, Row);
            };
            for e in experts {
                expert(e, m.expert_size);
            }
            if let Some((e, _gate)) = shared {
                expert(e, m.shared_expert_size);
            }
        }
    }
    out
}

impl LoraConfig {
    /// The short names of every projection of `cfg` (what `--lora-targets` defaults to), in the
    /// order a block holds them: a mixture of experts' experts are `w1`, `w3`, `w2` (Mixtral) or
    /// `gate_proj`, `up_proj`, `down_proj` (Qwen-MoE, as its shared expert's and dense blocks').
    pub fn all_targets(cfg: &ModelConfig) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for i in 0..cfg.num_layers {
            for p in projections(cfg, i) {
                if !out.contains(&p.short) {
                    out.push(p.short);
                }
            }
        }
        out
    }

    /// A configuration for `cfg`'s architecture; `targets` empty means every projection. Refuses a
    /// rank of 0 or over [`MAX_RANK`], a non-positive or non-finite alpha, and a target the
    /// architecture does not have, naming it.
    pub fn new(cfg: &ModelConfig, rank: usize, alpha: f64, targets: &[String]) -> Result<Self> {
        let lora = Self {
            rank,
            alpha,
            targets: if targets.is_empty() {
                Self::all_targets(cfg)
            } else {
                let mut t: Vec<String> = targets.iter().map(|s| s.trim().to_string()).collect();
                t.dedup();
                t
            },
        };
        lora.validate(cfg)?;
        Ok(lora)
    }

    /// What [`LoraConfig::new`] checks, for a configuration read from a file.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let bad = |what: String| Err(ConfigError::Invalid(format!("LoRA: {what}")));
        if self.rank == 0 || self.rank > MAX_RANK {
            return bad(format!(
                "rank {} must be between 1 and {MAX_RANK}",
                self.rank
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("alpha {} must be a positive number", self.alpha));
        }
        if self.targets.is_empty() {
            return bad("no target modules".into());
        }
        let known = Self::all_targets(cfg);
        if let Some(t) = self.targets.iter().find(|t| !known.contains(t)) {
            let what = if cfg.moe.is_some() && t == "gate" {
                " (it is the router: LoRA adapts the experts and attention, not routing)"
            } else {
                ""
            };
            return bad(format!(
                "target module `{t}` is not a projection of a {:?} model{what} (targets: {})",
                cfg.arch,
                known.join(", ")
            ));
        }
        let smallest = self
            .modules(cfg)
            .iter()
            .map(|p| p.in_dim.min(p.out_dim))
            .min()
            .unwrap_or(usize::MAX);
        if self.rank > smallest {
            return bad(format!(
                "rank {} exceeds the smallest targeted dimension ({smallest}): not low-rank",
                self.rank
            ));
        }
        Ok(())
    }

    /// `alpha / r`, the factor of `B A x`.
    pub fn scale(&self) -> f32 {
        (self.alpha / self.rank as f64) as f32
    }

    /// Every targeted module of `cfg` (layer by layer, in each block's order).
    pub fn modules(&self, cfg: &ModelConfig) -> Vec<LoraTarget> {
        (0..cfg.num_layers)
            .flat_map(|i| self.layer_modules(cfg, i))
            .collect()
    }

    /// The targeted modules of layer `i`, in the block's order (under expert parallelism, of the
    /// experts `cfg` holds).
    pub fn layer_modules(&self, cfg: &ModelConfig, i: usize) -> Vec<LoraTarget> {
        projections(cfg, i)
            .into_iter()
            .filter(|p| self.targets.contains(&p.short))
            .collect()
    }

    /// The targeted module whose base weight is `weight_name`, if any.
    pub fn target_of_weight(&self, cfg: &ModelConfig, weight_name: &str) -> Option<LoraTarget> {
        let module = weight_name.strip_suffix(".weight")?;
        self.modules(cfg).into_iter().find(|t| t.module == module)
    }

    /// The adapter tensors of `cfg`: for each target, `lora_A` `[r, in]` then `lora_B` `[out, r]`
    /// (both `nn.Linear` weights, whatever the base's layout).
    pub fn adapter_specs(&self, cfg: &ModelConfig) -> Vec<ParamSpec> {
        let r = self.rank;
        self.modules(cfg)
            .into_iter()
            .flat_map(|t| {
                [
                    ParamSpec {
                        name: t.adapter_name(AdapterHalf::A),
                        shape: vec![r, t.in_dim],
                        layout: WeightLayout::OutIn,
                    },
                    ParamSpec {
                        name: t.adapter_name(AdapterHalf::B),
                        shape: vec![t.out_dim, r],
                        layout: WeightLayout::OutIn,
                    },
                ]
            })
            .collect()
    }

    /// Adapter parameters of `cfg` (this shape's: a shard's config counts the shard's).
    pub fn num_params(&self, cfg: &ModelConfig) -> usize {
        self.adapter_specs(cfg).iter().map(ParamSpec::numel).sum()
    }
}

/// How projection `module` (a module path such as `model.layers.0.self_attn.o_proj`) of `cfg`'s
/// architecture is split under tensor parallelism; `None` for anything that is not a projection.
pub fn projection_split(cfg: &ModelConfig, module: &str) -> Option<TargetSplit> {
    let rest = module
        .strip_prefix("model.layers.")
        .or_else(|| module.strip_prefix("transformer.h."))?;
    let (layer, _) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if layer >= cfg.num_layers {
        return None;
    }
    projections(cfg, layer)
        .into_iter()
        .find(|p| p.module == module)
        .map(|p| p.split)
}

/// Whether `cfg`'s frozen base can be stored quantized (QLoRA), or why not: a mixture of experts'
/// cannot yet — which of its tensors a 4-bit base quantizes (routers, fused experts) has no
/// reference here, so it is refused rather than guessed.
pub fn check_quantized_base(cfg: &ModelConfig) -> std::result::Result<(), String> {
    if cfg.moe.is_some() {
        return Err(
            "a 4-bit base of a mixture of experts is not implemented yet (train its \
                    adapters on the unquantized base: leave --quantize-base out)"
                .into(),
        );
    }
    Ok(())
}

/// Whether `name` is the weight of one of the decoder's projections (its linear layers): what
/// transformers' 4-bit loading quantizes. The embeddings, the norms and `lm_head` are not.
pub fn is_projection_weight(cfg: &ModelConfig, name: &str) -> bool {
    name.strip_suffix(".weight")
        .is_some_and(|module| projection_split(cfg, module).is_some())
}

/// Which target and half an adapter tensor name belongs to: (`model.layers.0.self_attn.q_proj`, A).
pub fn adapter_parts(name: &str) -> Option<(&str, AdapterHalf)> {
    if let Some(m) = name.strip_suffix(".lora_A.weight") {
        return Some((m, AdapterHalf::A));
    }
    name.strip_suffix(".lora_B.weight")
        .map(|m| (m, AdapterHalf::B))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::preset;

    #[test]
    fn adapters_are_named_and_shaped_as_peft_writes_them() {
        let cfg = preset("llama-tiny").unwrap();
        let lora = LoraConfig::new(&cfg, 4, 8.0, &[]).unwrap();
        let specs = lora.adapter_specs(&cfg);
        assert_eq!(specs.len(), 4 * 7 * 2);
        let q_a = &specs[0];
        assert_eq!(q_a.name, "model.layers.0.self_attn.q_proj.lora_A.weight");
        assert_eq!(q_a.shape, vec![4, 64]);
        let down_b = specs
            .iter()
            .find(|s| s.name == "model.layers.3.mlp.down_proj.lora_B.weight")
            .unwrap();
        assert_eq!(down_b.shape, vec![64, 4]);
        assert_eq!(lora.scale(), 2.0);
        let gpt = preset("gpt2-tiny").unwrap();
        let lora = LoraConfig::new(&gpt, 4, 8.0, &["c_proj".into()]).unwrap();
        // `c_proj` is both attention's and the MLP's output projection, as in PEFT.
        let names: Vec<String> = lora
            .modules(&gpt)
            .iter()
            .map(|t| t.module.clone())
            .collect();
        assert_eq!(
            &names[..2],
            ["transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj"]
        );
        assert_eq!(
            adapter_parts("transformer.h.0.mlp.c_fc.lora_B.weight"),
            Some(("transformer.h.0.mlp.c_fc", AdapterHalf::B))
        );
    }

    #[test]
    fn bad_configurations_name_what_is_wrong() {
        let cfg = preset("llama-tiny").unwrap();
        for (rank, alpha, targets, want) in [
            (0, 8.0, vec![], "rank 0"),
            (4, 0.0, vec![], "alpha 0"),
            (4, f64::NAN, vec![], "alpha NaN"),
            (4, 8.0, vec!["c_attn".to_string()], "`c_attn`"),
            (100, 8.0, vec![], "exceeds"),
        ] {
            let e = LoraConfig::new(&cfg, rank, alpha, &targets)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}

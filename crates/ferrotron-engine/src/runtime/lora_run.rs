//! What a LoRA run trains and where its adapters start: a resumed checkpoint's adapters, a PEFT
//! adapter directory (`--adapter`), or fresh ones (`--lora-rank`). The flags must agree with the
//! adapters they continue; a checkpoint of full training never resumes as LoRA, nor the reverse.

use super::config::TrainConfig;
use crate::checkpoint::Checkpoint;
use crate::error::{EngineError, Result};
use crate::hf::ModelWeights;
use crate::lora::Adapters;
use crate::parallel::WeightSource;
use crate::transformer::ParamStore;
use ferrotron_core::model::{LoraConfig, ModelConfig};
use ferrotron_core::precision::BaseQuantization;
use std::sync::OnceLock;

/// A LoRA run's frozen base.
pub(super) enum BaseWeights {
    /// In memory: a preset's, or (QLoRA) quantized as it was read — the quantization constants
    /// are the whole tensor's, so a device's shard is cut from the quantized whole.
    Loaded(ParamStore),
    /// Where the model is stored: each device reads its own shard.
    Stored(Box<StoredBase>),
}

/// A base where the model is stored; the whole of it is read only where it is needed (rank 0's
/// evaluations and merged export), once, when first asked for.
pub(super) struct StoredBase {
    weights: ModelWeights,
    model: ModelConfig,
    whole: OnceLock<ParamStore>,
}

impl BaseWeights {
    pub fn stored(weights: ModelWeights, model: &ModelConfig) -> Self {
        BaseWeights::Stored(Box::new(StoredBase {
            weights,
            model: model.clone(),
            whole: OnceLock::new(),
        }))
    }

    /// Where each device reads its shard of the base.
    pub fn shards(&self) -> &dyn WeightSource {
        match self {
            BaseWeights::Loaded(p) => p,
            BaseWeights::Stored(s) => &s.weights,
        }
    }

    /// The whole base (read at the first call where it is stored).
    pub fn whole(&self) -> Result<&ParamStore> {
        match self {
            BaseWeights::Loaded(p) => Ok(p),
            BaseWeights::Stored(s) => {
                if s.whole.get().is_none() {
                    let _ = s.whole.set(s.weights.load(&s.model, None)?);
                }
                Ok(s.whole.get().expect("set above"))
            }
        }
    }
}

/// The LoRA configuration the flags describe on their own (`None` without `--lora-rank`).
fn from_flags(cfg: &TrainConfig, model: &ModelConfig) -> Result<Option<LoraConfig>> {
    let Some(rank) = cfg.lora.lora_rank else {
        return Ok(None);
    };
    let alpha = cfg.lora.lora_alpha.unwrap_or(2.0 * rank as f64);
    Ok(Some(LoraConfig::new(
        model,
        rank,
        alpha,
        &cfg.lora_targets(),
    )?))
}

/// Refuses flags that contradict the adapters `found` (from `what`): each given flag must match.
fn agree(cfg: &TrainConfig, found: &LoraConfig, what: &str) -> Result<()> {
    let mismatch = |flag: &str, given: String, has: String| {
        Err(EngineError::Invalid(format!(
            "--{flag} {given}: {what} has {has} (leave the flag out to continue them as they are)"
        )))
    };
    if let Some(r) = cfg.lora.lora_rank.filter(|&r| r != found.rank) {
        return mismatch("lora-rank", r.to_string(), format!("rank {}", found.rank));
    }
    if let Some(a) = cfg.lora.lora_alpha.filter(|&a| a != found.alpha) {
        return mismatch(
            "lora-alpha",
            a.to_string(),
            format!("alpha {}", found.alpha),
        );
    }
    let targets = cfg.lora_targets();
    if !targets.is_empty() && targets != found.targets {
        return mismatch(
            "lora-targets",
            targets.join(","),
            format!("targets {}", found.targets.join(",")),
        );
    }
    Ok(())
}

/// The adapters a run trains, if it trains LoRA: from the checkpoint it resumes, from `--adapter`,
/// or fresh (seeded by `seed`).
pub(super) fn resolve(
    cfg: &TrainConfig,
    model: &ModelConfig,
    resume: Option<&Checkpoint>,
) -> Result<Option<Adapters>> {
    let asks = cfg.lora.lora_rank.is_some() || cfg.lora.adapter.is_some();
    if let Some(ck) = resume {
        return match (&ck.manifest.lora, asks) {
            (Some(config), _) => {
                if cfg.lora.adapter.is_some() {
                    return Err(EngineError::Invalid(format!(
                        "--adapter and --resume: {} continues its own adapters (with their \
                         optimizer state); give one of the two",
                        ck.dir.display()
                    )));
                }
                agree(cfg, config, &format!("the checkpoint {}", ck.dir.display()))?;
                Ok(Some(Adapters {
                    config: config.clone(),
                    params: ck.params()?,
                }))
            }
            (None, true) => Err(EngineError::Invalid(format!(
                "{} is a checkpoint of full training; it cannot resume as LoRA. Export it \
                 (`ferrotron checkpoint export --hf DIR`) and fine-tune that model with \
                 --lora-rank",
                ck.dir.display()
            ))),
            (None, false) => Ok(None),
        };
    }
    if let Some(dir) = &cfg.lora.adapter {
        let adapters = Adapters::load_peft(dir, model)?;
        agree(
            cfg,
            &adapters.config,
            &format!("the adapter {}", dir.display()),
        )?;
        return Ok(Some(adapters));
    }
    Ok(from_flags(cfg, model)?.map(|config| Adapters::init(model, config, cfg.input.seed)))
}

/// How the frozen base is stored: as `--quantize-base` says, or as the LoRA checkpoint resumed
/// from was trained (its adapters continue on the same base, bit for bit). `lora` says whether the
/// run trains adapters at all.
pub(super) fn base_quantization(
    cfg: &TrainConfig,
    model: &ModelConfig,
    resume: Option<&Checkpoint>,
    lora: bool,
) -> Result<Option<BaseQuantization>> {
    let asked = cfg.lora.quantize_base;
    if let Some(q) = asked {
        ferrotron_core::model::check_quantized_base(model)
            .map_err(|why| EngineError::Invalid(format!("--quantize-base {q}: {why}")))?;
    }
    let trained_on = resume
        .filter(|ck| ck.manifest.lora.is_some())
        .map(|ck| (ck, ck.manifest.quantize_base));
    match (asked, trained_on) {
        (Some(q), Some((ck, None))) => Err(EngineError::Invalid(format!(
            "--quantize-base {q}: the adapters in {} trained on an unquantized base, and a resume \
             continues them on the same one (leave the flag out, or start a new run from their \
             exported adapter with --adapter and --quantize-base)",
            ck.dir.display()
        ))),
        (_, Some((_, recorded))) => Ok(recorded),
        (Some(q), None) if !lora => Err(EngineError::Invalid(format!(
            "--quantize-base {q} quantizes a frozen base: give --lora-rank or --adapter too \
             (full training updates every weight, which a 4-bit base cannot hold)"
        ))),
        (asked, None) => Ok(asked),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::model::preset;

    #[test]
    fn flags_make_fresh_adapters_and_must_agree_with_loaded_ones() {
        let model = preset("llama-tiny").unwrap();
        let none = TrainConfig::default();
        assert!(resolve(&none, &model, None).unwrap().is_none());
        let cfg = {
            let mut c = TrainConfig::default();
            c.lora.lora_rank = Some(4);
            c.lora.lora_targets = "q_proj,v_proj".into();
            c
        };
        let ad = resolve(&cfg, &model, None).unwrap().unwrap();
        assert_eq!((ad.config.rank, ad.config.alpha), (4, 8.0));
        assert_eq!(ad.params.specs.len(), 4 * 2 * 2);
        let e = agree(
            &{
                let mut c = cfg.clone();
                c.lora.lora_rank = Some(8);
                c
            },
            &ad.config,
            "the adapter x",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--lora-rank 8") && e.contains("rank 4"), "{e}");
        assert!(agree(&cfg, &ad.config, "x").is_ok());
    }
}

//! The planner's inputs: model (config.json, preset, inline shape or a bare parameter count), precision
//! policy, optimizer, activation model.

use crate::error::{ConfigError, Result};
use crate::model::{preset, Arch, ModelConfig, MAX_DIMENSION, MAX_PARAMS, PRESET_NAMES};
use crate::precision::StateDtypes;
use std::path::Path;

/// What the planner knows of the model.
#[derive(Debug, Clone, PartialEq)]
pub enum PlanModel {
    Shape(ModelConfig),
    /// Only a parameter count: model-state memory, no activations or time.
    ParamsOnly(f64),
}

pub const PLAN_MODEL_PRESETS: &[&str] = &[
    "gpt3-175b",
    "bloom-176b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
];

fn bad(field: &str, msg: String) -> ConfigError {
    ConfigError::Field {
        file: "--model".into(),
        field: field.into(),
        msg,
    }
}

impl PlanModel {
    pub fn parse(spec: &str) -> Result<Self> {
        let spec = spec.trim();
        if let Some(n) = spec.strip_prefix("params=") {
            let p: f64 = n
                .parse()
                .map_err(|_| bad("params", format!("`{n}` is not a number")))?;
            if !(p.is_finite() && p >= 1.0) {
                return Err(bad("params", format!("`{n}` must be at least 1")));
            }
            if p > MAX_PARAMS {
                return Err(bad(
                    "params",
                    format!("`{n}` is beyond the {MAX_PARAMS:.0e} parameters the planner's byte counts hold"),
                ));
            }
            return Ok(Self::ParamsOnly(p));
        }
        if spec.contains('=') {
            return Self::parse_inline(spec);
        }
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(Self::Shape(ModelConfig::from_hf_file(
                &path.join("config.json"),
            )?));
        }
        if path.is_file() {
            return Ok(Self::Shape(ModelConfig::from_hf_file(path)?));
        }
        Ok(Self::Shape(match spec {
            "gpt3-175b" => ModelConfig::gpt2(51200, 12288, 49152, 96, 96, 2048),
            // BLOOM-176B: GPT-shaped (LayerNorm, 4h GELU MLP, tied embedding) with ALiBi instead of
            // learned positions; counted with 2048 learned positions, 0.02% of its parameters.
            "bloom-176b" => ModelConfig::gpt2(250880, 14336, 57344, 70, 112, 2048),
            "llama2-7b" => ModelConfig::llama(32000, 4096, 11008, 32, 32, 32, 4096, 10000.0),
            "llama2-13b" => ModelConfig::llama(32000, 5120, 13824, 40, 40, 40, 4096, 10000.0),
            "llama2-70b" => ModelConfig::llama(32000, 8192, 28672, 80, 64, 8, 4096, 10000.0),
            "llama3-8b" => ModelConfig::llama(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
            "llama3-70b" => ModelConfig::llama(128256, 8192, 28672, 80, 64, 8, 8192, 500000.0),
            other => match preset(other) {
                Ok(c) => c,
                Err(_) => {
                    return Err(bad(
                        "preset",
                        format!(
                            "`{other}` is not a config.json, a directory, an inline shape or a preset (presets: {}, {})",
                            PLAN_MODEL_PRESETS.join(", "),
                            PRESET_NAMES.join(", ")
                        ),
                    ))
                }
            },
        }))
    }

    /// `arch=gpt,layers=96,hidden=12288,heads=96,kv_heads=96,ffn=49152,vocab=51200[,positions=2048]`
    fn parse_inline(spec: &str) -> Result<Self> {
        let mut arch = None;
        let mut nums = std::collections::HashMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| bad(item, "expected key=value".into()))?;
            if k == "arch" {
                if arch.is_some() {
                    return Err(bad("arch", "given twice".into()));
                }
                arch = Some(match v {
                    "gpt" | "gpt2" => Arch::Gpt2,
                    "llama" => Arch::Llama,
                    other => return Err(bad("arch", format!("`{other}` is not gpt or llama"))),
                });
                continue;
            }
            if ![
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "ffn",
                "vocab",
                "positions",
            ]
            .contains(&k)
            {
                return Err(bad(k, "unknown model key".into()));
            }
            let n: i64 = v
                .parse()
                .map_err(|_| bad(k, format!("`{v}` is not an integer")))?;
            if n <= 0 {
                return Err(bad(k, format!("`{v}` must be positive")));
            }
            if n as u64 > MAX_DIMENSION as u64 {
                return Err(bad(
                    k,
                    format!("{n} is beyond the largest size handled ({MAX_DIMENSION})"),
                ));
            }
            if nums.insert(k, n as usize).is_some() {
                return Err(bad(k, "given twice".into()));
            }
        }
        let get = |k: &str| nums.get(k).copied().ok_or_else(|| bad(k, "missing".into()));
        let arch = arch.ok_or_else(|| bad("arch", "missing".into()))?;
        let (layers, hidden, heads) = (get("layers")?, get("hidden")?, get("heads")?);
        let kv = nums.get("kv_heads").copied().unwrap_or(heads);
        let ffn = nums.get("ffn").copied().unwrap_or(4 * hidden);
        let vocab = get("vocab")?;
        let positions = nums.get("positions").copied().unwrap_or(2048);
        let cfg = match arch {
            Arch::Gpt2 => ModelConfig::gpt2(vocab, hidden, ffn, layers, heads, positions),
            Arch::Llama => {
                ModelConfig::llama(vocab, hidden, ffn, layers, heads, kv, positions, 10000.0)
            }
        };
        cfg.validate().map_err(|(f, m)| bad(&f, m))?;
        Ok(Self::Shape(cfg))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adam,
    /// SGD with momentum: one state.
    Sgd,
    /// Adam with 8-bit moments (block-wise quantised; the small per-block scales are ignored).
    Adam8bit,
}

impl OptimizerKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "adam" | "adamw" => Ok(Self::Adam),
            "sgd" => Ok(Self::Sgd),
            "adam8bit" => Ok(Self::Adam8bit),
            other => Err(ConfigError::Field {
                file: "--optimizer".into(),
                field: "optimizer".into(),
                msg: format!("`{other}` is not adam, sgd or adam8bit"),
            }),
        }
    }
    pub fn state_bytes(self, p: &StateDtypes) -> f64 {
        match self {
            Self::Adam => 2.0 * p.optimizer.bytes(),
            Self::Sgd => p.optimizer.bytes(),
            Self::Adam8bit => 2.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationModel {
    /// Exactly what ferrotron's kernels keep for backward (comparable with the runtime's measurement).
    Ferrotron,
    /// Korthikanti et al. 2022's published per-layer accounting.
    Megatron,
}

impl ActivationModel {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ferrotron" => Ok(Self::Ferrotron),
            "megatron" => Ok(Self::Megatron),
            other => Err(ConfigError::Field {
                file: "--activation-model".into(),
                field: "activation-model".into(),
                msg: format!("`{other}` is not ferrotron or megatron"),
            }),
        }
    }
}

/// What attention keeps for its backward, which decides whether activations grow with the square of
/// the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// Memory-efficient (FlashAttention-style, the engine's kernel): each query row's log-sum-exp;
    /// backward recomputes the probabilities tile by tile.
    Flash,
    /// Every head's T×T probabilities (the kernels Korthikanti et al. 2022 counted, and the
    /// published figures they reproduce).
    Materialized,
}

impl AttentionKernel {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "flash" => Ok(Self::Flash),
            "materialized" => Ok(Self::Materialized),
            other => Err(ConfigError::Field {
                file: "--attention".into(),
                field: "attention".into(),
                msg: format!(
                    "`{other}` is not flash (memory-efficient, the engine's kernel) or materialized \
                     (T×T probabilities kept for backward)"
                ),
            }),
        }
    }
}

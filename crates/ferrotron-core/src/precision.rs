//! The one precision policy of a run, and the number formats it is made of.
//!
//! A run says `f32`, `bf16` or `fp16` once, at the settings boundary; [`MixedPrecision::parse`] turns
//! it into a value, and every part of the engine derives what it needs from that value where it is
//! used: the 16-bit storage of weights, gradients and the activation stash ([`MixedPrecision::storage`]),
//! the format tensors travel in ([`MixedPrecision::wire`]), the arithmetic of the products
//! ([`MixedPrecision::products`]), dynamic loss scaling ([`MixedPrecision::needs_loss_scaling`]) and
//! the planner's bytes per term ([`MixedPrecision::state_dtypes`]). No precision string exists past
//! the parsers in this file.

use crate::error::{ConfigError, Result};

/// A 16-bit float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Half {
    Bf16,
    F16,
}

impl Half {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

/// The arithmetic of the linear layers' (and attention's) products: f32, or bf16 operands with f32
/// accumulation. There is no f16 product: an fp16 run multiplies in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Products {
    #[default]
    F32,
    Bf16,
}

impl Products {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// How a run trains: in f32 throughout, or in mixed precision — weights, gradients and activations
/// stored (and moved) in a 16-bit format, master weights and optimizer state in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MixedPrecision {
    #[default]
    F32,
    /// bf16 storage, bf16 products where the CPU has them.
    Bf16,
    /// fp16 storage, f32 products, dynamic loss scaling.
    Fp16,
}

impl MixedPrecision {
    /// The names a user writes: `f32`/`fp32`, `bf16`, `fp16`/`f16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "f32" | "fp32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "fp16" | "f16" => Ok(Self::Fp16),
            other => Err(ConfigError::Field {
                file: "--precision".into(),
                field: "precision".into(),
                msg: format!("`{other}` is not f32, bf16 or fp16"),
            }),
        }
    }

    /// The name [`MixedPrecision::parse`] takes back.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    /// The 16-bit format of the weights' compute copy, the gradients and the activation stash
    /// (`None`: f32).
    pub fn storage(self) -> Option<Half> {
        match self {
            Self::F32 => None,
            Self::Bf16 => Some(Half::Bf16),
            Self::Fp16 => Some(Half::F16),
        }
    }

    /// The format activations and gradients are sent in: the storage format.
    pub fn wire(self) -> Option<Half> {
        self.storage()
    }

    /// The arithmetic of the products.
    pub fn products(self) -> Products {
        match self {
            Self::Bf16 => Products::Bf16,
            Self::F32 | Self::Fp16 => Products::F32,
        }
    }

    /// fp16's narrow exponent needs dynamic loss scaling; bf16 has f32's range.
    pub fn needs_loss_scaling(self) -> bool {
        self == Self::Fp16
    }

    /// The planner's bytes per model-state term under this policy.
    pub fn state_dtypes(self) -> StateDtypes {
        let half = match self.storage() {
            None => Dtype::Fp32,
            Some(Half::Bf16) => Dtype::Bf16,
            Some(Half::F16) => Dtype::Fp16,
        };
        StateDtypes {
            weights: half,
            grads: half,
            master: Dtype::Fp32,
            optimizer: Dtype::Fp32,
        }
    }
}

impl std::fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for MixedPrecision {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

crate::serde_as_text!(MixedPrecision);

/// How a LoRA run stores its frozen base's projections: NF4 (QLoRA: 4-bit NormalFloat in blocks of
/// 64, double-quantized constants, as bitsandbytes' `nf4` with `use_double_quant`), about 0.52
/// bytes a parameter against bf16's 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseQuantization {
    Nf4,
}

impl BaseQuantization {
    /// The name [`BaseQuantization::parse`] takes back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "nf4" => Ok(Self::Nf4),
            other => Err(ConfigError::Field {
                file: "--quantize-base".into(),
                field: "quantize_base".into(),
                msg: format!("`{other}` is not a base quantization (nf4)"),
            }),
        }
    }

    /// Bytes of a quantized `n`-value matrix: the packed 4-bit codes, one 8-bit absmax code a
    /// block of 64, one f32 scale a group of 256 blocks, and the f32 offset.
    pub fn matrix_bytes(self, n: usize) -> usize {
        let blocks = n.div_ceil(64);
        n.div_ceil(2) + blocks + 4 * blocks.div_ceil(256) + 4
    }
}

impl std::fmt::Display for BaseQuantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BaseQuantization {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

crate::serde_as_text!(BaseQuantization);

/// The number format a model is saved in (`save_dtype`, `checkpoint export --dtype`), as
/// safetensors stores it; `torch_dtype`'s names are accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageDtype {
    F32,
    Bf16,
    F16,
}

impl StorageDtype {
    /// The name [`StorageDtype::parse`] takes back.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f16" | "fp16" | "float16" => Ok(Self::F16),
            other => Err(ConfigError::Field {
                file: "--save-dtype".into(),
                field: "dtype".into(),
                msg: format!("unknown dtype `{other}` (f32, bf16, f16)"),
            }),
        }
    }
}

impl std::fmt::Display for StorageDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for StorageDtype {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

crate::serde_as_text!(StorageDtype);

/// A number format the planner counts bytes of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Dtype {
    Fp32,
    Bf16,
    Fp16,
    Fp8,
}

impl Dtype {
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Fp32 => 4.0,
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 => 1.0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
        }
    }
    fn parse(field: &str, s: &str) -> Result<Self> {
        Ok(match s {
            "fp32" | "f32" => Dtype::Fp32,
            "bf16" => Dtype::Bf16,
            "fp16" | "f16" => Dtype::Fp16,
            "fp8" => Dtype::Fp8,
            other => {
                return Err(ConfigError::Field {
                    file: "--precision".into(),
                    field: field.into(),
                    msg: format!("`{other}` is not fp32, bf16, fp16 or fp8"),
                })
            }
        })
    }
}

/// The planner's storage formats of each model-state term (`plan --precision`, which may ask what a
/// mix the engine does not run would cost, fp8 included). A master copy exists only when it differs
/// from the weights.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StateDtypes {
    pub weights: Dtype,
    pub grads: Dtype,
    pub master: Dtype,
    pub optimizer: Dtype,
}

impl Default for StateDtypes {
    /// Mixed precision as the source text counts it: 2 + 2 + 4 + 8 = 16 bytes per parameter.
    fn default() -> Self {
        MixedPrecision::Bf16.state_dtypes()
    }
}

impl StateDtypes {
    /// `weights=bf16,grads=fp32,master=fp32,optimizer=fp32` (any subset; the rest default), or a
    /// policy's name (`f32`, `bf16`, `fp16`): the terms that policy stores.
    pub fn parse(spec: &str) -> Result<Self> {
        if !spec.contains('=') && !spec.trim().is_empty() {
            return Ok(MixedPrecision::parse(spec)?.state_dtypes());
        }
        let mut p = StateDtypes::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| ConfigError::Field {
                file: "--precision".into(),
                field: item.into(),
                msg: "expected key=value".into(),
            })?;
            let d = Dtype::parse(k, v)?;
            match k {
                "weights" => p.weights = d,
                "grads" => p.grads = d,
                "master" => p.master = d,
                "optimizer" => p.optimizer = d,
                other => {
                    return Err(ConfigError::Field {
                        file: "--precision".into(),
                        field: other.into(),
                        msg: "unknown key (weights, grads, master, optimizer)".into(),
                    })
                }
            }
        }
        Ok(p)
    }
    /// The text `parse` takes back: `weights=bf16,grads=bf16,master=fp32,optimizer=fp32`.
    pub fn spec(&self) -> String {
        format!(
            "weights={},grads={},master={},optimizer={}",
            self.weights.name(),
            self.grads.name(),
            self.master.name(),
            self.optimizer.name()
        )
    }
    pub fn master_bytes(&self) -> f64 {
        if self.master == self.weights {
            0.0
        } else {
            self.master.bytes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_policy_parses_from_its_names_and_prints_back() {
        for (names, p) in [
            (&["f32", "fp32"][..], MixedPrecision::F32),
            (&["bf16"], MixedPrecision::Bf16),
            (&["fp16", "f16"], MixedPrecision::Fp16),
        ] {
            for n in names {
                assert_eq!(MixedPrecision::parse(n).unwrap(), p);
            }
            assert_eq!(MixedPrecision::parse(p.name()).unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<MixedPrecision>(&json).unwrap(), p);
        }
        let e = MixedPrecision::parse("fp8").unwrap_err().to_string();
        assert!(e.contains("`fp8`") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn a_policy_derives_storage_wire_products_scaling_and_the_planner_s_bytes() {
        use MixedPrecision::*;
        assert_eq!(F32.storage(), None);
        assert_eq!(Bf16.wire(), Some(Half::Bf16));
        assert_eq!(Fp16.storage(), Some(Half::F16));
        assert_eq!(Bf16.products(), Products::Bf16);
        assert_eq!(Fp16.products(), Products::F32);
        assert!(Fp16.needs_loss_scaling() && !Bf16.needs_loss_scaling());
        assert_eq!(
            F32.state_dtypes().spec(),
            "weights=fp32,grads=fp32,master=fp32,optimizer=fp32"
        );
        assert_eq!(StateDtypes::parse("bf16").unwrap(), StateDtypes::default());
        assert_eq!(
            StateDtypes::parse("weights=fp8").unwrap().weights,
            Dtype::Fp8
        );
    }
}

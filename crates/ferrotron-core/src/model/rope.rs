//! Rotary position embedding's frequencies, with the scalings that Hugging Face checkpoints carry
//! (`rope_scaling` or `rope_parameters`): `default`, `linear`, `dynamic` (NTK), `llama3` and `yarn`,
//! computed as transformers computes them (`modeling_rope_utils`), in f32 where it works in f32.
//! The engine turns these frequencies into its cos/sin tables; the planner only needs to know
//! that a model has them.

/// How a model scales its rotary frequencies.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `1 / theta^(2i/d)`.
    #[default]
    Default,
    /// Positions divided by `factor` (every frequency divided by it).
    Linear { factor: f64 },
    /// NTK-aware: beyond `max_position_embeddings` the base grows with the sequence
    /// (`theta · (factor·T/max − (factor−1))^(d/(d−2))`), recomputed for each sequence length.
    Dynamic { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolation and extrapolation blended over a ramp of dimensions, and cos/sin scaled by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
    },
}

/// The frequencies of one rotary table, and the factor its cos and sin are multiplied by.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    pub inv_freq: Vec<f32>,
    pub attention_factor: f32,
}

/// `base^(2i/d)` as torch computes `base ** (arange(0, d, 2).float() / d)`: the base and the
/// exponent in f32, the power rounded to f32.
fn pos_freq(base: f64, i: usize, dim: usize) -> f32 {
    let exponent = (2 * i) as f32 / dim as f32;
    (base as f32 as f64).powf(exponent as f64) as f32
}

/// `1 / base^(2i/d)` for i < d/2, in f32 as transformers computes it.
fn base_inv_freq(base: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2).map(|i| 1.0 / pos_freq(base, i, dim)).collect()
}

impl RopeScaling {
    /// The frequencies for a head of `dim` dimensions, a base of `theta`, a model of
    /// `max_positions` positions, used on sequences of `seq_len` tokens (only `dynamic` depends on
    /// it).
    pub fn frequencies(
        &self,
        theta: f64,
        dim: usize,
        max_positions: usize,
        seq_len: usize,
    ) -> RopeFrequencies {
        let plain = |inv_freq| RopeFrequencies {
            inv_freq,
            attention_factor: 1.0,
        };
        match *self {
            RopeScaling::Default => plain(base_inv_freq(theta, dim)),
            RopeScaling::Linear { factor } => plain(
                base_inv_freq(theta, dim)
                    .into_iter()
                    .map(|f| f / factor as f32)
                    .collect(),
            ),
            RopeScaling::Dynamic { factor } => {
                // transformers: the table for max(position) + 1 tokens, the base unchanged up to
                // max_position_embeddings.
                let max = max_positions as f64;
                let seq = (seq_len as f64).max(max);
                let d = dim as f64;
                let base = theta * ((factor * seq / max) - (factor - 1.0)).powf(d / (d - 2.0));
                plain(base_inv_freq(base, dim))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    old as f32,
                );
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let inv_freq = base_inv_freq(theta, dim)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        // transformers' `~(w < high) * ~(w > low)`; wavelengths are finite.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect();
                plain(inv_freq)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                attention_factor,
                beta_fast,
                beta_slow,
                truncate,
            } => {
                let d = dim as f64;
                let correction_dim = |rotations: f64| {
                    (d * (original / (rotations * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, high) = (low.max(0.0), high.min(d - 1.0));
                let span = if low == high { 0.001 } else { high - low };
                let (low, span) = (low as f32, span as f32);
                let inv_freq = (0..dim / 2)
                    .map(|i| {
                        let pos_freq = pos_freq(theta, i, dim);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor as f32 * pos_freq);
                        let ramp = ((i as f32 - low) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                RopeFrequencies {
                    inv_freq,
                    attention_factor: attention_factor as f32,
                }
            }
        }
    }

    /// Whether the frequencies depend on the sequence length (then each length has its own table).
    pub fn depends_on_length(&self) -> bool {
        matches!(self, RopeScaling::Dynamic { .. })
    }

    /// The `rope_type` transformers names this scaling by.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The keys transformers reads for this scaling, as a `rope_parameters` object (without
    /// `rope_theta`).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a rope scaling serialises");
        if let RopeScaling::Yarn { truncate: true, .. } = self {
            // transformers' default; older versions reject the key.
            v.as_object_mut().map(|o| o.remove("truncate"));
        }
        v
    }
}

/// YaRN's default attention factor (`get_mscale` in transformers): `0.1·mscale·ln(scale) + 1`.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_linear() {
        let f = RopeScaling::Default.frequencies(10000.0, 8, 64, 16);
        assert_eq!(f.inv_freq.len(), 4);
        assert_eq!(f.inv_freq[0], 1.0);
        assert!((f.inv_freq[1] - 0.1).abs() < 1e-7);
        let l = RopeScaling::Linear { factor: 4.0 }.frequencies(10000.0, 8, 64, 16);
        assert_eq!(l.inv_freq[0], 0.25);
    }

    #[test]
    fn dynamic_only_changes_beyond_the_positions() {
        let d = RopeScaling::Dynamic { factor: 2.0 };
        let base = RopeScaling::Default.frequencies(10000.0, 8, 64, 64);
        assert_eq!(d.frequencies(10000.0, 8, 64, 64), base);
        assert_ne!(d.frequencies(10000.0, 8, 64, 65).inv_freq, base.inv_freq);
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let base = RopeScaling::Default.frequencies(500000.0, 128, 131072, 1);
        let f = s.frequencies(500000.0, 128, 131072, 1);
        assert_eq!(f.inv_freq[0], base.inv_freq[0]);
        assert_eq!(f.inv_freq[63], base.inv_freq[63] / 8.0);
    }
}

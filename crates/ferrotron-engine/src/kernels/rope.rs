//! Rotary position embedding in Hugging Face's `rotate_half` convention: dimension i pairs with i + d/2.

use ferrotron_core::model::{ModelConfig, RopeFrequencies, RopeScaling};

/// cos/sin of every (position, frequency) pair for the positions of one sequence length.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub head_dim: usize,
    pub(crate) cos: Vec<f64>,
    pub(crate) sin: Vec<f64>,
}

impl RopeTable {
    /// Unscaled frequencies of base `theta` over `max_positions` positions.
    pub fn new(head_dim: usize, max_positions: usize, theta: f64) -> Self {
        let f = RopeScaling::Default.frequencies(theta, head_dim, max_positions, max_positions);
        Self::from_frequencies(head_dim, max_positions, &f)
    }

    /// The table of `cfg`'s model (its scaling included) for sequences of `seq_len` tokens.
    pub fn for_model(cfg: &ModelConfig, seq_len: usize) -> Self {
        let f = cfg.rope_scaling.frequencies(
            cfg.rope_theta,
            cfg.head_dim,
            cfg.max_position_embeddings,
            seq_len,
        );
        Self::from_frequencies(cfg.head_dim, seq_len, &f)
    }

    /// As transformers does it: angles `position · inv_freq` rounded to f32, then cos/sin, each
    /// rounded to f32 and multiplied by the attention factor in f32.
    fn from_frequencies(head_dim: usize, positions: usize, f: &RopeFrequencies) -> Self {
        let half = head_dim / 2;
        assert_eq!(f.inv_freq.len(), half, "rope: one frequency per pair");
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions * half),
            Vec::with_capacity(positions * half),
        );
        let a = f.attention_factor;
        for p in 0..positions {
            for &inv in &f.inv_freq {
                let angle = (p as f32 * inv) as f64;
                cos.push((angle.cos() as f32 * a) as f64);
                sin.push((angle.sin() as f32 * a) as f64);
            }
        }
        Self { head_dim, cos, sin }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2).max(1)
    }
}

//! Which layers go on which pipeline stage: contiguous ranges chosen by compute, not by layer count.

use crate::error::{ConfigError, Result};
use crate::model::ModelConfig;
use std::ops::Range;

/// Contiguous layer ranges, one per stage; stage 0 also runs the embedding, the last stage the final
/// norm, output layer and loss.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StagePartition {
    pub layers: Vec<Range<usize>>,
    /// Each stage's predicted cost in the units of the costs given (FLOPs for `for_model`).
    pub costs: Vec<f64>,
}

impl StagePartition {
    /// The contiguous split of `layer_costs` into `stages` non-empty ranges that minimises the most
    /// expensive stage, counting `first_extra` on the first stage and `last_extra` on the last.
    pub fn balanced(
        layer_costs: &[f64],
        first_extra: f64,
        last_extra: f64,
        stages: usize,
    ) -> Result<Self> {
        let n = layer_costs.len();
        if stages == 0 || stages > n {
            return Err(ConfigError::Invalid(format!("cannot split {n} layers into {stages} pipeline stages (each needs at least one layer)")));
        }
        let prefix: Vec<f64> = std::iter::once(0.0)
            .chain(layer_costs.iter().scan(0.0, |acc, c| {
                *acc += c;
                Some(*acc)
            }))
            .collect();
        let cost = |s: usize, a: usize, b: usize| {
            prefix[b] - prefix[a]
                + if s == 0 { first_extra } else { 0.0 }
                + if s == stages - 1 { last_extra } else { 0.0 }
        };
        // best[s][j]: the smallest possible maximum stage cost with stages 0..=s covering layers 0..j.
        let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
        let mut cut = vec![vec![0usize; n + 1]; stages];
        for (j, b) in best[0].iter_mut().enumerate().skip(1) {
            *b = cost(0, 0, j);
        }
        for s in 1..stages {
            for j in s + 1..=n {
                for i in s..j {
                    let v = best[s - 1][i].max(cost(s, i, j));
                    if v < best[s][j] {
                        best[s][j] = v;
                        cut[s][j] = i;
                    }
                }
            }
        }
        let mut layers = vec![0..0; stages];
        let mut end = n;
        for s in (0..stages).rev() {
            let start = if s == 0 { 0 } else { cut[s][end] };
            layers[s] = start..end;
            end = start;
        }
        let costs = layers
            .iter()
            .enumerate()
            .map(|(s, r)| cost(s, r.start, r.end))
            .collect();
        Ok(Self { layers, costs })
    }

    /// Balanced by the model's FLOPs: equal layers, the embedding (a lookup: free) on the first stage,
    /// the output layer on the last.
    pub fn for_model(cfg: &ModelConfig, stages: usize) -> Result<Self> {
        let layer = cfg.train_flops(1, 1) / cfg.num_layers as f64;
        let head = 6.0 * (cfg.hidden_size * cfg.vocab_size) as f64;
        let per_layer = layer - head / cfg.num_layers as f64;
        Self::balanced(&vec![per_layer; cfg.num_layers], 0.0, head, stages)
    }

    /// Explicit ranges, e.g. `[0..3, 3..4]`, checked to cover every layer in order.
    pub fn explicit(layers: Vec<Range<usize>>, num_layers: usize) -> Result<Self> {
        let mut next = 0;
        for r in &layers {
            if r.start != next || r.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "stage ranges {layers:?} must be non-empty, contiguous and start at layer 0"
                )));
            }
            next = r.end;
        }
        if next != num_layers {
            return Err(ConfigError::Invalid(format!(
                "stage ranges {layers:?} must cover all {num_layers} layers"
            )));
        }
        let costs = layers.iter().map(|r| r.len() as f64).collect();
        Ok(Self { layers, costs })
    }

    pub fn stages(&self) -> usize {
        self.layers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balances_by_cost_not_count() {
        // Four equal layers and a head worth two layers: the last stage gets fewer layers.
        let p = StagePartition::balanced(&[1.0; 4], 0.0, 2.0, 2).unwrap();
        assert_eq!(p.layers, vec![0..3, 3..4]);
        let even = StagePartition::balanced(&[1.0; 8], 0.0, 0.0, 4).unwrap();
        assert_eq!(even.layers, vec![0..2, 2..4, 4..6, 6..8]);
        assert!(StagePartition::balanced(&[1.0; 2], 0.0, 0.0, 3).is_err());
        assert!(StagePartition::explicit(vec![0..1, 2..4], 4).is_err());
        assert_eq!(
            StagePartition::explicit(vec![0..3, 3..4], 4)
                .unwrap()
                .stages(),
            2
        );
    }
}

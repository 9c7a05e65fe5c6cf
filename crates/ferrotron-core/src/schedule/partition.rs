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
        // Training FLOPs per token: three times the forward's.
        let per_layer = 3.0 * crate::model::layer_forward_flops(cfg, 1, 1);
        let head = 6.0 * (cfg.hidden_size * cfg.vocab_size) as f64;
        Self::uniform(cfg.num_layers, stages, per_layer, head)
    }

    /// [`Self::balanced`] for `n` layers of equal cost with `last_extra` on the last stage, in
    /// closed form (the planner asks for thousands of splits of deep models): the last stage takes
    /// the k layers that minimise max(k·c + extra, ⌈(n − k)/(stages − 1)⌉·c), the other stages share
    /// the rest as evenly as possible, the later ones taking a remainder (the earlier stages of a
    /// pipeline hold more micro-batches' activations).
    pub fn uniform(n: usize, stages: usize, layer_cost: f64, last_extra: f64) -> Result<Self> {
        if stages == 0 || stages > n {
            return Err(ConfigError::Invalid(format!("cannot split {n} layers into {stages} pipeline stages (each needs at least one layer)")));
        }
        let counts = if stages == 1 {
            vec![n]
        } else {
            let others = stages - 1;
            let worst = |k: usize| {
                let front = (n - k).div_ceil(others) as f64 * layer_cost;
                front.max(k as f64 * layer_cost + last_extra)
            };
            // Of equally good choices the largest k: the front stages carry less.
            let k = (1..=n - others)
                .rev()
                .min_by(|&a, &b| worst(a).total_cmp(&worst(b)))
                .expect("at least one layer for the last stage");
            let (base, extra) = ((n - k) / others, (n - k) % others);
            let mut counts: Vec<usize> = (0..others)
                .map(|s| base + usize::from(s >= others - extra))
                .collect();
            counts.push(k);
            counts
        };
        let mut start = 0;
        let layers: Vec<Range<usize>> = counts
            .iter()
            .map(|&c| {
                start += c;
                start - c..start
            })
            .collect();
        let costs = counts
            .iter()
            .enumerate()
            .map(|(s, &c)| c as f64 * layer_cost + if s + 1 == stages { last_extra } else { 0.0 })
            .collect();
        Ok(Self { layers, costs })
    }

    /// The split a layout runs: the layers it names (`stages=5+6+…`), otherwise the layers split by
    /// compute over its pp·vpp virtual stages. The engine, the checkpoints and the planner all use this.
    pub fn for_layout(cfg: &ModelConfig, l: &crate::layout::Layout) -> Result<Self> {
        let stages = l.pp.max(1) * l.vpp.max(1);
        let Some(named) = &l.stages else {
            return Self::for_model(cfg, stages);
        };
        let counts = named.counts();
        if counts.len() != stages {
            return Err(ConfigError::Field {
                file: "--layout".into(),
                field: "stages".into(),
                msg: format!("names {} stages, but pp·vpp = {stages}", counts.len()),
            });
        }
        if named.total() != cfg.num_layers {
            return Err(ConfigError::Field {
                file: "--layout".into(),
                field: "stages".into(),
                msg: format!(
                    "{named} sums to {} layers, but the model has {}",
                    named.total(),
                    cfg.num_layers
                ),
            });
        }
        let starts = counts.iter().scan(0, |at, &c| {
            *at += c;
            Some(*at - c..*at)
        });
        let mut p = Self::explicit(starts.collect(), cfg.num_layers)?;
        // Costs in the same units as `for_model`: per-layer FLOPs, the head on the last stage.
        let layer = 3.0 * crate::model::layer_forward_flops(cfg, 1, 1);
        let head = 6.0 * (cfg.hidden_size * cfg.vocab_size) as f64;
        p.costs = p
            .layers
            .iter()
            .enumerate()
            .map(|(i, r)| r.len() as f64 * layer + if i + 1 == stages { head } else { 0.0 })
            .collect();
        Ok(p)
    }

    /// Layers of each stage, in stage order.
    pub fn counts(&self) -> Vec<usize> {
        self.layers.iter().map(|r| r.len()).collect()
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
    fn the_closed_form_split_is_as_good_as_the_search() {
        for n in 1..40 {
            for stages in 1..=n.min(12) {
                for head in [0.0, 0.4, 1.0, 2.5, 7.0] {
                    let fast = StagePartition::uniform(n, stages, 1.0, head).unwrap();
                    let dp = StagePartition::balanced(&vec![1.0; n], 0.0, head, stages).unwrap();
                    let max = |p: &StagePartition| p.costs.iter().copied().fold(0.0, f64::max);
                    assert_eq!(
                        max(&fast),
                        max(&dp),
                        "{n} layers, {stages} stages, head {head}"
                    );
                    assert_eq!(fast.counts().iter().sum::<usize>(), n);
                    assert!(fast.counts().iter().all(|&c| c > 0));
                }
            }
        }
    }

    #[test]
    fn balances_by_cost_not_count() {
        // Four equal layers and a head worth two layers: the last stage gets fewer layers.
        let p = StagePartition::balanced(&[1.0; 4], 0.0, 2.0, 2).unwrap();
        assert_eq!(p.layers, vec![0..3, 3..4]);
        let even = StagePartition::balanced(&[1.0; 8], 0.0, 0.0, 4).unwrap();
        assert_eq!(even.layers, vec![0..2, 2..4, 4..6, 6..8]);
        assert!(StagePartition::balanced(&[1.0; 2], 0.0, 0.0, 3).is_err());
        assert!(StagePartition::explicit(vec![0..1, 2..4], 4).is_err());
        let cfg = crate::model::preset("llama-tiny").unwrap();
        let mut l = crate::layout::Layout {
            pp: 2,
            ..Default::default()
        };
        let by_compute = StagePartition::for_layout(&cfg, &l).unwrap();
        assert_eq!(by_compute, StagePartition::for_model(&cfg, 2).unwrap());
        l.stages = Some(crate::layout::NamedStages::parse("2+2").unwrap());
        let named = StagePartition::for_layout(&cfg, &l).unwrap();
        assert_eq!(named.counts(), vec![2, 2]);
        assert!(
            named.costs[1] > named.costs[0],
            "the head is on the last stage"
        );
        for bad in ["4", "1+2", "1+1+2"] {
            l.stages = Some(crate::layout::NamedStages::parse(bad).unwrap());
            let e = StagePartition::for_layout(&cfg, &l)
                .unwrap_err()
                .to_string();
            assert!(e.contains("stages"), "{bad}: {e}");
        }
        assert_eq!(
            StagePartition::explicit(vec![0..3, 3..4], 4)
                .unwrap()
                .stages(),
            2
        );
    }
}

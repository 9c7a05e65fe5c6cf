//! AdamW with decoupled weight decay, gradient clipping by the global norm, and a warm-up + cosine
//! learning-rate schedule. Parameters are the f32 master copy whatever the storage dtype on disk.

use crate::kernels::simd::simd_kernel;
use crate::transformer::ParamStore;
use rayon::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Linear warm-up to `peak_lr`, then cosine decay to `min_lr` at `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub peak_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        self.min_lr
            + 0.5 * (self.peak_lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// AdamW state: first and second moments per parameter, and the step count for bias correction.
#[derive(Debug, Clone)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub step: u64,
}

const CHUNK: usize = 1 << 14;

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &ParamStore) -> Self {
        let zeros = || params.tensors.iter().map(|t| vec![0f32; t.len()]).collect();
        Self {
            cfg,
            m: zeros(),
            v: zeros(),
            step: 0,
        }
    }

    /// Gives back spare capacity of the moment buffers.
    pub fn shrink(&mut self) {
        self.m
            .iter_mut()
            .chain(self.v.iter_mut())
            .for_each(Vec::shrink_to_fit);
    }

    /// Bytes the moments hold.
    pub fn state_bytes(&self) -> usize {
        let n: usize = self.m.iter().chain(&self.v).map(Vec::len).sum();
        4 * n
    }

    /// [`AdamW::step`] on the calling thread only (a device thread: its work shows on its clock).
    pub fn step_serial(&mut self, params: &mut ParamStore, grads: &ParamStore, lr: f32) {
        let (mut p, g) = slices(params, grads);
        self.step_on(&mut p, &g, lr, false)
    }

    /// One update of parameter slices `params[i]` (each the start of moment `i`; a ZeRO shard's piece
    /// of a tensor), on the calling thread.
    pub fn step_slices(&mut self, params: &mut [&mut [f32]], grads: &[&[f32]], lr: f32) {
        self.step_on(params, grads, lr, false)
    }

    /// One update with learning rate `lr` (PyTorch's AdamW arithmetic).
    pub fn step(&mut self, params: &mut ParamStore, grads: &ParamStore, lr: f32) {
        let (mut p, g) = slices(params, grads);
        self.step_on(&mut p, &g, lr, true)
    }

    fn step_on(&mut self, params: &mut [&mut [f32]], grads: &[&[f32]], lr: f32, threaded: bool) {
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - (c.beta1 as f64).powi(self.step as i32);
        let bc2 = 1.0 - (c.beta2 as f64).powi(self.step as i32);
        let step_size = (lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let k = UpdateConstants {
            decay: 1.0 - lr * c.weight_decay,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            step_size,
            bc2_sqrt,
        };
        let update = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| update(p, g, m, v, k);
        for (((p, g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
        {
            if threaded {
                p.par_chunks_mut(CHUNK)
                    .zip(g.par_chunks(CHUNK))
                    .zip(m.par_chunks_mut(CHUNK))
                    .zip(v.par_chunks_mut(CHUNK))
                    .for_each(|(((p, g), m), v)| update(p, g, m, v));
            } else {
                update(p, g, m, v);
            }
        }
    }
}

/// What one AdamW step applies to every element.
#[derive(Clone, Copy)]
struct UpdateConstants {
    decay: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
}

simd_kernel! {
    fn update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: UpdateConstants) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *p *= k.decay;
            *m = k.beta1 * *m + (1.0 - k.beta1) * g;
            *v = k.beta2 * *v + (1.0 - k.beta2) * g * g;
            *p -= k.step_size * *m / (v.sqrt() / k.bc2_sqrt + k.eps);
        }
    }
}

/// Every tensor of `params` and `grads` as slices.
type Slices<'a> = (Vec<&'a mut [f32]>, Vec<&'a [f32]>);

fn slices<'a>(params: &'a mut ParamStore, grads: &'a ParamStore) -> Slices<'a> {
    (
        params
            .tensors
            .iter_mut()
            .map(|t| t.as_mut_slice())
            .collect(),
        grads.tensors.iter().map(Vec::as_slice).collect(),
    )
}

/// ‖g‖₂ over every tensor, summed in f64 in a fixed order.
pub fn global_grad_norm(grads: &ParamStore) -> f64 {
    grads
        .tensors
        .iter()
        .map(|t| t.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
        .sum::<f64>()
        .sqrt()
}

/// Scales all gradients so their global norm is at most `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut ParamStore, max_norm: f64) -> f64 {
    let norm = global_grad_norm(grads);
    if max_norm > 0.0 && norm > max_norm {
        let s = (max_norm / (norm + 1e-6)) as f32;
        grads
            .tensors
            .iter_mut()
            .for_each(|t| t.iter_mut().for_each(|x| *x *= s));
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::model::{ParamSpec, WeightLayout};

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let s = LrSchedule {
            peak_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(500) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn adamw_matches_hand_computed_steps() {
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![2],
            layout: WeightLayout::Other,
        };
        let mut p = ParamStore::zeros(vec![spec]);
        p.tensors[0] = vec![1.0, -2.0];
        let mut g = p.zeros_like();
        g.tensors[0] = vec![0.5, 0.25];
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = AdamW::new(cfg, &p);
        opt.step(&mut p, &g, 0.1);
        // Step 1: m̂ = g, v̂ = g², so the update is lr·sign(g) after decay.
        let want0 = 1.0 * (1.0 - 0.1 * 0.01) - 0.1 * 0.5 / (0.5 + 1e-8);
        let want1 = -2.0 * (1.0 - 0.1 * 0.01) - 0.1 * 0.25 / (0.25 + 1e-8);
        assert!((p.tensors[0][0] - want0 as f32).abs() < 1e-6);
        assert!((p.tensors[0][1] - want1 as f32).abs() < 1e-6);
    }

    #[test]
    fn clipping_bounds_global_norm() {
        let spec = |n: &str| ParamSpec {
            name: n.into(),
            shape: vec![2],
            layout: WeightLayout::Other,
        };
        let mut g = ParamStore::zeros(vec![spec("a"), spec("b")]);
        g.tensors = vec![vec![3.0, 0.0], vec![0.0, 4.0]];
        assert!((clip_grad_norm(&mut g, 1.0) - 5.0).abs() < 1e-12);
        assert!((global_grad_norm(&g) - 1.0).abs() < 1e-5);
    }
}

/// How the learning rate follows a change of the effective batch (a run that continues another
/// with a different number of tokens per optimizer step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    /// Keep this run's configured `lr` and `min_lr`.
    None,
    /// Multiply the earlier run's by the ratio of tokens per step (Goyal et al. 2017).
    Linear,
    /// Multiply by its square root (the rule for adaptive optimizers, Malladi et al. 2022).
    Sqrt,
}

impl LrScaling {
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Linear => "linear",
            Self::Sqrt => "sqrt",
        }
    }

    /// The factor on the earlier run's learning rates for `ratio` = new / old tokens per step
    /// (`None`: keep this run's).
    pub fn factor(self, ratio: f64) -> Option<f64> {
        match self {
            Self::None => None,
            Self::Linear => Some(ratio),
            Self::Sqrt => Some(ratio.sqrt()),
        }
    }
}

impl std::str::FromStr for LrScaling {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "linear" => Ok(Self::Linear),
            "sqrt" => Ok(Self::Sqrt),
            _ => Err(format!("`lr_scaling`: `{s}` is none of none, linear, sqrt")),
        }
    }
}

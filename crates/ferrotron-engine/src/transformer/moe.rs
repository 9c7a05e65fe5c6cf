//! A mixture of experts in place of a block's MLP (Mixtral's `block_sparse_moe`, Qwen-MoE's `mlp`),
//! computed as transformers computes it: the router's logits, their softmax in f32, each row's
//! `top_k` most probable experts with those probabilities (renormalised to sum to 1 where the
//! family says); each expert's SwiGLU MLP over the rows that chose it; each row's output the sum,
//! expert by expert in index order, of its experts' outputs times their weights, then (Qwen2-MoE)
//! the shared expert's output times the sigmoid of its gate.
//!
//! Rows are grouped by expert and each expert multiplies its rows at once (grouped GEMMs, no loop
//! over tokens). The load-balancing loss couples every layer (its token fractions and mean
//! probabilities are taken over all layers' rows together), so each layer only tallies its
//! statistics ([`RouterTally`]); the pass adds the loss once all layers have run, and each layer's
//! backward receives its gradient with respect to the router probabilities, the same for every row.

use super::kept::Kept;
use super::linear::{Lin, Weights};
use super::weights::WeightSink;
use crate::kernels::Backend;
use ferrotron_core::model::MoeConfig;
use ferrotron_core::precision::Half;

/// A block's router and experts, by parameter index.
pub(crate) struct MoeIds {
    pub router: Lin,
    pub experts: Vec<ExpertIds>,
    /// Qwen2-MoE: the shared expert every token takes, and its gate (`hidden → 1`, a sigmoid).
    pub shared: Option<(ExpertIds, Lin)>,
    pub config: MoeConfig,
}

/// One expert's SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
pub(crate) struct ExpertIds {
    pub gate: Lin,
    pub up: Lin,
    pub down: Lin,
}

/// What the load-balancing loss needs from some rows of some layers: per expert, how many top-k
/// places it took and the sum of its router probabilities; and how many rows (row × layer) there
/// were.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterTally {
    pub assigned: Vec<f64>,
    pub probs: Vec<f64>,
    pub rows: usize,
    /// When the tally is summed over data-parallel replicas: the predicted tokens of their
    /// micro-batches together (the load-balancing loss's weight, see `passes.rs`).
    pub predicted: Option<f64>,
}

impl RouterTally {
    /// The tally and `predicted` as one vector, to be summed over replicas.
    pub fn to_vec(&self, predicted: f64) -> Vec<f64> {
        let mut v = self.assigned.clone();
        v.extend(&self.probs);
        v.extend([self.rows as f64, predicted]);
        v
    }

    /// The tally of a vector [`RouterTally::to_vec`] made, summed over replicas.
    pub fn from_vec(v: &[f64]) -> Self {
        let e = (v.len() - 2) / 2;
        Self {
            assigned: v[..e].to_vec(),
            probs: v[e..2 * e].to_vec(),
            rows: v[2 * e].round() as usize,
            predicted: Some(v[2 * e + 1]),
        }
    }

    pub fn add(&mut self, other: &RouterTally) {
        if self.assigned.is_empty() {
            self.assigned = vec![0.0; other.assigned.len()];
            self.probs = vec![0.0; other.probs.len()];
        }
        for (a, b) in self.assigned.iter_mut().zip(&other.assigned) {
            *a += b;
        }
        for (a, b) in self.probs.iter_mut().zip(&other.probs) {
            *a += b;
        }
        self.rows += other.rows;
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// transformers' `load_balancing_loss_func`: `E · Σₑ fₑ · Pₑ`, with `fₑ` the fraction of top-k
    /// places expert `e` took and `Pₑ` its mean router probability, both over every row and layer.
    pub fn aux_loss(&self) -> f64 {
        if self.is_empty() {
            return 0.0;
        }
        let n = self.rows as f64;
        let e = self.assigned.len() as f64;
        e * self
            .assigned
            .iter()
            .zip(&self.probs)
            .map(|(a, p)| (a / n) * (p / n))
            .sum::<f64>()
    }

    /// `scale · ∂aux/∂p` for a router probability `p` of expert `e` on any row and layer:
    /// `E · assignedₑ / rows²` (the assignments are counts, through which no gradient flows).
    pub fn prob_grad(&self, scale: f64) -> Vec<f32> {
        let n = self.rows as f64;
        let e = self.assigned.len() as f64;
        self.assigned
            .iter()
            .map(|a| (scale * e * a / (n * n)) as f32)
            .collect()
    }
}

/// The rows one expert serves, and what its forward keeps for backward.
#[derive(Default)]
struct ExpertRun {
    /// `(row, slot)`: the row, and which of its `top_k` places chose this expert.
    rows: Vec<(usize, usize)>,
    gate: Kept,
    up: Kept,
    act: Kept,
    /// The expert's output for its rows, before the routing weight (the weight's gradient).
    out: Kept,
}

/// What a mixture-of-experts block keeps for backward.
#[derive(Default)]
pub(crate) struct MoeActs {
    /// `[rows, experts]` router probabilities.
    probs: Vec<f32>,
    /// `[rows, top_k]`: each row's experts, most probable first, and their routing weights.
    chosen: Vec<(usize, f32)>,
    runs: Vec<ExpertRun>,
    /// The shared expert over every row, and its gate's sigmoid per row.
    shared: Option<(ExpertRun, Vec<f32>)>,
    pub tally: RouterTally,
}

impl MoeActs {
    pub fn bytes(&self) -> usize {
        let runs: usize = self
            .runs
            .iter()
            .map(|r| {
                r.gate.bytes()
                    + r.up.bytes()
                    + r.act.bytes()
                    + r.out.bytes()
                    + r.rows.len() * 2 * std::mem::size_of::<usize>()
            })
            .sum();
        let shared = self.shared.as_ref().map_or(0, |(r, g)| {
            r.gate.bytes() + r.up.bytes() + r.act.bytes() + r.out.bytes() + 4 * g.len()
        });
        4 * self.probs.len()
            + self.chosen.len() * std::mem::size_of::<(usize, f32)>()
            + runs
            + shared
    }
}

/// Softmax of each `width`-wide row of `x`, in place.
fn softmax_rows(x: &mut [f32], width: usize) {
    for row in x.chunks_exact_mut(width) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
}

/// The `k` largest of `p`, largest first (the lower index first among equals), as indices.
fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// The rows of `x` (`width` wide) at `rows`, one after another.
fn gather(x: &[f32], width: usize, rows: &[(usize, usize)]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &(r, _) in rows {
        out.extend_from_slice(&x[r * width..(r + 1) * width]);
    }
    out
}

/// The block's output for its `rows` inputs `x` (the normed hidden states), and what backward needs.
pub(crate) fn forward(
    be: &dyn Backend,
    p: Weights,
    ids: &MoeIds,
    x: &[f32],
    rows: usize,
    storage: Option<Half>,
) -> (Vec<f32>, MoeActs) {
    let (n_experts, k) = (ids.experts.len(), ids.config.top_k);
    let h = ids.router.in_dim;
    let mut probs = ids.router.forward(be, p, x, rows);
    softmax_rows(&mut probs, n_experts);
    let mut tally = RouterTally {
        assigned: vec![0.0; n_experts],
        probs: vec![0.0; n_experts],
        rows,
        predicted: None,
    };
    let mut chosen = Vec::with_capacity(rows * k);
    let mut runs: Vec<ExpertRun> = (0..n_experts).map(|_| ExpertRun::default()).collect();
    for (r, row) in probs.chunks_exact(n_experts).enumerate() {
        for (s, v) in tally.probs.iter_mut().zip(row) {
            *s += *v as f64;
        }
        let top = top_k(row, k);
        let sum: f32 = top.iter().map(|&e| row[e]).sum();
        for (slot, &e) in top.iter().enumerate() {
            let w = if ids.config.norm_topk_prob {
                row[e] / sum
            } else {
                row[e]
            };
            chosen.push((e, w));
            runs[e].rows.push((r, slot));
            tally.assigned[e] += 1.0;
        }
    }
    let mut out = be.zeros(rows * h);
    for (expert, run) in ids.experts.iter().zip(runs.iter_mut()) {
        if run.rows.is_empty() {
            continue;
        }
        let xe = gather(x, h, &run.rows);
        let y = expert_forward(be, p, expert, &xe, run, storage);
        for (i, &(r, slot)) in run.rows.iter().enumerate() {
            let w = chosen[r * k + slot].1;
            for (o, v) in out[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&y[i * h..(i + 1) * h])
            {
                *o += v * w;
            }
        }
        run.out = Kept::keep(be, y, storage);
    }
    // Qwen2-MoE's shared expert, over every row, scaled by its gate's sigmoid, added last.
    let shared = ids.shared.as_ref().map(|(expert, gate)| {
        let mut run = ExpertRun::default();
        let y = expert_forward(be, p, expert, x, &mut run, storage);
        let g: Vec<f32> = gate
            .forward(be, p, x, rows)
            .iter()
            .map(|z| 1.0 / (1.0 + (-z).exp()))
            .collect();
        for (r, gr) in g.iter().enumerate() {
            for (o, v) in out[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&y[r * h..(r + 1) * h])
            {
                *o += gr * v;
            }
        }
        run.out = Kept::keep(be, y, storage);
        (run, g)
    });
    let acts = MoeActs {
        probs,
        chosen,
        runs,
        shared,
        tally,
    };
    (out, acts)
}

/// One expert's SwiGLU MLP over its rows `xe`, keeping its pre-activations and activation in
/// `run`; returns its output.
fn expert_forward(
    be: &dyn Backend,
    p: Weights,
    expert: &ExpertIds,
    xe: &[f32],
    run: &mut ExpertRun,
    storage: Option<Half>,
) -> Vec<f32> {
    let n = xe.len() / expert.gate.in_dim;
    let gate = expert.gate.forward(be, p, xe, n);
    let up = expert.up.forward(be, p, xe, n);
    let f = expert.gate.out_dim;
    // SAFETY: SwiGLU writes every element of its output.
    let act = unsafe { be.overwritten(n * f, &mut |a| be.swiglu_forward(&gate, &up, a)) };
    let y = expert.down.forward(be, p, &act, n);
    let keep = |v: Vec<f32>| Kept::keep(be, v, storage);
    run.gate = keep(gate);
    run.up = keep(up);
    run.act = keep(act);
    y
}

/// The backward of [`expert_forward`]: from `dy` at its output, the gradient at its input `xe`
/// (returned), its weights' gradients into `g`.
fn expert_backward(
    be: &dyn Backend,
    p: Weights,
    g: &mut WeightSink,
    expert: &ExpertIds,
    run: &mut ExpertRun,
    dy: &[f32],
    xe: &[f32],
) -> Vec<f32> {
    let n = xe.len() / expert.gate.in_dim;
    let act = std::mem::take(&mut run.act).into_f32(be);
    let dact = expert.down.backward_new(be, p, g, dy, &act);
    drop(act);
    let (gate, up) = (
        std::mem::take(&mut run.gate).into_f32(be),
        std::mem::take(&mut run.up).into_f32(be),
    );
    let f = expert.gate.out_dim;
    let mut dup = Vec::new();
    // SAFETY: SwiGLU's backward writes every element of both gradients.
    let dgate = unsafe {
        be.overwritten(n * f, &mut |dgate| {
            dup = be.overwritten(n * f, &mut |dup| {
                be.swiglu_backward(&dact, &gate, &up, dgate, dup)
            })
        })
    };
    drop((gate, up, dact));
    let mut dxe = expert.gate.backward_new(be, p, g, &dgate, xe);
    expert.up.backward(be, p, g, &dup, xe, &mut dxe, true);
    dxe
}

/// The block's backward: from `dout` (the gradient at its output, `rows × hidden`) and its input
/// `x`, the gradient at its input (returned) and its weights' gradients (into `g`).
/// `prob_grad` is the load-balancing loss's gradient with respect to each expert's router
/// probability (the same on every row; empty when the loss is not taken).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &dyn Backend,
    p: Weights,
    g: &mut WeightSink,
    ids: &MoeIds,
    a: &mut MoeActs,
    dout: &[f32],
    x: &[f32],
    rows: usize,
    prob_grad: &[f32],
) -> Vec<f32> {
    let (n_experts, k) = (ids.experts.len(), ids.config.top_k);
    let h = ids.router.in_dim;
    let mut dx = be.zeros(rows * h);
    // ∂loss/∂(routing weight) of each row's places.
    let mut dweight = vec![0f32; rows * k];
    for (expert, run) in ids.experts.iter().zip(a.runs.iter_mut()) {
        if run.rows.is_empty() {
            continue;
        }
        let n = run.rows.len();
        let y = std::mem::take(&mut run.out).into_f32(be);
        let mut dy = Vec::with_capacity(n * h);
        for (i, &(r, slot)) in run.rows.iter().enumerate() {
            let d = &dout[r * h..(r + 1) * h];
            let w = a.chosen[r * k + slot].1;
            dweight[r * k + slot] = d
                .iter()
                .zip(&y[i * h..(i + 1) * h])
                .map(|(a, b)| a * b)
                .sum();
            dy.extend(d.iter().map(|v| v * w));
        }
        drop(y);
        let xe = gather(x, h, &run.rows);
        let dxe = expert_backward(be, p, g, expert, run, &dy, &xe);
        for (i, &(r, _)) in run.rows.iter().enumerate() {
            be.add_assign(&mut dx[r * h..(r + 1) * h], &dxe[i * h..(i + 1) * h]);
        }
    }
    // The shared expert: its output scaled by the gate's sigmoid σ, so ∂σ = dout · y and the gate's
    // pre-activation takes ∂σ · σ(1 − σ).
    if let (Some((expert, gate)), Some((run, sig))) = (&ids.shared, a.shared.as_mut()) {
        let y = std::mem::take(&mut run.out).into_f32(be);
        let mut dy = Vec::with_capacity(rows * h);
        let mut dpre = Vec::with_capacity(rows);
        for (r, s) in sig.iter().enumerate() {
            let d = &dout[r * h..(r + 1) * h];
            let dsig: f32 = d
                .iter()
                .zip(&y[r * h..(r + 1) * h])
                .map(|(a, b)| a * b)
                .sum();
            dpre.push(dsig * s * (1.0 - s));
            dy.extend(d.iter().map(|v| v * s));
        }
        drop(y);
        let dxs = expert_backward(be, p, g, expert, run, &dy, x);
        be.add_assign(&mut dx, &dxs);
        gate.backward(be, p, g, &dpre, x, &mut dx, true);
    }
    // Through the weights to the probabilities (renormalised: w = p / S over the row's places,
    // so ∂/∂pⱼ = (∂wⱼ − Σₘ ∂wₘ·wₘ) / S), the load-balancing loss's share, then the softmax.
    let mut dlogits = vec![0f32; rows * n_experts];
    for r in 0..rows {
        let prow = &a.probs[r * n_experts..(r + 1) * n_experts];
        let drow = &mut dlogits[r * n_experts..(r + 1) * n_experts];
        if !prob_grad.is_empty() {
            drow.copy_from_slice(prob_grad);
        }
        let places = &a.chosen[r * k..(r + 1) * k];
        let dw = &dweight[r * k..(r + 1) * k];
        if ids.config.norm_topk_prob {
            let sum: f32 = places.iter().map(|&(e, _)| prow[e]).sum();
            let dot: f32 = places.iter().zip(dw).map(|(&(_, w), d)| w * d).sum();
            for (&(e, _), d) in places.iter().zip(dw) {
                drow[e] += (d - dot) / sum;
            }
        } else {
            for (&(e, _), d) in places.iter().zip(dw) {
                drow[e] += d;
            }
        }
        let dot: f32 = prow.iter().zip(drow.iter()).map(|(p, d)| p * d).sum();
        for (d, p) in drow.iter_mut().zip(prow) {
            *d = p * (*d - dot);
        }
    }
    ids.router.backward(be, p, g, &dlogits, x, &mut dx, true);
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_balancing_loss_is_transformers_formula() {
        // Two experts, four rows: expert 0 took 3 of the 4 places, mean probabilities 0.6 / 0.4.
        let t = RouterTally {
            assigned: vec![3.0, 1.0],
            probs: vec![2.4, 1.6],
            rows: 4,
            predicted: None,
        };
        let mut back = RouterTally::from_vec(&t.to_vec(3.0));
        assert_eq!(back.predicted.take(), Some(3.0));
        assert_eq!(back, t);
        let want = 2.0 * (0.75 * 0.6 + 0.25 * 0.4);
        assert!((t.aux_loss() - want).abs() < 1e-12);
        // ∂/∂p₀ of one row: E · f₀ / rows.
        assert!((t.prob_grad(1.0)[0] as f64 - 2.0 * 0.75 / 4.0).abs() < 1e-7);
        assert_eq!(top_k(&[0.1, 0.5, 0.2, 0.5], 3), vec![1, 3, 2]);
    }
}

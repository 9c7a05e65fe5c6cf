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
//!
//! Under mixed precision the router's products are f32 (its weight the 16-bit compute copy,
//! widened): a token's experts are the top k of its probabilities, and a product rounded to bf16
//! would move them by more than the gap between the k-th and the next.
//!
//! Under expert parallelism a device holds a contiguous share of the experts (`MoeConfig::held`):
//! its rows routed to other devices' experts travel there and their outputs come back (two
//! all-to-alls in forward, two in backward, through [`ShardCollectives`]); unsplit, the same code
//! runs with one device, whose messages are its own.

use super::collectives::ShardCollectives;
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

/// One of a row's `top_k` places: the row, and which place (most probable first).
type Place = (usize, usize);

/// What one expert's SwiGLU forward keeps for backward, over the rows it ran on.
#[derive(Default)]
struct ExpertRun {
    /// The rows it ran on, when they are not the block's input (a routed expert's, gathered
    /// from every device of the expert-parallel group).
    x: Kept,
    gate: Kept,
    up: Kept,
    act: Kept,
}

impl ExpertRun {
    fn bytes(&self) -> usize {
        self.x.bytes() + self.gate.bytes() + self.up.bytes() + self.act.bytes()
    }
}

/// What a mixture-of-experts block keeps for backward.
#[derive(Default)]
pub(crate) struct MoeActs {
    /// `[rows, experts]` router probabilities.
    probs: Vec<f32>,
    /// `[rows, top_k]`: each row's experts, most probable first, and their routing weights.
    chosen: Vec<(usize, f32)>,
    /// Per expert of the router: this device's `(row, slot)` places routed to it (the row, and
    /// which of its `top_k` places chose it), and its output for them before the routing weight
    /// (the weight's gradient).
    routes: Vec<Vec<Place>>,
    outs: Vec<Kept>,
    /// Per expert this device holds: how many rows each device of the expert-parallel group sent
    /// it, and what its forward kept.
    received: Vec<Vec<usize>>,
    held: Vec<ExpertRun>,
    /// The shared expert over every row, its output, and its gate's sigmoid per row.
    shared: Option<(ExpertRun, Kept, Vec<f32>)>,
    pub tally: RouterTally,
    /// Per expert of the router: the places it dropped, over its capacity (all zero when dropless).
    pub dropped: Vec<f64>,
}

impl MoeActs {
    pub fn bytes(&self) -> usize {
        let routes: usize = self.routes.iter().map(|r| r.len()).sum();
        let outs: usize = self.outs.iter().map(Kept::bytes).sum();
        let held: usize = self.held.iter().map(ExpertRun::bytes).sum();
        let shared = self
            .shared
            .as_ref()
            .map_or(0, |(r, out, g)| r.bytes() + out.bytes() + 4 * g.len());
        4 * self.probs.len()
            + self.chosen.len() * std::mem::size_of::<(usize, f32)>()
            + routes * 2 * std::mem::size_of::<usize>()
            + outs
            + held
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

/// Where a block's routed experts are: `per_device` experts on each of `devices` devices of the
/// expert-parallel group, which holds the experts from `first` (device j those from
/// `first + j · per_device`). Under `etp=1` the group holds one tensor-parallel device's block of
/// the experts; the other blocks' are the other devices' of the tp group.
struct Placement {
    devices: usize,
    per_device: usize,
    first: usize,
}

impl Placement {
    fn of(ids: &MoeIds) -> Self {
        Self {
            devices: ids.config.held.size,
            per_device: ids.experts.len(),
            first: ids.config.held.group_experts(ids.config.num_experts).start,
        }
    }

    /// The experts device `j` holds.
    fn of_device(&self, j: usize) -> std::ops::Range<usize> {
        let start = self.first + j * self.per_device;
        start..start + self.per_device
    }

    /// The experts the group holds.
    fn of_group(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.devices * self.per_device
    }
}

/// For each device of the group, one row (`width` wide) per place routed to its experts, expert
/// by expert: `each(place, buf)` appends the row of `place` (a `(row, slot)`).
fn pack_for_devices(
    at: &Placement,
    routes: &[Vec<Place>],
    width: usize,
    each: &dyn Fn(Place, &mut Vec<f32>),
) -> Vec<Vec<f32>> {
    (0..at.devices)
        .map(|j| {
            let experts = at.of_device(j);
            let n: usize = routes[experts.clone()].iter().map(Vec::len).sum();
            let mut buf = Vec::with_capacity(n * width);
            for e in experts {
                for &place in &routes[e] {
                    each(place, &mut buf);
                }
            }
            buf
        })
        .collect()
}

/// The rows each held expert received, gathered from the devices' messages (`received[le][j]`
/// rows of held expert `le` from device `j`, in held-expert order within each message).
fn rows_of_held(msgs: &[Vec<f32>], received: &[Vec<usize>], width: usize) -> Vec<Vec<f32>> {
    let mut offsets = vec![0usize; msgs.len()];
    received
        .iter()
        .map(|counts| {
            let n: usize = counts.iter().sum();
            let mut rows = Vec::with_capacity(n * width);
            for (j, &c) in counts.iter().enumerate() {
                rows.extend_from_slice(&msgs[j][offsets[j]..offsets[j] + c * width]);
                offsets[j] += c * width;
            }
            rows
        })
        .collect()
}

/// The inverse of [`rows_of_held`]: each held expert's result rows, cut into one message per
/// device (in held-expert order).
fn messages_from_held(
    results: &[Vec<f32>],
    received: &[Vec<usize>],
    width: usize,
) -> Vec<Vec<f32>> {
    let devices = received.first().map_or(0, Vec::len);
    let mut msgs: Vec<Vec<f32>> = (0..devices)
        .map(|j| Vec::with_capacity(received.iter().map(|c| c[j]).sum::<usize>() * width))
        .collect();
    for (rows, counts) in results.iter().zip(received) {
        let mut at = 0;
        for (msg, &c) in msgs.iter_mut().zip(counts) {
            msg.extend_from_slice(&rows[at..at + c * width]);
            at += c * width;
        }
    }
    msgs
}

/// The message lengths device `j` sends back for this device's places: its experts' places.
fn lengths_back(at: &Placement, routes: &[Vec<Place>], width: usize) -> Vec<usize> {
    (0..at.devices)
        .map(|j| routes[at.of_device(j)].iter().map(Vec::len).sum::<usize>() * width)
        .collect()
}

/// Calls `each(e, i, row)` for each place `i` of each expert `e` routed from this device, with
/// that place's row of the messages that came back (one per device, in [`pack_for_devices`]'
/// order).
fn unpack_from_devices(
    at: &Placement,
    routes: &[Vec<Place>],
    msgs: &[Vec<f32>],
    width: usize,
    each: &mut dyn FnMut(usize, usize, &[f32]),
) {
    for (j, msg) in msgs.iter().enumerate() {
        let mut rows = msg.chunks_exact(width);
        for e in at.of_device(j) {
            for i in 0..routes[e].len() {
                each(e, i, rows.next().expect("a row back for every place sent"));
            }
        }
    }
}

/// The block's output for its `rows` inputs `x` (the normed hidden states), and what backward
/// needs. Each place's row travels to the device holding its expert (`coll`'s expert-parallel
/// group; itself when unsplit), the expert runs over every row it received at once, and the
/// results travel back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    be: &dyn Backend,
    coll: &dyn ShardCollectives,
    p: Weights,
    ids: &MoeIds,
    x: &[f32],
    rows: usize,
    storage: Option<Half>,
) -> (Vec<f32>, MoeActs) {
    let (n_experts, k) = (ids.config.num_experts, ids.config.top_k);
    let h = ids.router.in_dim;
    let at = Placement::of(ids);
    // The router in f32 products (see `Backend::f32_products`); its softmax in f32.
    let mut probs = ids.router.forward(&*be.f32_products(), p, x, rows);
    softmax_rows(&mut probs, n_experts);
    let mut tally = RouterTally {
        assigned: vec![0.0; n_experts],
        probs: vec![0.0; n_experts],
        rows,
        predicted: None,
    };
    let mut chosen = Vec::with_capacity(rows * k);
    let mut routes: Vec<Vec<Place>> = vec![Vec::new(); n_experts];
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
            routes[e].push((r, slot));
            tally.assigned[e] += 1.0;
        }
    }
    // Token dropping, before dispatch: each expert keeps at most its capacity of this device's
    // places, first choices before second ones, earlier rows first. A dropped place adds nothing to
    // its row's output (the others keep their weights), so its weight's gradient is zero; the
    // load-balancing loss still counts the router's choice.
    let capacity = ids.config.capacity(rows);
    let mut dropped = vec![0.0; n_experts];
    for (places, d) in routes.iter_mut().zip(dropped.iter_mut()) {
        if places.len() > capacity {
            *d = (places.len() - capacity) as f64;
            places.sort_unstable_by_key(|&(r, slot)| (slot, r));
            places.truncate(capacity);
            // Back to row order (an expert takes a row at most once).
            places.sort_unstable();
        }
    }
    // Under etp=1 this device's group runs its tensor-parallel block of the experts only: the
    // places routed to the others' blocks are theirs (the same rows, routed alike), and the output,
    // summed over the group as below, takes them from there.
    for (e, places) in routes.iter_mut().enumerate() {
        if !at.of_group().contains(&e) {
            places.clear();
        }
    }
    // Dispatch: every place's row to its expert's device; each held expert learns how many rows
    // each device sent it.
    let counts: Vec<Vec<usize>> = (0..at.devices)
        .map(|j| routes[at.of_device(j)].iter().map(Vec::len).collect())
        .collect();
    let from_devices = coll.expert_counts(counts);
    let received: Vec<Vec<usize>> = (0..at.per_device)
        .map(|le| from_devices.iter().map(|c| c[le]).collect())
        .collect();
    let sent = pack_for_devices(&at, &routes, h, &|(r, _), buf| {
        buf.extend_from_slice(&x[r * h..(r + 1) * h])
    });
    let lengths: Vec<usize> = from_devices
        .iter()
        .map(|c| c.iter().sum::<usize>() * h)
        .collect();
    let msgs = coll.expert_exchange(sent, &lengths);
    // Each held expert over all the rows it received, at once.
    let mut held = Vec::with_capacity(at.per_device);
    let mut results = Vec::with_capacity(at.per_device);
    for (expert, xe) in ids.experts.iter().zip(rows_of_held(&msgs, &received, h)) {
        let mut run = ExpertRun::default();
        let y = if xe.is_empty() {
            Vec::new()
        } else {
            expert_forward(be, p, expert, &xe, &mut run, storage)
        };
        run.x = Kept::keep(be, xe, storage);
        held.push(run);
        results.push(y);
    }
    drop(msgs);
    // Combine: the results back to the devices their rows came from, each place's output added
    // with its routing weight, expert by expert in index order.
    let back = coll.expert_exchange(
        messages_from_held(&results, &received, h),
        &lengths_back(&at, &routes, h),
    );
    drop(results);
    let mut y_of: Vec<Vec<f32>> = routes
        .iter()
        .map(|r| Vec::with_capacity(r.len() * h))
        .collect();
    unpack_from_devices(&at, &routes, &back, h, &mut |e, _, row| {
        y_of[e].extend_from_slice(row)
    });
    drop(back);
    let mut out = be.zeros(rows * h);
    for (e, y) in y_of.iter().enumerate() {
        for (i, &(r, slot)) in routes[e].iter().enumerate() {
            let w = chosen[r * k + slot].1;
            for (o, v) in out[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&y[i * h..(i + 1) * h])
            {
                *o += v * w;
            }
        }
    }
    let outs = y_of
        .into_iter()
        .map(|y| Kept::keep(be, y, storage))
        .collect();
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
        (run, Kept::keep(be, y, storage), g)
    });
    // Under tensor parallelism each device's experts hold some of their columns (or under etp=1
    // some of the experts): the output is a partial sum, reduced over the group (as the dense
    // MLP's down projection).
    let out = coll.reduce(out);
    let acts = MoeActs {
        probs,
        chosen,
        routes,
        outs,
        received,
        held,
        shared,
        tally,
        dropped,
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
/// `x`, the gradient at its input (returned) and its weights' gradients (into `g`). Each place's
/// output gradient travels to its expert's device and the input gradient back, as in forward.
/// `prob_grad` is the load-balancing loss's gradient with respect to each expert's router
/// probability (the same on every row; empty when the loss is not taken).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    be: &dyn Backend,
    coll: &dyn ShardCollectives,
    p: Weights,
    g: &mut WeightSink,
    ids: &MoeIds,
    a: &mut MoeActs,
    dout: &[f32],
    x: &[f32],
    rows: usize,
    prob_grad: &[f32],
) -> Vec<f32> {
    let (n_experts, k) = (ids.config.num_experts, ids.config.top_k);
    let h = ids.router.in_dim;
    let at = Placement::of(ids);
    let mut dx = be.zeros(rows * h);
    // ∂loss/∂(routing weight) of each row's places, from the outputs kept.
    let mut dweight = vec![0f32; rows * k];
    for (routes, out) in a.routes.iter().zip(a.outs.iter_mut()) {
        let y = std::mem::take(out).into_f32(be);
        for (i, &(r, slot)) in routes.iter().enumerate() {
            dweight[r * k + slot] = dout[r * h..(r + 1) * h]
                .iter()
                .zip(&y[i * h..(i + 1) * h])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
    // Under tensor parallelism the outputs kept are partial sums over the group's columns (under
    // etp=1 each place's whole output is on one device, zero on the others): so are these
    // products.
    sum_over_group(coll, &mut dweight);
    // Each place's output gradient (times its routing weight) to its expert's device.
    let chosen = &a.chosen;
    let sent = pack_for_devices(&at, &a.routes, h, &|(r, slot), buf| {
        let w = chosen[r * k + slot].1;
        buf.extend(dout[r * h..(r + 1) * h].iter().map(|v| v * w))
    });
    let lengths: Vec<usize> = (0..at.devices)
        .map(|j| a.received.iter().map(|c| c[j]).sum::<usize>() * h)
        .collect();
    let msgs = coll.expert_exchange(sent, &lengths);
    let mut results = Vec::with_capacity(at.per_device);
    for ((expert, run), dy) in
        ids.experts
            .iter()
            .zip(a.held.iter_mut())
            .zip(rows_of_held(&msgs, &a.received, h))
    {
        let xe = std::mem::take(&mut run.x).into_f32(be);
        results.push(if dy.is_empty() {
            Vec::new()
        } else {
            expert_backward(be, p, g, expert, run, &dy, &xe)
        });
    }
    drop(msgs);
    let back = coll.expert_exchange(
        messages_from_held(&results, &a.received, h),
        &lengths_back(&at, &a.routes, h),
    );
    drop(results);
    let routes = &a.routes;
    unpack_from_devices(&at, routes, &back, h, &mut |e, i, row| {
        let r = routes[e][i].0;
        be.add_assign(&mut dx[r * h..(r + 1) * h], row);
    });
    drop(back);
    // The shared expert: its output scaled by the gate's sigmoid σ, so ∂σ = dout · y and the gate's
    // pre-activation takes ∂σ · σ(1 − σ).
    if let (Some((expert, gate)), Some((run, out, sig))) = (&ids.shared, a.shared.as_mut()) {
        let y = std::mem::take(out).into_f32(be);
        let mut dy = Vec::with_capacity(rows * h);
        let mut dsig: Vec<f32> = (0..rows)
            .map(|r| {
                dout[r * h..(r + 1) * h]
                    .iter()
                    .zip(&y[r * h..(r + 1) * h])
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect();
        drop(y);
        sum_over_group(coll, &mut dsig);
        let mut dpre = Vec::with_capacity(rows);
        for (r, s) in sig.iter().enumerate() {
            dpre.push(dsig[r] * s * (1.0 - s));
            dy.extend(dout[r * h..(r + 1) * h].iter().map(|v| v * s));
        }
        let dxs = expert_backward(be, p, g, expert, run, &dy, x);
        be.add_assign(&mut dx, &dxs);
        replicated_backward(be, coll, p, g, gate, &dpre, x, &mut dx);
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
    let router_be = be.f32_products();
    replicated_backward(&*router_be, coll, p, g, &ids.router, &dlogits, x, &mut dx);
    dx
}

/// Sums `v` over the tensor-parallel group (in f64), when there is one.
fn sum_over_group(coll: &dyn ShardCollectives, v: &mut [f32]) {
    if coll.size() > 1 {
        let mut wide: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        coll.sum(&mut wide);
        v.iter_mut().zip(&wide).for_each(|(x, w)| *x = *w as f32);
    }
}

/// The backward of a linear layer every device of the tensor-parallel group computes alike (the
/// router, the shared expert's gate): its weight gradient on each, its input gradient added by the
/// first device only, since the block's input gradient is then summed over the group.
#[allow(clippy::too_many_arguments)]
fn replicated_backward(
    be: &dyn Backend,
    coll: &dyn ShardCollectives,
    p: Weights,
    g: &mut WeightSink,
    lin: &Lin,
    dy: &[f32],
    x: &[f32],
    dx: &mut [f32],
) {
    if coll.index() == 0 {
        lin.backward(be, p, g, dy, x, dx, true);
    } else {
        let mut discarded = vec![0f32; dx.len()];
        lin.backward(be, p, g, dy, x, &mut discarded, false);
    }
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

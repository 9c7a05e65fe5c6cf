//! One transformer block: forward (keeping what backward needs) and backward.

use super::collectives::ShardCollectives;
use super::kept::Kept;
use super::linear::{Lin, Weights};
use super::moe::{self, ExpertIds, MoeActs, MoeIds, RouterTally};
use super::norm::{NormIds, NormStash};
use super::weights::WeightSink;
use super::{ParamStore, Transformer};
use crate::kernels::{AttnGradInputs, AttnShape, Backend, Qkv, QkvGrads};
use ferrotron_core::model::{Arch, FfnNames, ModelConfig, NormKind, WeightLayout};

/// A block's feed-forward part.
enum Ffn {
    Dense {
        /// Llama: gate, up; GPT-2: c_fc.
        mlp_in: Vec<Lin>,
        mlp_out: Lin,
    },
    Experts(Box<MoeIds>),
}

/// Parameter indices of one block.
pub(crate) struct LayerIds {
    norm1: NormIds,
    /// Llama: q, k, v; GPT-2: the fused c_attn.
    qkv: Vec<Lin>,
    attn_out: Lin,
    norm2: NormIds,
    ffn: Ffn,
    /// Qwen3: RMSNorms over each head of q and of k, before the rotation.
    qk_norm: Option<(NormIds, NormIds)>,
    /// Sliding-window attention: how many keys (itself included) a query sees.
    window: Option<usize>,
}

impl LayerIds {
    /// The block's linear layers (what LoRA may target: which it does is the LoRA config's).
    pub fn lins_mut(&mut self) -> impl Iterator<Item = &mut Lin> {
        let mlp: Vec<&mut Lin> = match &mut self.ffn {
            Ffn::Dense { mlp_in, mlp_out } => {
                mlp_in.iter_mut().chain(std::iter::once(mlp_out)).collect()
            }
            Ffn::Experts(moe) => {
                let MoeIds {
                    router,
                    experts,
                    shared,
                    ..
                } = &mut **moe;
                let (shared_expert, shared_gate) = match shared {
                    Some((e, g)) => (Some(e), Some(g)),
                    None => (None, None),
                };
                experts
                    .iter_mut()
                    .chain(shared_expert)
                    .flat_map(|e| [&mut e.gate, &mut e.up, &mut e.down])
                    .chain(std::iter::once(router))
                    .chain(shared_gate)
                    .collect()
            }
        };
        self.qkv
            .iter_mut()
            .chain(std::iter::once(&mut self.attn_out))
            .chain(mlp)
    }

    pub fn resolve(cfg: &ModelConfig, i: usize, id: &dyn Fn(&str) -> usize) -> Self {
        let n = cfg.layer_names(i);
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let layout = match cfg.arch {
            Arch::Llama => WeightLayout::OutIn,
            Arch::Gpt2 => WeightLayout::InOut,
        };
        let lin = |names: &(String, Option<String>), in_dim, out_dim| Lin {
            w: id(&names.0),
            b: names.1.as_deref().map(id),
            in_dim,
            out_dim,
            layout,
            adapter: None,
        };
        let norm = |w: &String, b: &Option<String>| NormIds {
            kind: cfg.norm(),
            w: id(w),
            b: b.as_deref().map(id),
        };
        let qkv = match cfg.arch {
            Arch::Llama => vec![
                lin(&n.qkv[0], h, cfg.q_dim()),
                lin(&n.qkv[1], h, cfg.kv_dim()),
                lin(&n.qkv[2], h, cfg.kv_dim()),
            ],
            Arch::Gpt2 => vec![lin(&n.qkv[0], h, 3 * cfg.q_dim())],
        };
        Self {
            norm1: norm(&n.norm1_weight, &n.norm1_bias),
            qkv,
            attn_out: lin(&n.attn_out, cfg.q_dim(), h),
            norm2: norm(&n.norm2_weight, &n.norm2_bias),
            ffn: match &n.ffn {
                FfnNames::Dense { mlp_in, mlp_out } => Ffn::Dense {
                    mlp_in: mlp_in.iter().map(|m| lin(m, h, f)).collect(),
                    mlp_out: lin(mlp_out, f, h),
                },
                FfnNames::Experts {
                    router,
                    experts,
                    shared,
                } => {
                    let moe = cfg
                        .moe
                        .as_ref()
                        .expect("a block with experts has their configuration");
                    let plain = |name: &String, i, o| lin(&(name.clone(), None), i, o);
                    Ffn::Experts(Box::new(MoeIds {
                        router: plain(router, h, moe.num_experts),
                        experts: experts
                            .iter()
                            .map(|e| ExpertIds {
                                gate: plain(&e.gate, h, moe.expert_size),
                                up: plain(&e.up, h, moe.expert_size),
                                down: plain(&e.down, moe.expert_size, h),
                            })
                            .collect(),
                        shared: shared.as_ref().map(|(e, gate)| {
                            let s = moe.shared_expert_size;
                            let expert = ExpertIds {
                                gate: plain(&e.gate, h, s),
                                up: plain(&e.up, h, s),
                                down: plain(&e.down, s, h),
                            };
                            let gate = gate.as_ref().expect(
                                "the engine's shared experts are gated (DeepSeek's are refused)",
                            );
                            (expert, plain(gate, h, 1))
                        }),
                        config: (**moe).clone(),
                    }))
                }
            },
            qk_norm: n.qk_norm.as_ref().map(|(qn, kn)| {
                let rms = |w: &String| NormIds {
                    kind: NormKind::RmsNorm,
                    w: id(w),
                    b: None,
                };
                (rms(qn), rms(kn))
            }),
            window: cfg.attention_window(i),
        }
    }
}

/// What one block keeps from forward for backward (the norms' statistics in f32, the tensors in the
/// executor's activation storage).
pub(crate) struct LayerActs {
    x_in: Kept,
    /// The norms' statistics; their outputs are kept in `n1_out` / `n2_out`.
    n1: NormStash,
    n1_out: Kept,
    q: Kept,
    k: Kept,
    v: Kept,
    /// Qwen3: q and k before their head norms, and the norms' statistics (empty otherwise).
    q_pre: Kept,
    k_pre: Kept,
    q_norm: NormStash,
    k_norm: NormStash,
    /// Attention's log-sum-exp per (sequence, head, query), in f32: with Q, K, V and the output,
    /// what its backward recomputes the probabilities from.
    lse: Vec<f32>,
    attn: Kept,
    x_mid: Kept,
    n2: NormStash,
    n2_out: Kept,
    ffn: FfnActs,
}

/// What the feed-forward part keeps.
enum FfnActs {
    Dense {
        /// Llama: gate and up pre-activations; GPT-2: the c_fc output.
        mlp_pre: Vec<Kept>,
        mlp_act: Kept,
    },
    Experts(Box<MoeActs>),
}

impl LayerActs {
    pub fn bytes(&self) -> usize {
        let kept = [
            &self.x_in,
            &self.n1_out,
            &self.q,
            &self.k,
            &self.v,
            &self.q_pre,
            &self.k_pre,
            &self.attn,
            &self.x_mid,
            &self.n2_out,
        ];
        let ffn = match &self.ffn {
            FfnActs::Dense { mlp_pre, mlp_act } => {
                mlp_pre.iter().map(Kept::bytes).sum::<usize>() + mlp_act.bytes()
            }
            FfnActs::Experts(m) => m.bytes(),
        };
        let norms = [&self.n1, &self.n2, &self.q_norm, &self.k_norm];
        kept.iter().map(|k| k.bytes()).sum::<usize>()
            + ffn
            + norms.iter().map(|n| n.bytes()).sum::<usize>()
            + self.lse.len() * std::mem::size_of::<f32>()
    }

    /// The router's statistics for the load-balancing loss (empty for a dense block).
    pub fn router_tally(&self) -> Option<&RouterTally> {
        match &self.ffn {
            FfnActs::Experts(m) => Some(&m.tally),
            FfnActs::Dense { .. } => None,
        }
    }

    /// Per expert, the places the router gave it and then the places it dropped over its capacity
    /// (`2 · experts` counts; `None` for a dense block).
    pub fn expert_counts(&self) -> Option<Vec<f64>> {
        match &self.ffn {
            FfnActs::Experts(m) => Some([&m.tally.assigned[..], &m.dropped[..]].concat()),
            FfnActs::Dense { .. } => None,
        }
    }
}

fn attn_shape(cfg: &ModelConfig, ids: &LayerIds, batch: usize, seq: usize) -> AttnShape {
    AttnShape {
        batch,
        seq,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        window: ids.window,
    }
}

/// Qwen3's head norms: each head of `q` (`heads` of them per row) and of `k` normalised in place of
/// the projections' outputs, which are returned (backward reads them) with the norms' statistics.
fn head_norms_forward(
    be: &dyn Backend,
    p: &ParamStore,
    norms: Option<(NormIds, NormIds)>,
    eps: f32,
    q: &mut Vec<f32>,
    k: &mut Vec<f32>,
) -> (Vec<f32>, Vec<f32>, NormStash, NormStash) {
    let Some((qn, kn)) = norms else {
        return Default::default();
    };
    let (mut q_stats, mut k_stats) = (qn.forward(be, p, q, eps), kn.forward(be, p, k, eps));
    let q_pre = std::mem::replace(q, std::mem::take(&mut q_stats.out));
    let k_pre = std::mem::replace(k, std::mem::take(&mut k_stats.out));
    (q_pre, k_pre, q_stats, k_stats)
}

/// Splits GPT-2's fused `[rows, 3q]` projection into contiguous q, k, v (`q` wide each).
fn split_qkv(qkv: &[f32], q: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = qkv.len() / (3 * q);
    let (mut qs, mut ks, mut vs) = (
        Vec::with_capacity(rows * q),
        Vec::with_capacity(rows * q),
        Vec::with_capacity(rows * q),
    );
    for r in qkv.chunks_exact(3 * q) {
        qs.extend_from_slice(&r[..q]);
        ks.extend_from_slice(&r[q..2 * q]);
        vs.extend_from_slice(&r[2 * q..]);
    }
    (qs, ks, vs)
}

/// A row-parallel layer: each device's partial product, summed over the group, then the bias (added
/// once, after the sum). Unsplit, the bias is fused into the product.
///
/// A LoRA adapter of a row-parallel layer is partial too (its `A` holds this device's input
/// columns, its `B` is whole), so its product joins the partial sum before the reduction.
fn row_parallel_forward(
    lin: &Lin,
    be: &dyn Backend,
    tp: &dyn ShardCollectives,
    p: Weights,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    if tp.size() == 1 {
        return lin.forward(be, p, x, rows);
    }
    let mut y = lin.product(be, p.base, x, rows, false);
    lin.add_adapter(be, p, x, rows, &mut y);
    let mut y = tp.reduce(y);
    if let Some(b) = lin.b {
        let bias = &p.base.tensors[b];
        y.chunks_exact_mut(lin.out_dim)
            .for_each(|r| be.add_assign(r, bias));
    }
    y
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    m: &Transformer,
    be: &dyn Backend,
    tp: &dyn ShardCollectives,
    p: Weights,
    ids: &LayerIds,
    x: Vec<f32>,
    (batch, seq): (usize, usize),
    positions: &[u32],
) -> (Vec<f32>, LayerActs) {
    let cfg = &m.cfg;
    let rows = batch * seq;
    let eps = cfg.norm_eps as f32;
    // Norms and residuals run on this device's rows; the split regions on every row.
    let n1 = ids.norm1.forward(be, p.base, &x, eps);
    let n1_all = tp.gather_rows(&n1.out);
    let n1_in = n1_all.as_deref().unwrap_or(&n1.out);
    let (mut q, mut k, v) = match cfg.arch {
        Arch::Llama => (
            ids.qkv[0].forward(be, p, n1_in, rows),
            ids.qkv[1].forward(be, p, n1_in, rows),
            ids.qkv[2].forward(be, p, n1_in, rows),
        ),
        Arch::Gpt2 => split_qkv(&ids.qkv[0].forward(be, p, n1_in, rows), cfg.q_dim()),
    };
    drop(n1_all);
    let (q_pre, k_pre, q_norm, k_norm) =
        head_norms_forward(be, p.base, ids.qk_norm, eps, &mut q, &mut k);
    if let Some(rope) = m.rope_table(tp.sequence_length(seq)) {
        be.rope_forward(&rope, positions, cfg.num_heads, &mut q);
        be.rope_forward(&rope, positions, cfg.num_kv_heads, &mut k);
    }
    let shape = attn_shape(cfg, ids, batch, seq);
    let mut lse = vec![0f32; shape.lse_len()];
    // SAFETY: attention writes every element of its output.
    let attn = unsafe {
        be.overwritten(rows * cfg.q_dim(), &mut |attn| {
            let x = Qkv::new(&q, &k, &v);
            tp.attention_forward(be, shape, x, attn, &mut lse)
        })
    };
    let mut x_mid = row_parallel_forward(&ids.attn_out, be, tp, p, &attn, rows);
    be.add_assign(&mut x_mid, &x);
    let n2 = ids.norm2.forward(be, p.base, &x_mid, eps);
    let n2_all = tp.gather_rows(&n2.out);
    let n2_in = n2_all.as_deref().unwrap_or(&n2.out);
    let keep = |v: Vec<f32>| Kept::keep(be, v, m.activation_storage);
    let (mut out, ffn) = match &ids.ffn {
        Ffn::Dense { mlp_in, mlp_out } => {
            let mlp_pre: Vec<Vec<f32>> = mlp_in
                .iter()
                .map(|l| l.forward(be, p, n2_in, rows))
                .collect();
            drop(n2_all);
            // SAFETY: both activations write every element of their output.
            let mlp_act = unsafe {
                be.overwritten(rows * cfg.intermediate_size, &mut |act| match cfg.arch {
                    Arch::Llama => be.swiglu_forward(&mlp_pre[0], &mlp_pre[1], act),
                    Arch::Gpt2 => be.gelu_forward(&mlp_pre[0], act),
                })
            };
            let out = row_parallel_forward(mlp_out, be, tp, p, &mlp_act, rows);
            let acts = FfnActs::Dense {
                mlp_pre: mlp_pre.into_iter().map(keep).collect(),
                mlp_act: keep(mlp_act),
            };
            (out, acts)
        }
        Ffn::Experts(moe) => {
            let (out, acts) = moe::forward(be, tp, p, moe, n2_in, rows, m.activation_storage);
            (out, FfnActs::Experts(Box::new(acts)))
        }
    };
    be.add_assign(&mut out, &x_mid);
    let (mut n1, mut n2) = (n1, n2);
    let (n1_out, n2_out) = (std::mem::take(&mut n1.out), std::mem::take(&mut n2.out));
    let acts = LayerActs {
        x_in: keep(x),
        n1,
        n1_out: keep(n1_out),
        q: keep(q),
        k: keep(k),
        v: keep(v),
        q_pre: keep(q_pre),
        k_pre: keep(k_pre),
        q_norm,
        k_norm,
        lse,
        attn: keep(attn),
        x_mid: keep(x_mid),
        n2,
        n2_out: keep(n2_out),
        ffn,
    };
    (out, acts)
}

/// The MLP branch's backward: `out = x_mid + down(act(in(norm2(x_mid))))`, its input gradient added
/// into `dx`. The split region sees every row: the gradient at its output is gathered, its input
/// gradient (a partial sum) reduced back. A block of experts takes `prob_grad`, the load-balancing
/// loss's gradient with respect to its router probabilities.
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    cfg: &ModelConfig,
    be: &dyn Backend,
    tp: &dyn ShardCollectives,
    p: Weights,
    g: &mut WeightSink,
    ids: &LayerIds,
    a: &mut LayerActs,
    dx: &mut [f32],
    rows: usize,
    prob_grad: &[f32],
) {
    let f = cfg.intermediate_size;
    let dn2 = match (&ids.ffn, &mut a.ffn) {
        (Ffn::Dense { mlp_in, mlp_out }, FfnActs::Dense { mlp_pre, mlp_act }) => {
            let dact = {
                let dout_all = tp.gather_rows(dx);
                let dout = dout_all.as_deref().unwrap_or(dx);
                mlp_out.backward_new(be, p, g, dout, &mlp_act.get(be))
            };
            drop(std::mem::take(mlp_act));
            let n2_out = a.n2_out.get(be);
            let n2_all = tp.gather_rows(&n2_out);
            let n2_in = n2_all.as_deref().unwrap_or(&n2_out);
            let pre: Vec<_> = mlp_pre.iter().map(|k| k.get(be)).collect();
            match cfg.arch {
                Arch::Llama => {
                    let mut dup = Vec::new();
                    // SAFETY: SwiGLU's backward writes every element of both gradients.
                    let dgate = unsafe {
                        be.overwritten(rows * f, &mut |dgate| {
                            dup = be.overwritten(rows * f, &mut |dup| {
                                be.swiglu_backward(&dact, &pre[0], &pre[1], dgate, dup)
                            })
                        })
                    };
                    let mut dn2 = mlp_in[0].backward_new(be, p, g, &dgate, n2_in);
                    mlp_in[1].backward(be, p, g, &dup, n2_in, &mut dn2, true);
                    dn2
                }
                Arch::Gpt2 => {
                    // SAFETY: GELU's backward writes every element of its gradient.
                    let dpre = unsafe {
                        be.overwritten(rows * f, &mut |dpre| be.gelu_backward(&dact, &pre[0], dpre))
                    };
                    mlp_in[0].backward_new(be, p, g, &dpre, n2_in)
                }
            }
        }
        (Ffn::Experts(moe), FfnActs::Experts(acts)) => {
            // As the dense branch: under sequence parallelism the block saw every row.
            let dout_all = tp.gather_rows(dx);
            let dout = dout_all.as_deref().unwrap_or(dx);
            let n2_out = a.n2_out.get(be);
            let n2_all = tp.gather_rows(&n2_out);
            let n2_in = n2_all.as_deref().unwrap_or(&n2_out);
            moe::backward(be, tp, p, g, moe, acts, dout, n2_in, rows, prob_grad)
        }
        _ => unreachable!("a block's activations are of its own kind"),
    };
    let dn2 = tp.reduce(dn2);
    ids.norm2
        .backward(be, p, g, &dn2, &a.x_mid.get(be), &a.n2, dx, true);
    drop(dn2);
}

/// Turns `dx` (the gradient at the block's output, on this device's rows) into the gradient at its
/// input, in place. `prob_grad`: see [`moe::backward`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    m: &Transformer,
    be: &dyn Backend,
    tp: &dyn ShardCollectives,
    p: Weights,
    g: &mut WeightSink,
    ids: &LayerIds,
    mut a: LayerActs,
    dx: &mut [f32],
    positions: &[u32],
    (batch, seq): (usize, usize),
    prob_grad: &[f32],
) {
    let cfg = &m.cfg;
    let rows = batch * seq;
    mlp_backward(cfg, be, tp, p, g, ids, &mut a, dx, rows, prob_grad);

    // Attention branch: x_mid = x + o(attention(qkv(norm1(x))))
    let attn = a.attn.get(be);
    let dattn = {
        let dout_all = tp.gather_rows(dx);
        let dout = dout_all.as_deref().unwrap_or(dx);
        ids.attn_out.backward_new(be, p, g, dout, &attn)
    };
    let shape = attn_shape(cfg, ids, batch, seq);
    let (q, k, v) = (a.q.get(be), a.k.get(be), a.v.get(be));
    let (mut dk, mut dv) = (Vec::new(), Vec::new());
    // SAFETY: attention's backward writes every element of its three gradients.
    let mut dq = unsafe {
        be.overwritten(q.len(), &mut |dq| {
            dk = be.overwritten(k.len(), &mut |dk| {
                dv = be.overwritten(v.len(), &mut |dv| {
                    let inputs = AttnGradInputs::new(&dattn, Qkv::new(&q, &k, &v), &attn, &a.lse);
                    tp.attention_backward(be, shape, inputs, QkvGrads { dq, dk, dv })
                })
            })
        })
    };
    drop(attn);
    if let Some(rope) = m.rope_table(tp.sequence_length(seq)) {
        be.rope_backward(&rope, positions, cfg.num_heads, &mut dq);
        be.rope_backward(&rope, positions, cfg.num_kv_heads, &mut dk);
    }
    if let Some((qn, kn)) = ids.qk_norm {
        // The head norms' backward: from the normalised heads back to the projections' outputs.
        let head_norm_backward =
            |norm: NormIds, dy: &[f32], x: &Kept, stats: &NormStash, g: &mut WeightSink| {
                let x = x.get(be);
                let mut dx = be.zeros(x.len());
                norm.backward(be, p, g, dy, &x, stats, &mut dx, false);
                dx
            };
        dq = head_norm_backward(qn, &dq, &a.q_pre, &a.q_norm, g);
        dk = head_norm_backward(kn, &dk, &a.k_pre, &a.k_norm, g);
    }
    let dn1 = {
        let n1_out = a.n1_out.get(be);
        let n1_all = tp.gather_rows(&n1_out);
        let n1_in = n1_all.as_deref().unwrap_or(&n1_out);
        match cfg.arch {
            Arch::Llama => {
                let mut dn1 = ids.qkv[0].backward_new(be, p, g, &dq, n1_in);
                ids.qkv[1].backward(be, p, g, &dk, n1_in, &mut dn1, true);
                ids.qkv[2].backward(be, p, g, &dv, n1_in, &mut dn1, true);
                dn1
            }
            Arch::Gpt2 => {
                let q = cfg.q_dim();
                let mut dqkv = Vec::with_capacity(rows * 3 * q);
                for r in 0..rows {
                    for part in [&dq, &dk, &dv] {
                        dqkv.extend_from_slice(&part[r * q..(r + 1) * q]);
                    }
                }
                ids.qkv[0].backward_new(be, p, g, &dqkv, n1_in)
            }
        }
    };
    let dn1 = tp.reduce(dn1);
    ids.norm1
        .backward(be, p, g, &dn1, &a.x_in.get(be), &a.n1, dx, true);
}

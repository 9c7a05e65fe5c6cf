//! FLOPs, bytes on the wire per parallel dimension, and the time they take on the cluster's links.

use super::{AttentionKernel, PlanInput};
use crate::layout::{Layout, Recompute};
use crate::model::{Arch, ModelConfig};
use crate::rank::Dim;
use crate::schedule::ActionCosts;
use crate::topology::{Cluster, Link};

pub use crate::model::{head_forward_flops, layer_forward_flops};

/// FLOPs of one optimizer step: model FLOPs (forward + backward, the MFU numerator) and hardware FLOPs
/// (adding the recomputed forward where recompute is on, and the memory-efficient attention's
/// recomputed scores in backward). A frozen base (LoRA) computes no weight gradients: its backward
/// is the input gradients alone, as much as the forward.
///
/// Model FLOPs count attention's products over the keys each query sees — under the causal mask
/// (and a sliding window) not the whole sequence — as Megatron-Core and FlashAttention count them:
/// `passes · (2·N·tokens + 4·q_dim·Σ keys seen)`. Hardware FLOPs count them in full, as Narayanan et
/// al. 2021 report the TFLOP/s per device the calibration tables hold.
pub fn step_flops(
    cfg: &ModelConfig,
    l: &Layout,
    seq: usize,
    global_batch: usize,
    frozen_base: bool,
    attention: AttentionKernel,
) -> (f64, f64) {
    let layers = layer_forward_flops(cfg, 1, seq) * cfg.num_layers as f64 * global_batch as f64;
    let head = head_forward_flops(cfg, 1, seq) * global_batch as f64;
    let passes = if frozen_base { 2.0 } else { 3.0 };
    let model = passes * (layers + head);
    // Attention's two forward products (QKᵀ and PV) over every layer and sequence.
    let attention_forward = (seq * seq) as f64
        * cfg.attention_score_flops_per_key()
        * cfg.num_layers as f64
        * global_batch as f64;
    let flash = attention == AttentionKernel::Flash;
    let extra = match (l.recompute, flash) {
        (Recompute::Full, _) => layers,
        (Recompute::Selective, false) => attention_forward,
        // The memory-efficient kernel keeps no probabilities: selective recompute has none to drop.
        (Recompute::Selective, true) | (Recompute::None, _) => 0.0,
    };
    // Its backward recomputes QKᵀ: half the forward's attention products again.
    let scores_again = if flash { attention_forward / 2.0 } else { 0.0 };
    let unmasked: f64 = (0..cfg.num_layers)
        .map(|i| 1.0 - keys_seen(seq, cfg.attention_window(i)) / seq as f64)
        .sum::<f64>()
        / cfg.num_layers.max(1) as f64;
    let masked = passes * attention_forward * unmasked;
    (model - masked, model + extra + scores_again)
}

/// The keys a query sees on average over a sequence of `seq` under the causal mask, and within
/// `window` positions when the layer has a sliding window.
pub fn keys_seen(seq: usize, window: Option<usize>) -> f64 {
    let (s, w) = (seq as f64, window.unwrap_or(seq).min(seq) as f64);
    // Query i sees min(i + 1, w) keys: 1, 2, …, w, then w for the remaining s − w queries.
    (w * (w + 1.0) / 2.0 + (s - w) * w) / s
}

/// Which link each group's traffic uses: the slow one when any group of that dimension spans nodes
/// (placement by [`crate::rank::RankGrid`]).
pub struct Links {
    pub tp: Link,
    pub cp: Link,
    pub dp: Link,
    pub pp: Link,
    /// The replicas' group (dp × cp: the gradient reduction and ZeRO): the data-parallel link when
    /// there are several replicas along dp (it is the slower, farther apart), else the cp one.
    pub replicas: Link,
    /// The expert-parallel groups' (see [`expert_groups_within_nodes`]).
    pub ep: Link,
}

/// Whether every expert-parallel group sits inside a node. A group is `ep` consecutive replicas,
/// `tp` ranks apart, and the groups tile the ranks in aligned blocks of `ep · tp` (the replicas of
/// a stage are a multiple of ep): inside nodes when a node holds whole blocks.
pub fn expert_groups_within_nodes(c: &Cluster, l: &Layout) -> bool {
    let block = l.ep.max(1) * l.tp.max(1);
    block <= c.devices_per_node && c.devices_per_node.is_multiple_of(block)
}

pub fn links(c: &Cluster, l: &Layout) -> Links {
    let grid = l.rank_grid(c.devices_per_node);
    let pick = |d: Dim| {
        if grid.within_nodes(d) {
            c.intra_node
        } else {
            c.inter_node
        }
    };
    Links {
        tp: pick(Dim::Tp),
        cp: pick(Dim::Cp),
        dp: pick(Dim::Dp),
        pp: pick(Dim::Pp),
        replicas: if l.dp > 1 {
            pick(Dim::Dp)
        } else {
            pick(Dim::Cp)
        },
        ep: if expert_groups_within_nodes(c, l) {
            c.intra_node
        } else {
            c.inter_node
        },
    }
}

fn ring_time(bytes_per_device: f64, steps: usize, link: &Link, eff: f64) -> f64 {
    bytes_per_device / (link.bandwidth_bytes_per_s * eff) + steps as f64 * link.latency_s
}

/// Bytes each device sends per optimizer step along each dimension (ring algorithms), and the
/// time per TP all-reduce and per boundary transfer.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Traffic {
    pub tp: f64,
    pub pp: f64,
    /// The replicas' gradient reduction (and ZeRO's gathers): over dp × cp devices.
    pub dp: f64,
    /// Context parallelism's attention: the ring's K/V blocks (and their gradients), or the
    /// all-to-alls.
    #[serde(default)]
    pub cp: f64,
    /// Expert parallelism's all-to-alls: tokens to their experts' devices and back, forward and
    /// backward ([`expert_all_to_all_bytes`], at the balanced load).
    #[serde(default)]
    pub ep: f64,
}

/// Bytes one device of layout `l` sends in expert parallelism's all-to-alls over `exchanges`
/// (block with experts, micro-batch) pairs, for `places_out` of its tokens' top-k places routed to
/// other devices' experts and `places_in` places it received from them, summed over those pairs:
/// each pair exchanges the routed rows' counts (one 8-byte count per expert a device holds, to
/// each other device of its group), then sends the rows out and their results back (`hidden`
/// wide, `value_bytes` each: the activations' wire format), and the backward sends their gradients
/// the same two ways. The engine sends exactly this; the plan prices it at the balanced load
/// ([`balanced_places`]).
pub fn expert_all_to_all_bytes(
    cfg: &ModelConfig,
    l: &Layout,
    value_bytes: f64,
    exchanges: f64,
    (places_out, places_in): (f64, f64),
) -> f64 {
    let ep = l.ep;
    let Some(m) = cfg.moe.as_ref().filter(|_| ep > 1) else {
        return 0.0;
    };
    let held = m.num_experts / (ep * l.expert_blocks());
    let counts = exchanges * (ep - 1) as f64 * held as f64 * 8.0;
    counts + 2.0 * (places_out + places_in) * cfg.hidden_size as f64 * value_bytes
}

/// The top-k places a device of layout `l` sends to other devices' experts (and receives) for
/// `tokens` of its tokens, when the router spreads them evenly over the experts: under `etp=1`
/// only its tensor-parallel block's places travel (the others are its tp group's).
pub fn balanced_places(cfg: &ModelConfig, l: &Layout, tokens: f64) -> f64 {
    match &cfg.moe {
        Some(m) => {
            let ep = l.ep.max(1) as f64;
            tokens * m.top_k as f64 / l.expert_blocks() as f64 * (ep - 1.0) / ep
        }
        None => 0.0,
    }
}

pub struct Costs {
    pub traffic: Traffic,
    /// One entry per virtual stage.
    pub actions: Vec<ActionCosts>,
    /// The part of each virtual stage's forward and backward (both halves) that is communication
    /// inside the action: tensor-parallel collectives and ZeRO-3 gathers.
    pub action_comm: Vec<(f64, f64)>,
    pub dp_time: f64,
    /// The optimizer step after the reduction.
    pub optimizer_time: f64,
    /// Memory work on the gradients outside every action, per step: zeroing them before the
    /// first micro-batch, and reading this device's share of them for the global norm after the
    /// reduction.
    pub grad_zeroing_time: f64,
    pub grad_norm_time: f64,
}

impl Costs {
    /// What a step adds to its schedule's actions, on every device: the gradients zeroed, the
    /// replicas' reduction as far as it is exposed, the norm's read and the optimizer step.
    pub fn per_step_time(&self) -> f64 {
        self.grad_zeroing_time + self.dp_time + self.grad_norm_time + self.optimizer_time
    }
}

/// Compute time of one transformer layer on one device for one micro-batch, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerTime {
    pub forward: f64,
    pub backward: f64,
    /// What recomputation adds to the backward (the whole forward, or attention only).
    pub recompute: f64,
}

/// One GEMM [m × k]·[k × n] at the calibrated efficiency of its shape: the curve rises with the
/// geometric mean width √(n·k) (narrow GEMMs are launch- and memory-bound) towards its maximum.
pub fn gemm_time(c: &Cluster, m: f64, n: f64, k: f64) -> f64 {
    let cal = &c.calibration;
    let w = (n * k).sqrt();
    let eff = cal.gemm_efficiency_max * w / (w + cal.gemm_half_width);
    2.0 * m * n * k / (c.peak_flops * eff)
}

/// The (n, k) of each GEMM of one layer on one device of a tensor-parallel group of `t`: column-
/// parallel projections [h → out/t], row-parallel ones [in/t → h].
pub fn layer_gemm_shapes(cfg: &ModelConfig, t: f64) -> Vec<(f64, f64)> {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    match cfg.arch {
        Arch::Llama if cfg.latent_attention.is_some() => {
            // Latent attention: the down-projections whole, the up-projections and o by heads.
            let a = cfg.latent_attention.expect("checked");
            let w = cfg.attention_widths(t as usize);
            let kv_b = cfg.num_heads as f64 * (cfg.head_dim - a.qk_rope_head_dim) as f64 / t + w.v;
            let mut shapes = match a.q_lora_rank {
                Some(r) => vec![(r as f64, h), (w.q, r as f64)],
                None => vec![(w.q, h)],
            };
            shapes.extend([
                ((a.kv_lora_rank + a.qk_rope_head_dim) as f64, h),
                (kv_b, a.kv_lora_rank as f64),
                (h, w.out),
                (f / t, h),
                (f / t, h),
                (h, f / t),
            ]);
            shapes
        }
        Arch::Llama => {
            let (q, kv) = (cfg.q_dim() as f64, cfg.kv_dim() as f64);
            vec![
                (q / t, h),
                (kv / t, h),
                (kv / t, h),
                (h, q / t),
                (f / t, h),
                (f / t, h),
                (h, f / t),
            ]
        }
        Arch::Gpt2 => vec![(3.0 * h / t, h), (h, h / t), (f / t, h), (h, f / t)],
    }
}

/// Bytes the memory-bound operations of one layer's forward read and write per token on one device:
/// two norms, two residual adds, the rotary embedding or the biases, the MLP's activation (the
/// attention kernel's softmax is fused). Sharded tensors count 1/t, the hidden state whole.
pub fn layer_elementwise_bytes_per_token(cfg: &ModelConfig, t: f64, act_bytes: f64) -> f64 {
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    let per_token = match cfg.arch {
        Arch::Llama => {
            let w = cfg.attention_widths(t as usize);
            10.0 * h + 2.0 * (w.q + w.k) + 3.0 * f / t
        }
        Arch::Gpt2 => 10.0 * h + 2.0 * (3.0 * h + f) / t + 2.0 * f / t,
    };
    per_token * act_bytes
}

/// Compute time of one layer: its GEMMs at their shapes' efficiency, attention's QKᵀ and PV at the
/// attention efficiency, the memory-bound operations at the device's memory bandwidth; backward twice
/// the forward (input and weight gradients), and the memory-efficient attention's backward its
/// five products to the forward's two (it recomputes QKᵀ).
pub fn layer_time(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> LayerTime {
    let c = &input.cluster;
    let t = l.tp as f64;
    // This device's tokens (seq / cp of each sequence); attention's queries among them see the
    // whole sequence.
    let tokens = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let gemms: f64 = layer_gemm_shapes(cfg, t)
        .into_iter()
        .map(|(n, k)| gemm_time(c, tokens, n, k))
        .sum();
    let attention = attention_time(input, cfg, l);
    let flash = input.attention == AttentionKernel::Flash;
    let elementwise = tokens
        * (layer_elementwise_bytes_per_token(cfg, t, input.precision.weights.bytes())
            + if flash {
                0.0
            } else {
                materialized_score_bytes_per_token(input, cfg, l)
            })
        / c.memory_bandwidth_bytes_per_s;
    let forward = gemms + attention + elementwise;
    let recompute = match (l.recompute, flash) {
        (Recompute::Full, _) => forward,
        (Recompute::Selective, false) => attention,
        (Recompute::Selective, true) | (Recompute::None, _) => 0.0,
    };
    let scores_again = if flash { attention / 2.0 } else { 0.0 };
    // A frozen base (LoRA) computes no weight gradients: its backward is the input gradients'
    // GEMMs and the rest twice (the adapters' own products are r/out of the base's: left out).
    let backward = if input.lora.is_some() {
        2.0 * forward - gemms + scores_again
    } else {
        2.0 * forward + scores_again
    };
    LayerTime {
        forward,
        backward,
        recompute,
    }
}

/// Bytes the softmax moves per query token of one layer's forward on one device when attention
/// materialises its scores: every score of this device's heads (the whole sequence's keys: the
/// masked half is computed and masked) read, and its probability written. The memory-efficient
/// kernel keeps them in registers and caches instead.
fn materialized_score_bytes_per_token(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> f64 {
    let heads = cfg.num_heads as f64 / l.tp as f64;
    2.0 * heads * input.seq as f64 * input.precision.weights.bytes()
}

/// Forward time of the output layer and the loss on one device: the vocab-parallel GEMM, and the
/// cross-entropy's passes over the f32 logits (max, exp-sum, gradient).
fn head_time(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> f64 {
    let c = &input.cluster;
    let tokens = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let vocab = super::padded_vocab(cfg, l.tp) as f64 / l.tp as f64;
    gemm_time(c, tokens, vocab, cfg.hidden_size as f64)
        + 3.0 * tokens * vocab * 4.0 / c.memory_bandwidth_bytes_per_s
}

/// Bytes one device of pipeline stage `stage` sends to its tensor-parallel group in one step, counted
/// collective by collective as the engine issues them (ring algorithms: an all-reduce sends
/// 2(t−1)/t of its buffer, a reduce-scatter or all-gather (t−1)/t of the whole).
///
/// Per layer and micro-batch, in units of (t−1)/t of one hidden-state tensor: forward 4 (two
/// all-reduces, or under sequence parallelism two all-gathers and two reduce-scatters); backward 4
/// (two all-reduces), or 6 under sequence parallelism (the norm outputs are gathered again for the
/// weight gradients); a fully recomputed forward repeats its 4. The first stage adds the
/// vocab-parallel embedding's reduction, the last the output layer's and the cross-entropy's row
/// maxima and sums (f32 and f64). After the step: replicated parameters whose gradients are partial
/// (norms and position embeddings under sequence parallelism; KV heads shared by several devices).
pub fn tp_bytes_per_device(input: &PlanInput, cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    if l.tp <= 1 {
        return 0.0;
    }
    let t = l.tp as f64;
    let ring = (t - 1.0) / t;
    let m = (input.global_batch / (l.dp * l.micro_batch_size)) as f64;
    let rows = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let act = input.precision.weights.bytes();
    let hidden = ring * rows * cfg.hidden_size as f64 * act;
    let sp = l.sequence_parallel;
    let layers = super::stage_layers(cfg, l, stage) as f64;
    let recompute = if l.recompute == Recompute::Full {
        4.0
    } else {
        0.0
    };
    let per_layer = 4.0 + if sp { 6.0 } else { 4.0 } + recompute;
    let mut units = layers * per_layer;
    let (first, last) = (stage == 0, stage == l.pp - 1);
    if first {
        // Embedding: all-reduce forward; or reduce-scatter forward and all-gather backward.
        units += 2.0;
    }
    let mut per_micro_batch = 0.0;
    if last {
        // Output layer: all-reduce of its input gradient; or gather forward, gather again and
        // reduce-scatter backward.
        units += if sp { 3.0 } else { 2.0 };
        // Cross-entropy: row maxima gathered (f32), two f64 sums per row all-reduced.
        per_micro_batch += (t - 1.0) * rows * 4.0 + 2.0 * ring * 2.0 * rows * 8.0;
    }
    let mut after = 0.0;
    let grad = input.precision.grads.bytes();
    let h = cfg.hidden_size as f64;
    if let Some(lora) = &input.lora {
        // Only the adapters have gradients. The replicated half of each (a column-parallel base's
        // `A`, a row-parallel base's `B`) is a partial sum on every device, summed over the group;
        // a shared KV head's `B` over the devices sharing it.
        let r = lora.rank as f64;
        let over_layers = |per: &dyn Fn(&crate::model::LoraTarget, usize) -> f64| {
            super::memory::sum_over_stage_layers(cfg, l, stage, &|i| {
                let (dense, experts) = super::memory::lora_layer_sum(cfg, lora, l, i, per);
                dense + experts
            })
        };
        // (A routed expert's adapters under etp=1 are whole on one device: nothing to sum.)
        let whole = over_layers(&|m, t| match (m.split, t) {
            (_, 1) => 0.0,
            (crate::model::TargetSplit::Column, _) => r * m.in_dim as f64,
            (crate::model::TargetSplit::Row, _) => r * m.out_dim as f64,
        });
        after += 2.0 * ring * whole * grad;
        if cfg.num_kv_heads < l.tp {
            let kv_b = over_layers(&|m, _| {
                if matches!(m.short.as_str(), "k_proj" | "v_proj") {
                    r * cfg.head_dim as f64
                } else {
                    0.0
                }
            });
            let g = (l.tp / cfg.num_kv_heads) as f64;
            after += 2.0 * (g - 1.0) / g * kv_b * grad;
        }
        return m * (units * hidden + per_micro_batch) + after;
    }
    if sp {
        let norms_per_layer = if cfg.arch == Arch::Gpt2 { 4.0 } else { 2.0 };
        let mut partial = layers * norms_per_layer * h;
        if last {
            partial += if cfg.arch == Arch::Gpt2 { 2.0 * h } else { h };
        }
        if first && cfg.arch == Arch::Gpt2 {
            partial += cfg.max_position_embeddings as f64 * h;
        }
        after += 2.0 * ring * partial * grad;
    }
    if cfg.num_kv_heads < l.tp {
        let g = (l.tp / cfg.num_kv_heads) as f64;
        after += 2.0 * (g - 1.0) / g * layers * 2.0 * (cfg.head_dim as f64 * h) * grad;
    }
    m * (units * hidden + per_micro_batch) + after
}

/// One tensor-parallel all-reduce of a hidden state of `boundary` bytes: the bytes a device sends
/// and the time it takes on `link`.
fn tp_all_reduce(l: &Layout, boundary: f64, link: &Link, eff: f64) -> (f64, f64) {
    if l.tp <= 1 {
        return (0.0, 0.0);
    }
    let t = l.tp as f64;
    let bytes = 2.0 * (t - 1.0) / t * boundary;
    (bytes, ring_time(bytes, 2 * (l.tp - 1), link, eff))
}

/// Prices one layout: per-action compute and communication costs for the schedule simulator, and the
/// data-parallel reduction after it.
pub fn costs(input: &PlanInput, cfg: &ModelConfig, l: &Layout, params_per_device: f64) -> Costs {
    let c = &input.cluster;
    let cal = &c.calibration;
    let links = links(c, l);
    let m = input.global_batch / (l.dp * l.micro_batch_size);
    let act = input.precision.weights.bytes();
    let boundary = (l.micro_batch_size * super::local_seq(input, l) * cfg.hidden_size) as f64 * act;
    let lt = layer_time(input, cfg, l);
    let cp = context_costs(input, cfg, l, &links.cp);
    let ep = expert_costs(input, cfg, l, &links.ep);

    // Tensor parallel time: 2 all-reduces in forward and 2 in backward per layer (3 under sequence
    // parallelism, below), 2 more when the forward is recomputed: the bytes `tp_bytes_per_device`
    // counts.
    let (ar_bytes, ar_time) = tp_all_reduce(l, boundary, &links.tp, cal.link_efficiency);
    let recompute_ar = if l.recompute == Recompute::Full {
        2.0
    } else {
        0.0
    };
    // Backward: the two all-reduces' worth of the forward's; sequence parallelism gathers a
    // layer's inputs again for the weight gradients (six collectives of half an all-reduce each).
    let backward_ar = if l.sequence_parallel { 3.0 } else { 2.0 };
    let chunk_layers = super::chunk_layers(cfg, l);
    let p2p = if l.pp > 1 {
        boundary / (links.pp.bandwidth_bytes_per_s * cal.link_efficiency) + links.pp.latency_s
    } else {
        0.0
    };
    let head_fwd = head_time(input, cfg, l);
    let (embed_comm, head_comm) = edge_comm(input, l, ar_bytes, &links.tp, cal.link_efficiency);
    let nv = l.pp * l.vpp;
    // What the optimizer updates, and so what data parallelism reduces and gathers: every
    // parameter, or with LoRA the adapters (the frozen base never moves).
    let trainable = match &input.lora {
        Some(lora) => super::memory::lora_params_on_device(cfg, lora, l, 0),
        None => params_per_device,
    };
    let (grad_b, w_b) = (
        input.precision.grads.bytes(),
        input.precision.weights.bytes(),
    );
    let stage_layers = super::stage_layers(cfg, l, 0).max(1) as f64;
    let zero3 = |layers: f64| zero3_costs(input, l, trainable * layers / stage_layers);
    let GradientUpkeep {
        buckets: bucket_work,
        zeroing: grad_zeroing_time,
        norm: grad_norm_time,
    } = gradient_upkeep(input, l, trainable);
    let action_comm: Vec<(f64, f64)> = (0..nv)
        .map(|vs| {
            let layers = chunk_layers.get(vs).copied().unwrap_or(0) as f64;
            let [fwd, bwd] = zero3(layers);
            let (mut f, mut b) = (
                layers * (2.0 * ar_time + cp.forward + ep.per_layer) + fwd.0,
                layers * ((backward_ar + recompute_ar) * ar_time + cp.backward + ep.per_layer)
                    + bwd.0,
            );
            if vs == 0 {
                (f, b) = (f + embed_comm.0, b + embed_comm.1);
            }
            if vs == nv - 1 {
                (f, b) = (f + head_comm.0, b + head_comm.1);
            }
            (f, b)
        })
        .collect();
    let actions = (0..nv)
        .map(|vs| {
            let layers = chunk_layers.get(vs).copied().unwrap_or(0) as f64;
            let [gather_fwd, gather_bwd] = zero3(layers);
            let mut fwd = layers * (lt.forward + 2.0 * ar_time + cp.forward + ep.per_layer)
                + gather_fwd.0
                + gather_fwd.1;
            // The reduction buckets' copies happen in the last micro-batch's backward; spread
            // over the micro-batches, they add up to the step's.
            let mut bwd = layers
                * (lt.backward
                    + lt.recompute
                    + (backward_ar + recompute_ar) * ar_time
                    + cp.backward
                    + ep.per_layer)
                + gather_bwd.0
                + gather_bwd.1
                + bucket_work * layers / stage_layers / m as f64;
            if vs == 0 {
                fwd += embed_comm.0;
                bwd += embed_comm.1;
            }
            if vs == nv - 1 {
                fwd += head_fwd + head_comm.0;
                bwd += 2.0 * head_fwd + head_comm.1;
            }
            // Zero-bubble schedules split the backward; its two GEMM halves cost about the same.
            ActionCosts {
                forward: fwd,
                backward_input: bwd / 2.0,
                backward_weight: bwd / 2.0,
                p2p,
                update: 0.0,
            }
        })
        .collect();

    let tp_bytes = (0..l.pp)
        .map(|stage| tp_bytes_per_device(input, cfg, l, stage))
        .fold(0.0, f64::max);
    let pp_bytes = pp_bytes(input, cfg, l, m, boundary);
    // Under expert parallelism the routed experts reduce over the replicas holding them only.
    let experts = match &input.lora {
        None => super::memory::routed_expert_params(cfg, l) * super::stage_layers(cfg, l, 0) as f64,
        Some(_) => 0.0,
    };
    let dp_bytes = dp_bytes(l, m, (trainable, experts), grad_b, w_b);
    let dp_time = replica_reduction_time(input, l, dp_bytes, &links.replicas);
    // The busiest stage's layers, each micro-batch.
    let stage_layers = (0..l.pp)
        .map(|st| super::stage_layers(cfg, l, st))
        .max()
        .unwrap_or(0) as f64;
    let cp_bytes = stage_layers * m as f64 * cp.bytes_per_layer;
    let ep_bytes = m as f64 * ep.bytes_per_micro_batch;
    let optimizer_time = optimizer_time(input, l, trainable);
    Costs {
        optimizer_time,
        grad_zeroing_time,
        grad_norm_time,
        traffic: Traffic {
            tp: tp_bytes,
            pp: pp_bytes,
            dp: dp_bytes,
            cp: cp_bytes,
            ep: ep_bytes,
        },
        actions,
        action_comm,
        dp_time,
    }
}

/// The replicas' (dp × cp) gradient reduction after the step, as far as it is not overlapped with
/// the backward; ZeRO-3's collectives are priced inside the actions instead.
fn replica_reduction_time(input: &PlanInput, l: &Layout, bytes: f64, link: &Link) -> f64 {
    let cal = &input.cluster.calibration;
    let replicas = l.replicas();
    if replicas > 1 && l.zero < 3 {
        ring_time(bytes, 2 * (replicas - 1), link, cal.link_efficiency) * (1.0 - cal.dp_overlap)
    } else {
        0.0
    }
}

/// ZeRO-3 per virtual stage and micro-batch, for `p` parameters (the first stage's shared out by
/// layers: its embedding rides along with them): (forward, backward), each as (exposed transfer,
/// memory work). A unit's parameters are gathered for every micro-batch's forward and again for its
/// backward, and its gradients reduce-scattered as the backward finishes them; the next unit is
/// prefetched, so the transfer hides behind compute as far as `dp_overlap` says; assembling the
/// whole unit in memory (and summing the gradients) is work on the device.
fn zero3_costs(input: &PlanInput, l: &Layout, p: f64) -> [(f64, f64); 2] {
    let replicas = l.replicas();
    if l.zero < 3 || replicas <= 1 {
        return [(0.0, 0.0); 2];
    }
    let c = &input.cluster;
    let cal = &c.calibration;
    let dp_link = links(c, l).replicas;
    let (grad_b, w_b) = (
        input.precision.grads.bytes(),
        input.precision.weights.bytes(),
    );
    let d = replicas as f64;
    let ring = (d - 1.0) / d;
    let hidden = 1.0 - cal.dp_overlap;
    let link = |bytes: f64| ring_time(ring * bytes, replicas - 1, &dp_link, cal.link_efficiency);
    let bw = c.memory_bandwidth_bytes_per_s;
    // The bytes the engine moves: a gather copies this device's pieces out (read and write p/d),
    // zeroes the gathered buffer (p) and assembles the tensors from it (read and write p); a
    // scatter zeroes the unit's gradients (p), interleaves them into one buffer (read and write
    // p) and adds this device's block into its pieces (read 2p/d, write p/d).
    let gather = (link(p * w_b) * hidden, (3.0 + 2.0 / d) * p * w_b / bw);
    let scatter = (link(p * grad_b) * hidden, (3.0 + 3.0 / d) * p * grad_b / bw);
    [gather, (gather.0 + scatter.0, gather.1 + scatter.1)]
}

/// The tensor-parallel collectives beyond the layers' (those `tp_bytes_per_device` counts), as
/// (forward, backward) of the first virtual stage and of the last: the embedding's reduction on the
/// first (an all-reduce forward; under sequence parallelism a reduce-scatter forward and an
/// all-gather backward), and on the last the output layer's (an all-reduce of its input gradient;
/// or a gather forward, another and a reduce-scatter backward) and the loss's (row maxima gathered
/// in f32, two f64 sums per row all-reduced). Each half of an all-reduce moves half its bytes in
/// t − 1 ring steps.
fn edge_comm(
    input: &PlanInput,
    l: &Layout,
    ar_bytes: f64,
    link: &Link,
    eff: f64,
) -> ((f64, f64), (f64, f64)) {
    if l.tp <= 1 {
        return ((0.0, 0.0), (0.0, 0.0));
    }
    let t = l.tp as f64;
    let half = ring_time(ar_bytes / 2.0, l.tp - 1, link, eff);
    let rows = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let loss = ring_time((t - 1.0) * rows * 4.0, l.tp - 1, link, eff)
        + 2.0 * ring_time(2.0 * (t - 1.0) / t * rows * 8.0, 2 * (l.tp - 1), link, eff);
    if l.sequence_parallel {
        ((half, half), (half + loss, 2.0 * half))
    } else {
        ((2.0 * half, 0.0), (loss, 2.0 * half))
    }
}

/// Pipeline bytes of the busiest device per step: each device sends its boundary activation forward
/// and its gradient backward, per micro-batch, for every chunk that has a neighbour in that
/// direction (the first virtual stage has none behind it, the last none ahead; under sequence
/// parallelism the boundary is this device's rows). A tied embedding's gradient is summed between
/// the end stages.
fn pp_bytes(input: &PlanInput, cfg: &ModelConfig, l: &Layout, m: usize, boundary: f64) -> f64 {
    if l.pp <= 1 {
        return 0.0;
    }
    let t = l.tp as f64;
    let nv = l.pp * l.vpp;
    let rows_here = if l.sequence_parallel && l.tp > 1 {
        t
    } else {
        1.0
    };
    let tied = if cfg.tie_word_embeddings && input.lora.is_none() {
        2.0 * 0.5 * super::memory::padded_vocab(cfg, l.tp) as f64 * cfg.hidden_size as f64 / t
            * input.precision.grads.bytes()
    } else {
        0.0
    };
    (0..l.pp)
        .map(|s| {
            let chunks = (0..l.vpp).map(|k| k * l.pp + s);
            let sends: usize = chunks
                .map(|vs| usize::from(vs + 1 < nv) + usize::from(vs > 0))
                .sum();
            let ends = if s == 0 || s == l.pp - 1 { tied } else { 0.0 };
            // A mixture of experts' router statistics beside each boundary tensor: 2·E + 2 f64.
            let router = cfg
                .moe
                .as_ref()
                .map_or(0.0, |m| (2 * m.num_experts + 2) as f64 * 8.0);
            sends as f64 * m as f64 * (boundary / rows_here + router) + ends
        })
        .fold(0.0, f64::max)
}

/// Data-parallel bytes per device per step for the ZeRO stage: `trainable` parameters (of which
/// `experts` are routed experts), gradients of `grad_b` bytes and weights of `w_b`, over `m`
/// micro-batches, among the dp × cp replicas (the experts among the dp × cp / ep holding them).
fn dp_bytes(l: &Layout, m: usize, (trainable, experts): (f64, f64), grad_b: f64, w_b: f64) -> f64 {
    let ep = l.ep.max(1);
    if ep > 1 && experts > 0.0 {
        let dense = Layout { ep: 1, ..*l };
        let routed = Layout {
            ep: 1,
            dp: (l.replicas() / ep).max(1),
            cp: 1,
            ..*l
        };
        return dp_bytes(&dense, m, (trainable - experts, 0.0), grad_b, w_b)
            + dp_bytes(&routed, m, (experts, 0.0), grad_b, w_b);
    }
    if l.replicas() <= 1 {
        return 0.0;
    }
    let d = l.replicas() as f64;
    let ring = (d - 1.0) / d;
    let m = m as f64;
    match l.zero {
        // All-reduce of the gradients.
        0 => 2.0 * ring * trainable * grad_b,
        // Reduce-scatter the gradients, all-gather the updated parameters.
        1 => ring * trainable * grad_b + ring * trainable * w_b,
        // Gradients are not kept whole, so each micro-batch's are reduce-scattered as its
        // backward finishes them (accumulation happens in the shards).
        2 => m * ring * trainable * grad_b + ring * trainable * w_b,
        // ...and every unit's parameters are gathered for each micro-batch's forward and again
        // for its backward.
        _ => m * ring * trainable * grad_b + 2.0 * m * ring * trainable * w_b,
    }
}

/// The memory work on a device's gradients that the layers' costs do not hold, per step, in
/// seconds. ZeRO-3's per-unit work is in [`zero3_costs`].
struct GradientUpkeep {
    /// Inside the backward: the replicas' reduction buckets assembled and their results filed back.
    buckets: f64,
    /// Before the first micro-batch: the gradients zeroed.
    zeroing: f64,
    /// After the reduction: this device's share read for the global norm.
    norm: f64,
}

fn gradient_upkeep(input: &PlanInput, l: &Layout, trainable: f64) -> GradientUpkeep {
    let bw = input.cluster.memory_bandwidth_bytes_per_s;
    let grads = trainable * input.precision.grads.bytes();
    let d = l.replicas() as f64;
    let buckets = match (l.replicas() > 1, l.zero) {
        (false, _) | (true, 3..) => 0.0,
        // Each bucket concatenated (read and write) and its sums copied back (read and write).
        (true, 0) => 4.0 * grads,
        // Interleaved into one buffer, and this device's pieces filed back.
        (true, 1) => 2.0 * grads + 2.0 * grads / d,
        // Per unit: zeroed, interleaved, and this device's block added into its pieces.
        (true, _) => (3.0 + 3.0 / d) * grads,
    };
    // ZeRO-2/3 hold only their pieces between units (zeroed at the start); below, whole gradients.
    let zeroed = if l.zero >= 2 { grads / d } else { grads };
    GradientUpkeep {
        buckets: buckets / bw,
        zeroing: zeroed / bw,
        norm: grads / d / bw,
    }
}

/// AdamW reads each trainable parameter's gradient, master copy and two moments and writes all but
/// the gradient back, plus the compute-precision copy: memory-bound, on this device's shard.
fn optimizer_time(input: &PlanInput, l: &Layout, trainable: f64) -> f64 {
    let pr = &input.precision;
    let optimizer_bytes = pr.grads.bytes()
        + 2.0 * pr.master_bytes()
        + 2.0 * input.optimizer.state_bytes(pr)
        + if pr.master_bytes() > 0.0 {
            pr.weights.bytes()
        } else {
            0.0
        };
    let shard = if l.zero >= 1 {
        l.replicas() as f64
    } else {
        1.0
    };
    trainable / shard * optimizer_bytes / input.cluster.memory_bandwidth_bytes_per_s
}

/// Expert parallelism per micro-batch on one device: the bytes it sends, and the exposed time of
/// a layer's two all-to-alls in one direction (forward, or backward), a block average (the blocks
/// without experts exchange nothing). Not overlapped: each waits for the routing before it.
struct ExpertCosts {
    bytes_per_micro_batch: f64,
    per_layer: f64,
}

fn expert_costs(input: &PlanInput, cfg: &ModelConfig, l: &Layout, link: &Link) -> ExpertCosts {
    let none = ExpertCosts {
        bytes_per_micro_batch: 0.0,
        per_layer: 0.0,
    };
    if cfg.moe.is_none() || l.ep <= 1 {
        return none;
    }
    // The busiest stage's blocks with experts.
    let layers = (0..l.pp)
        .map(|s| super::stage_expert_layers(cfg, l, s))
        .max()
        .unwrap_or(0) as f64;
    let tokens = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let places = balanced_places(cfg, l, tokens);
    let act = input.precision.weights.bytes();
    let bytes = expert_all_to_all_bytes(cfg, l, act, layers, (layers * places, layers * places));
    let eff = input.cluster.calibration.link_efficiency;
    // Two all-to-alls each way per block with experts, each ep − 1 messages; spread over the
    // stage's blocks (the actions price a block on average).
    let one_way = bytes / 2.0;
    let blocks = super::stage_layers(cfg, l, 0).max(1) as f64;
    let time = ring_time(one_way, 2 * (l.ep - 1) * layers as usize, link, eff) / blocks;
    ExpertCosts {
        bytes_per_micro_batch: bytes,
        per_layer: time,
    }
}

/// Context parallelism's communication per layer and micro-batch on one device: exposed time in
/// the forward and the backward, and bytes sent.
struct ContextCosts {
    forward: f64,
    backward: f64,
    bytes_per_layer: f64,
}

/// The ring sends its K/V block on before attending to the one in hand, so each of its cp − 1
/// transfers hides behind a block's products (a cp-th of the device's attention) and only the
/// excess shows; backward sends the K/V blocks again and, after each block, its dK/dV (cp of
/// them), hidden behind a cp-th of attention's backward. Messages are f32. All-to-all
/// (Ulysses) cannot overlap: Q, K, V out and the output back in the forward; Q, K, V, the output
/// and its gradient out and dQ, dK, dV back in the backward, each moving (cp − 1)/cp of the
/// device's tensors.
fn context_costs(input: &PlanInput, cfg: &ModelConfig, l: &Layout, link: &Link) -> ContextCosts {
    if l.cp <= 1 {
        return ContextCosts {
            forward: 0.0,
            backward: 0.0,
            bytes_per_layer: 0.0,
        };
    }
    let n = l.cp as f64;
    let eff = input.cluster.calibration.link_efficiency;
    let tok = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let w = cfg.attention_widths(l.tp);
    let send = |bytes: f64| bytes / (link.bandwidth_bytes_per_s * eff) + link.latency_s;
    let recomputes = if l.recompute == Recompute::Full {
        1.0
    } else {
        0.0
    };
    match l.cp_comm {
        crate::layout::CpComm::Ring => {
            let block = 4.0 * tok * (w.k + w.v);
            let attention = attention_time(input, cfg, l);
            let fwd_step = attention / n;
            // Flash backward: five products to the forward's two.
            let bwd_step = 2.5 * attention / n;
            let exposed = |transfer: f64, compute: f64| (transfer - compute).max(0.0);
            let forward = (n - 1.0) * exposed(send(block), fwd_step);
            let backward = (n - 1.0) * exposed(send(block) + send(block), bwd_step)
                + send(block)
                + recomputes * forward;
            ContextCosts {
                forward,
                backward,
                bytes_per_layer: block * ((n - 1.0) * (2.0 + recomputes) + n),
            }
        }
        crate::layout::CpComm::A2a => {
            let share = (n - 1.0) / n * 4.0 * tok;
            let forward_bytes = share * (w.q + w.k + w.v + w.out);
            let backward_bytes = 2.0 * forward_bytes;
            let forward = send(forward_bytes);
            ContextCosts {
                forward,
                backward: send(backward_bytes) + recomputes * forward,
                bytes_per_layer: forward_bytes * (1.0 + recomputes) + backward_bytes,
            }
        }
    }
}

/// Attention's forward products of one layer on one device for one micro-batch: its queries (seq /
/// cp of each sequence) against the whole sequence, counted as the model FLOPs count them (the
/// causal mask's half is in the calibrated attention efficiency).
fn attention_time(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> f64 {
    let c = &input.cluster;
    let tokens = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    tokens * input.seq as f64 * cfg.attention_score_flops_per_key()
        / l.tp as f64
        / (c.peak_flops * c.calibration.attention_efficiency)
}

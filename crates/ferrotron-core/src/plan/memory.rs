//! Bytes per device, per term, per pipeline stage.

use super::spec::{ActivationModel, AttentionKernel, PlanModel};
use super::{MemoryTerms, PlanInput};
use crate::layout::{CpComm, Layout, Recompute};
use crate::model::{is_projection_weight, Arch, LoraConfig, LoraTarget, ModelConfig, TargetSplit};

/// Parameters one device of stage `stage` holds before any ZeRO sharding: its layers' share under
/// tensor parallelism (sharded matrices / tp, replicated norms and row-parallel biases whole), plus the
/// vocab-parallel embedding on the first stage and the final norm and output layer on the last.
pub fn params_on_device(cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    let h = cfg.hidden_size as f64;
    let layer = layer_params_on_device(cfg, l);
    let layers_here = super::stage_layers(cfg, l, stage) as f64;
    let vocab = padded_vocab(cfg, l.tp) as f64;
    let t = l.tp as f64;
    let mut n = layer * layers_here;
    if stage == 0 {
        n += vocab * h / t;
        if cfg.arch == Arch::Gpt2 {
            n += cfg.max_position_embeddings as f64 * h;
        }
    }
    if stage == l.pp - 1 {
        n += if cfg.arch == Arch::Gpt2 { 2.0 * h } else { h };
        // An untied head, or the tied embedding's copy on the last stage when it is not the first.
        if !cfg.tie_word_embeddings || l.pp > 1 {
            n += vocab * h / t;
        }
    }
    n
}

/// The largest group of parameters the engine handles at once on a device of `stage` (a block, the
/// embedding, or the final norm with the output layer): the size of its gradient buckets and of a
/// ZeRO-3 gathered unit.
pub fn largest_unit_params(cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    let (h, t) = (cfg.hidden_size as f64, l.tp as f64);
    let vocab = padded_vocab(cfg, l.tp) as f64;
    let mut largest = layer_params_on_device(cfg, l);
    if stage == 0 {
        let wpe = if cfg.arch == Arch::Gpt2 {
            cfg.max_position_embeddings as f64 * h
        } else {
            0.0
        };
        largest = largest.max(vocab * h / t + wpe);
    }
    if stage == l.pp - 1 {
        largest = largest.max(vocab * h / t + 2.0 * h);
    }
    largest
}

/// One block's parameters on one device under tensor parallelism.
fn layer_params_on_device(cfg: &ModelConfig, l: &Layout) -> f64 {
    let (h, f, t) = (
        cfg.hidden_size as f64,
        cfg.intermediate_size as f64,
        l.tp as f64,
    );
    // A mixture of experts: this device's share of the routed experts (and of their columns under
    // tensor parallelism), the router (whole on every device) and its share of the shared expert
    // in its blocks, the dense MLP in the others (a block on average).
    let mlp = match &cfg.moe {
        Some(m) => {
            let layers = cfg.num_layers.max(1) as f64;
            let sparse = m.expert_layers(cfg.num_layers) as f64;
            let rest = m.num_experts as f64 * h
                + 3.0 * h * m.shared_expert_size as f64 / t
                + if cfg.has_shared_expert_gate() { h } else { 0.0 };
            routed_expert_params(cfg, l)
                + (sparse * rest + (layers - sparse) * 3.0 * h * f / t) / layers
        }
        None => 3.0 * h * f / t,
    };
    match cfg.arch {
        Arch::Llama => attention_params_on_device(cfg, t) + mlp + 2.0 * h,
        Arch::Gpt2 => {
            (3.0 * h * h + 3.0 * h) / t + h * h / t + h + (h * f + f) / t + f * h / t + h + 4.0 * h
        }
    }
}

/// One block's attention parameters on one device of a tensor-parallel group of `t`: its heads' q,
/// k, v and o projections (KV heads fewer than the devices replicated); under latent attention the
/// down-projections and their norms whole (as Megatron-Core's MLA keeps them) and the
/// up-projections and o by heads.
fn attention_params_on_device(cfg: &ModelConfig, t: f64) -> f64 {
    let h = cfg.hidden_size as f64;
    match cfg.latent_attention {
        Some(a) => {
            let q_down = a.q_lora_rank.map_or(0.0, |r| h * r as f64);
            let kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim) as f64;
            let norms = (a.q_lora_rank.unwrap_or(0) + a.kv_lora_rank) as f64;
            let by_heads = cfg.attention_matmul_params() - q_down - kv_down;
            q_down + kv_down + norms + by_heads / t
        }
        None => {
            let kv_per_dev = (cfg.num_kv_heads as f64 / t).max(1.0);
            2.0 * h * cfg.q_dim() as f64 / t + 2.0 * h * cfg.head_dim as f64 * kv_per_dev
        }
    }
}

/// One block's routed-expert parameters on a device (a block on average): its `num_experts / ep`
/// experts' MLPs (their columns / tp) in the blocks with experts, or under `etp=1` its
/// `num_experts / (tp·ep)` experts whole. ZeRO shards them over the dp·cp / ep replicas that hold
/// the same experts, where it shards the rest over all dp·cp.
pub fn routed_expert_params(cfg: &ModelConfig, l: &Layout) -> f64 {
    match &cfg.moe {
        Some(m) => {
            let share = m.expert_layers(cfg.num_layers) as f64 / cfg.num_layers.max(1) as f64;
            let blocks = l.expert_blocks();
            let per_device = (m.num_experts / (l.ep.max(1) * blocks)) as f64;
            let column_split = (l.tp.max(1) / blocks) as f64;
            share * per_device * 3.0 * cfg.hidden_size as f64 * m.expert_size as f64 / column_split
        }
        None => 0.0,
    }
}

/// The vocabulary padded so that it splits evenly over the tensor-parallel group.
pub fn padded_vocab(cfg: &ModelConfig, tp: usize) -> usize {
    cfg.vocab_size.div_ceil(tp) * tp
}

/// Activation bytes one layer stashes for one micro-batch, on one device.
pub fn layer_activation_bytes(
    cfg: &ModelConfig,
    l: &Layout,
    seq: usize,
    (model, attention): (ActivationModel, AttentionKernel),
    act_bytes: f64,
) -> f64 {
    let materialized = attention == AttentionKernel::Materialized;
    // Context parallelism: each device holds seq / cp tokens of every sequence (`s` below), whose
    // queries attend to the whole sequence (`span`).
    let span = seq as f64;
    let seq = seq / l.cp.max(1);
    let (b, s, h, t) = (
        l.micro_batch_size as f64,
        seq as f64,
        cfg.hidden_size as f64,
        l.tp as f64,
    );
    let heads = cfg.num_heads as f64;
    let sp = l.sequence_parallel && l.tp > 1;
    match model {
        ActivationModel::Megatron => {
            // Korthikanti et al. 2022, bytes with 16-bit activations.
            let sbh = s * b * h;
            // The softmax's input, output and dropout mask: 5as/h per token and hidden unit, with
            // materialised attention only.
            let attn = if materialized {
                5.0 * heads * span / (h * t)
            } else {
                0.0
            };
            match (l.recompute, sp, l.tp > 1) {
                (Recompute::Full, true, _) => 2.0 * sbh / t,
                (Recompute::Full, false, _) => 2.0 * sbh,
                (Recompute::Selective, true, _) => sbh * 34.0 / t,
                (Recompute::Selective, false, _) => sbh * (10.0 + 24.0 / t),
                (Recompute::None, true, _) => sbh * (34.0 / t + attn),
                (Recompute::None, false, true) => sbh * (10.0 + 24.0 / t + attn),
                (Recompute::None, false, false) => sbh * (34.0 + attn),
            }
        }
        ActivationModel::Ferrotron => {
            let tok = b * s;
            let hidden_sized = if sp { tok * h / t } else { tok * h };
            let stats =
                if sp { tok / t } else { tok } * if cfg.arch == Arch::Gpt2 { 2.0 } else { 1.0 };
            if l.recompute == Recompute::Full {
                return hidden_sized * act_bytes; // the layer input only
            }
            let w = cfg.attention_widths(l.tp);
            let f = cfg.intermediate_size as f64 / t;
            // Materialised attention keeps each head's T×T probabilities (dropped under selective
            // recompute); the memory-efficient kernel keeps one f32 log-sum-exp per query and head.
            let (probs, lse_bytes) = match (materialized, l.recompute) {
                (true, Recompute::Selective) => (0.0, 0.0),
                (true, _) => (b * (heads / t) * s * span, 0.0),
                (false, _) => (0.0, b * (heads / t) * s * 4.0),
            };
            // The MLP's pre-activations and activation; a mixture of experts keeps them for each
            // of a token's top_k places, with each place's input row (as its expert's device
            // received it) and its expert's output (the routing weight's gradient), beside the
            // router's f32 probabilities and each place's expert, weight and row (32 bytes).
            let (mlp, router_bytes) = match (cfg.arch, &cfg.moe) {
                (Arch::Llama, Some(m)) => {
                    // A block on average: the blocks with experts, the dense ones.
                    // Under etp=1 a device keeps its block's places only, their experts whole.
                    let blocks = l.expert_blocks() as f64;
                    let (k, fe) = (m.top_k as f64, m.expert_size as f64);
                    let share =
                        m.expert_layers(cfg.num_layers) as f64 / cfg.num_layers.max(1) as f64;
                    let sparse = k * tok / blocks * (3.0 * fe * blocks / t + 2.0 * h)
                        + tok * (3.0 * m.shared_expert_size as f64 / t + h + 1.0);
                    let router = tok * (4.0 * m.num_experts as f64 + 32.0 * k);
                    (
                        share * sparse + (1.0 - share) * 3.0 * tok * f,
                        share * router,
                    )
                }
                (Arch::Llama, None) => (3.0 * tok * f, 0.0),
                (Arch::Gpt2, _) => (2.0 * tok * f, 0.0),
            };
            // x_in, norm1 out + stats, q, k, v (latent attention's latents), probs or
            // log-sum-exp, attention out, x_mid, norm2 out + stats, MLP.
            let attention = w.q + w.k + w.v + w.out + w.latent;
            let elems = 4.0 * hidden_sized + 2.0 * stats + tok * attention + probs + mlp;
            elems * act_bytes + lse_bytes + router_bytes
        }
    }
}

/// One layer's full stash: what a fully recomputed layer holds while its backward runs.
fn recompute_working_set(
    cfg: &ModelConfig,
    l: &Layout,
    seq: usize,
    model: (ActivationModel, AttentionKernel),
    act_bytes: f64,
) -> f64 {
    let none = Layout {
        recompute: Recompute::None,
        ..*l
    };
    layer_activation_bytes(cfg, &none, seq, model, act_bytes)
}

/// The gradient buffers one block's backward holds at once on one device (f32, the executor's
/// compute precision), beyond the stash, the larger of its two halves: the MLP's (the input
/// projections' output gradients and the norm output's gradient, whole rows before their
/// reduction; the activation's gradient takes the place of the stashed activation, freed once its
/// weight gradient is formed) and attention's, which runs after the activation is gone (the
/// output's gradient, q, k and v's; under selective recompute of materialised attention the
/// recomputed probabilities; then the memory-efficient kernel's scratch and context parallelism's
/// blocks, see [`attention_kernel_scratch`] and [`context_buffers`], or once they are gone the
/// norm output's gradient).
fn backward_working_set(
    cfg: &ModelConfig,
    l: &Layout,
    seq: usize,
    attention: AttentionKernel,
    act_bytes: f64,
) -> f64 {
    let t = l.tp as f64;
    let local = seq / l.cp.max(1);
    let tok = (l.micro_batch_size * local) as f64;
    let (h, f) = (cfg.hidden_size as f64, cfg.intermediate_size as f64 / t);
    let w = cfg.attention_widths(l.tp);
    let qkvo = w.q + w.k + w.v + w.out;
    let mlp = match cfg.arch {
        Arch::Llama => tok * (3.0 * f + h),
        Arch::Gpt2 => tok * (2.0 * f + h),
    };
    // The stashed activation (in the activation storage) is freed as its gradient forms, before
    // attention's half starts (a dense block's; experts keep theirs in their own stash).
    let freed = tok * f * act_bytes;
    let freed_before_attention = if cfg.moe.is_none() { freed } else { 0.0 };
    let flash = attention == AttentionKernel::Flash;
    let probs = if l.recompute == Recompute::Selective && !flash {
        l.micro_batch_size as f64 * (cfg.num_heads as f64 / t) * (local * seq) as f64
    } else {
        0.0
    };
    let attention = tok * qkvo + probs;
    // A 16-bit stash is widened to f32 as each backward half reads it: the MLP's pre-activations
    // and its norm's output; attention's output, q, k and v (kept in f32 they are read in place).
    let (mlp_widened, attention_widened) = if act_bytes < 4.0 {
        let pre = match cfg.arch {
            Arch::Llama => 2.0 * f,
            Arch::Gpt2 => f,
        };
        (tok * (pre + h), tok * qkvo)
    } else {
        (0.0, 0.0)
    };
    let kernel = if flash {
        attention_kernel_scratch(cfg, l, local)
    } else {
        0.0
    };
    // The kernel's scratch and context parallelism's blocks live while attention's gradients
    // form; the norm output's gradient only after.
    let during_kernel = kernel + context_buffers(cfg, l, local);
    let attention_half = 4.0 * (attention + attention_widened) + during_kernel.max(4.0 * tok * h);
    (4.0 * (mlp + mlp_widened) - freed).max(attention_half - freed_before_attention)
}

/// The memory-efficient kernel's f32 scratch for the largest block it is given: on its thread a
/// tile of probabilities and one of their gradients (256 queries × 512 keys at most, rows padded
/// by 16), each query row's log-sum-exp, and the products' right operands packed in panels of 16
/// columns: its KV head's Kᵀ, Vᵀ and K, and a row tile's Q and dO; and D = rowsum(dO ⊙ O) of every
/// query row of every sequence and head of the device. The block is the device's
/// whole sequence without context parallelism; the ring's load-balanced blocks are chunks (half a
/// device's tokens); all-to-all's attention sees whole sequences. Not priced: on a CPU with
/// AVX512_BF16, bf16 products' left operands packed before their products (a row tile's Q and dO,
/// a tile's P, dS, Pᵀ, dSᵀ in bf16: under 1 MB a kernel thread at 256 × 512 tiles), which other
/// CPUs do not allocate; the planner does not know the CPU. The engine files them under `other`,
/// the kernels' workspace, with the bf16 GEMM's other packing buffers.
fn attention_kernel_scratch(cfg: &ModelConfig, l: &Layout, local: usize) -> f64 {
    let keys = match (l.cp > 1, l.cp_comm) {
        (false, _) => local,
        (true, CpComm::Ring) => (local / 2).max(1),
        (true, CpComm::A2a) => local * l.cp,
    };
    let (br, bc) = (keys.min(256) as f64, keys.min(512) as f64);
    let panels = |n: usize| n.div_ceil(16) as f64 * 16.0;
    let (d, d16, keys16) = (cfg.head_dim as f64, panels(cfg.head_dim), panels(keys));
    let operands = 2.0 * keys16 * d + keys as f64 * d16 + 2.0 * br * d16;
    // All-to-all gives a device whole sequences of its share of the heads.
    let heads = match (l.cp > 1, l.cp_comm) {
        (true, CpComm::A2a) => cfg.num_heads / (l.tp * l.cp),
        _ => cfg.num_heads / l.tp,
    };
    let deltas = (l.micro_batch_size * heads.max(1) * keys) as f64;
    4.0 * (2.0 * br * (bc + 16.0) + keys as f64 + operands + deltas)
}

/// Context parallelism's f32 working buffers on one device for `local` tokens per sequence, beside
/// attention's backward: the ring's K/V block in hand, the dK/dV it adds to and the one passing
/// through; all-to-all's head-split Q, K, V, output, output gradient and the three input
/// gradients, over whole sequences (a device's KV heads at least one: replicated where there are
/// fewer than the group). (The messages themselves are the link's: see [`comm_buffers`].)
fn context_buffers(cfg: &ModelConfig, l: &Layout, local: usize) -> f64 {
    if l.cp <= 1 {
        return 0.0;
    }
    let tok = (l.micro_batch_size * local) as f64;
    let w = cfg.attention_widths(l.tp);
    let working = match l.cp_comm {
        CpComm::Ring => 3.0 * (w.k + w.v),
        CpComm::A2a => {
            let one_head = (l.cp * cfg.head_dim) as f64;
            let (k, v) = (w.k.max(one_head), w.v.max(one_head));
            2.0 * (w.q + k + v + w.out)
        }
    };
    4.0 * tok * working
}

/// One layer's stash for one micro-batch on one device, and the layers of this stage's largest
/// chunk (its chunks are equal unless the split is uneven).
fn layer_stash_and_chunk(
    input: &PlanInput,
    cfg: &ModelConfig,
    l: &Layout,
    stage: usize,
) -> (f64, f64) {
    let per_layer = layer_activation_bytes(
        cfg,
        l,
        input.seq,
        (input.activation_model, input.attention),
        input.precision.weights.bytes(),
    );
    let layers = super::chunk_layers(cfg, l)
        .iter()
        .copied()
        .skip(stage)
        .step_by(l.pp.max(1))
        .max()
        .unwrap_or(0) as f64;
    (per_layer, layers)
}

/// The engine's working set on top of the stash while a block's backward runs: its gradients, the
/// boundary tensors coming and going, and context parallelism's blocks in flight.
fn block_working_set(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> f64 {
    let act_bytes = input.precision.weights.bytes();
    let local = super::local_seq(input, l);
    let boundary = (l.micro_batch_size * local * cfg.hidden_size) as f64 * act_bytes;
    backward_working_set(cfg, l, input.seq, input.attention, act_bytes) + 2.0 * boundary
}

/// The activations one device of `stage` stashes for backward at its peak, holding `in_flight`
/// chunk stashes: its layers' stashes, a fully recomputed layer's working set, and on the last stage
/// the final norm's tensors and the f32 logits of the micro-batch in flight for the loss.
pub fn stage_activation_stash(
    input: &PlanInput,
    l: &Layout,
    stage: usize,
    in_flight: usize,
) -> f64 {
    let PlanModel::Shape(cfg) = &input.model else {
        return 0.0;
    };
    let act_bytes = input.precision.weights.bytes();
    let (per_layer, layers_per_chunk) = layer_stash_and_chunk(input, cfg, l, stage);
    let mut act = per_layer * layers_per_chunk * in_flight as f64;
    if l.recompute == Recompute::Full {
        act += recompute_working_set(
            cfg,
            l,
            input.seq,
            (input.activation_model, input.attention),
            act_bytes,
        );
    }
    act += head_stash(input, cfg, l, stage);
    act
}

/// What the last stage keeps for its head's backward: the final norm's input and output and the
/// f32 logits of the micro-batch in flight for the loss (nothing on other stages).
fn head_stash(input: &PlanInput, cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    let act_bytes = input.precision.weights.bytes();
    if stage + 1 != l.pp {
        return 0.0;
    }
    let tok = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let stats = if cfg.arch == Arch::Gpt2 {
        2.0 * tok
    } else {
        tok
    };
    // Under sequence parallelism the final norm runs on this device's rows.
    let rows_here = if l.sequence_parallel && l.tp > 1 {
        l.tp as f64
    } else {
        1.0
    };
    let norm = (2.0 * tok * cfg.hidden_size as f64 + stats) * act_bytes / rows_here;
    norm + 4.0 * tok * padded_vocab(cfg, l.tp) as f64 / l.tp as f64
}

/// The communication buffers of one device of `stage` holding `params` parameters (`trainable` of
/// them trained), with hidden-state messages of `boundary` bytes.
fn comm_buffers(
    input: &PlanInput,
    cfg: &ModelConfig,
    l: &Layout,
    stage: usize,
    (params, trainable): (f64, f64),
    boundary: f64,
) -> f64 {
    let pr = &input.precision;
    let replicas = l.replicas();
    if input.activation_model == ActivationModel::Ferrotron {
        engine_comm_buffers(input, cfg, l, stage, boundary)
    } else {
        // Megatron/DeepSpeed: a TP collective's output, a 25M-element DP gradient bucket,
        // and under ZeRO-3 one layer's gathered parameters (twice, to prefetch the next).
        let tp_buf = if l.tp > 1 { boundary } else { 0.0 };
        let dp_buf = if replicas > 1 {
            (25e6f64).min(trainable) * pr.grads.bytes()
        } else {
            0.0
        };
        let z3_buf = if l.zero == 3 && replicas > 1 {
            2.0 * params / super::stage_layers(cfg, l, stage).max(1) as f64 * pr.weights.bytes()
        } else {
            0.0
        };
        tp_buf + dp_buf + z3_buf
    }
}

/// The engine's communication buffers on one device of `stage`: what its collectives allocate
/// beside the tensors they move, at the worst moment of a step. Messages are not among them: in
/// flight they are the link's (`memory::on_the_link` in the engine; a GPU's collective library
/// stages through fixed buffers of its own). Per unit of `reduced` gradients R and gathered
/// parameters P (one block's, the largest on the device; with LoRA one layer's adapters), over n
/// replicas, f32 (parameters and gradients their own format):
/// - ZeRO-0: the bucket being all-reduced, R (it is reduced in place);
/// - ZeRO-1: the interleaved bucket and this replica's piece of it, R(1 + 1/n); after the update,
///   a unit's pieces and their gather, P(1 + 1/n);
/// - ZeRO-2: the unit's whole gradients, their interleaved copy and this replica's piece,
///   R(2 + 1/n);
/// - ZeRO-3: that, beside the unit prefetched next (P), or the unit in use and the one prefetched
///   beside the gradients and a piece (2P + R(1 + 1/n)), or, forward, 2P + P/n.
///
/// In 16 bits (mixed precision) nothing is bucketed: ZeRO-0 all-reduces each gradient in place;
/// ZeRO-1 reduce-scatters and re-gathers one tensor T at a time, T(1 + 1/n); ZeRO-2/3 reduce-
/// scatter a unit's gradients as the backward finishes it, R(1 + 1/n), ZeRO-2 re-gathers the
/// updated weights a tensor at a time (T(1 + 1/n)), and ZeRO-3 gathers a unit's weights,
/// P(2 + 1/n) with the pieces and the gathered copy. Beside all of these stays the blocking
/// reduce-scatter's working copy, as large as its largest input: sequence parallelism's rows (a
/// boundary) and the 16-bit gradients' (T or R).
fn engine_comm_buffers(
    input: &PlanInput,
    cfg: &ModelConfig,
    l: &Layout,
    stage: usize,
    boundary: f64,
) -> f64 {
    let pr = &input.precision;
    let (g, w) = (pr.grads.bytes(), pr.weights.bytes());
    let half = w < 4.0;
    // What one unit's reductions and gathers move: its trainable parameters (with LoRA one
    // layer's adapters; the frozen base never moves).
    let lora_unit = input
        .lora
        .as_ref()
        .map(|lora| largest_lora_layer_on_device(cfg, lora, l));
    let unit = match lora_unit {
        Some((dense, experts)) => dense + experts,
        None => largest_unit_params(cfg, l, stage),
    };
    // Under expert parallelism a unit's dense and routed-expert tensors reduce over different
    // groups, one set after the other (see `grouped_f32_buffers`); in 16 bits, and for the
    // largest tensor, the larger set bounds them.
    let reduced = match lora_unit {
        _ if l.ep == 1 => unit,
        None => {
            let experts = routed_expert_params(cfg, l).min(unit);
            experts.max(unit - experts)
        }
        Some((dense, experts)) => dense.max(experts),
    };
    let n = l.replicas() as f64;
    let (r, p) = (reduced * g, unit * w);
    // The largest single tensor reduced in 16 bits under ZeRO-1 (a LoRA unit's adapters are small:
    // their unit bounds it).
    let tensor = match lora_unit {
        Some(_) => reduced,
        None => largest_tensor_params(cfg, l, stage).min(unit),
    };
    let grouped = l.ep > 1 && cfg.moe.is_some() && lora_unit.is_none();
    let data_parallel = match (l.replicas() > 1, l.zero, half) {
        (false, _, _) => 0.0,
        (true, _, false) if grouped => {
            // A block's dense tensors, then its experts; the embedding and the output layer are
            // dense alone.
            let experts = routed_expert_params(cfg, l);
            let block = layer_params_on_device(cfg, l);
            let table = if stage == 0 || stage + 1 == l.pp {
                padded_vocab(cfg, l.tp) as f64 * cfg.hidden_size as f64 / l.tp as f64
            } else {
                0.0
            };
            let holders = expert_holders(l) as f64;
            let sets = |dense: f64, experts: f64| [(dense, n), (experts, holders)];
            grouped_f32_buffers(&sets(block - experts, experts), l.zero, (g, w))
                .max(grouped_f32_buffers(&sets(table, 0.0), l.zero, (g, w)))
        }
        (true, 0, false) => r,
        (true, 1, false) => r.max(p) * (1.0 + 1.0 / n),
        (true, 2, false) => r * (2.0 + 1.0 / n),
        // ZeRO-3 prefetches the next unit: the unit's gradients, their interleaved copy and a
        // piece beside the next unit; the unit in use and the one prefetched (its gather, filed
        // into tensors) beside the gradients and a piece; forward, a unit in use, the next one
        // gathering and this replica's pieces of it.
        (true, _, false) => (r * (2.0 + 1.0 / n) + p)
            .max(2.0 * p + r * (1.0 + 1.0 / n))
            .max(p * (2.0 + 1.0 / n)),
        (true, 0, true) => 0.0,
        (true, 1, true) => tensor * g.max(w) * (1.0 + 1.0 / n),
        (true, 2, true) => (r * (1.0 + 1.0 / n)).max(tensor * w * (1.0 + 1.0 / n)),
        (true, _, true) => (r * (1.0 + 1.0 / n)).max(p * (2.0 + 1.0 / n)),
    };
    let sp_rows = if l.tp > 1 && l.sequence_parallel {
        boundary
    } else {
        0.0
    };
    let half_grads = match (l.replicas() > 1 && half, l.zero) {
        (true, 1) => tensor * g,
        (true, 2..) => r,
        _ => 0.0,
    };
    data_parallel + sp_rows.max(half_grads) + gathered_codes(input, cfg, l)
}

/// The f32 buffers of a unit whose tensors form `sets` (elements, replicas they reduce over),
/// reduced and gathered one set after the other, each set's collectives completed before the
/// next's start (no prefetch), under ZeRO `zero`, `(g, w)` bytes per gradient and weight:
/// - ZeRO-0: one set's bucket at a time; ZeRO-1: its interleaved bucket and piece, or after the
///   update its pieces and their gather;
/// - ZeRO-2: opening, every set's gradients; closing set i, the sets after it still open beside
///   its gradients, their interleaved copy and a piece;
/// - ZeRO-3: opening set i, the sets before it (parameters and gradients) beside its gather (this
///   replica's pieces, the gathered block, the tensors filed from it); closing as ZeRO-2, the later
///   sets' parameters open too.
fn grouped_f32_buffers(sets: &[(f64, f64)], zero: u8, (g, w): (f64, f64)) -> f64 {
    // A set held by one replica alone (experts no other replica holds) is never reduced, nor
    // opened per unit.
    let open = |&(x, n): &(f64, f64)| {
        if n > 1.0 {
            x * (g + if zero == 3 { w } else { 0.0 })
        } else {
            0.0
        }
    };
    let mut worst: f64 = 0.0;
    for (i, &(x, n)) in sets.iter().enumerate().filter(|(_, s)| s.1 > 1.0) {
        let (r, p) = (x * g, x * w);
        let before: f64 = sets[..i].iter().map(open).sum();
        let after: f64 = sets[i + 1..].iter().map(open).sum();
        let here = match zero {
            0 => r,
            1 => r.max(p) * (1.0 + 1.0 / n),
            2 => (before + r).max(after + r * (2.0 + 1.0 / n)),
            _ => (before + p * (2.0 + 1.0 / n)).max(after + r * (2.0 + 1.0 / n)),
        };
        worst = worst.max(here);
    }
    worst
}

/// The largest tensor one device of `stage` holds (elements): a block's widest projection (its
/// attention's, its MLP's or an expert's), the embedding table (first stage) or the output layer
/// (last). From the shape alone: the search prices thousands of layouts.
fn largest_tensor_params(cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    let (h, t) = (cfg.hidden_size as f64, l.tp as f64);
    let w = cfg.attention_widths(l.tp);
    let experts = cfg
        .moe
        .as_ref()
        .map_or(0.0, |m| m.expert_size.max(m.shared_expert_size) as f64 / t);
    let widest = [
        w.q,
        w.k,
        w.v,
        w.out,
        cfg.intermediate_size as f64 / t,
        experts,
    ]
    .into_iter()
    .fold(0.0, f64::max);
    let mut largest = h * widest;
    if stage == 0 || stage + 1 == l.pp {
        largest = largest.max(padded_vocab(cfg, l.tp) as f64 * h / t);
    }
    largest
}

/// What one layer's deferred weight-gradient jobs keep for one micro-batch on one device, in bytes
/// (a split backward's input-gradient half frees the layer's stash and leaves, for the weight-
/// gradient half, a copy of each linear's input and output gradient and of each norm's). Always f32,
/// the executor's compute precision.
fn layer_weight_job_bytes(cfg: &ModelConfig, l: &Layout, seq: usize) -> f64 {
    let t = l.tp as f64;
    let tok = (l.micro_batch_size * seq / l.cp.max(1)) as f64;
    let h = cfg.hidden_size as f64;
    let f = cfg.intermediate_size as f64 / t;
    let w = cfg.attention_widths(l.tp);
    // Each linear's input (whole rows) and output gradient.
    let linears = match cfg.arch {
        // q, k, v and gate, up read the norms' outputs; o the attention's; down the activation.
        Arch::Llama => (5.0 * h + w.out + f) + (w.q + w.k + w.v + 2.0 * h + 2.0 * f),
        // The fused qkv and fc read the norms' outputs; proj the activation.
        Arch::Gpt2 => (2.0 * h + w.out + f) + (3.0 * w.q + 2.0 * h + f),
    };
    // Two norms, each its input and output gradient, on this device's rows.
    let rows_here = if l.sequence_parallel && l.tp > 1 {
        t
    } else {
        1.0
    };
    4.0 * tok * (linears + 4.0 * h / rows_here)
}

/// The head's deferred weight-gradient jobs on the last stage: the output layer's input and logits'
/// gradient, the final norm's input and output gradient (f32).
fn head_weight_job_bytes(input: &PlanInput, cfg: &ModelConfig, l: &Layout, stage: usize) -> f64 {
    if stage + 1 != l.pp {
        return 0.0;
    }
    let tok = (l.micro_batch_size * super::local_seq(input, l)) as f64;
    let h = cfg.hidden_size as f64;
    4.0 * tok * (3.0 * h + padded_vocab(cfg, l.tp) as f64 / l.tp as f64)
}

/// Activations of one device of `stage` under a split backward (ZB-H1), at the worst of the states
/// the simulation saw it in (`held`): each stash of a chunk (with its head on the last stage) and
/// each chunk's deferred weight-gradient jobs; while an input gradient runs, one more chunk's jobs
/// beside the last layer's stash it is still reading and a block's backward working set. None when
/// the backward is joint, or the activation model is another engine's.
pub fn split_backward_activations(
    input: &PlanInput,
    l: &Layout,
    stage: usize,
    held: &[crate::schedule::Held],
) -> Option<f64> {
    let PlanModel::Shape(cfg) = &input.model else {
        return None;
    };
    if held.is_empty() || input.activation_model != ActivationModel::Ferrotron {
        return None;
    }
    let (per_layer, layers) = layer_stash_and_chunk(input, cfg, l, stage);
    let stash = per_layer * layers + head_stash(input, cfg, l, stage);
    let jobs = layer_weight_job_bytes(cfg, l, input.seq) * layers
        + head_weight_job_bytes(input, cfg, l, stage);
    let working = block_working_set(input, cfg, l);
    let worst = held
        .iter()
        .map(|h| {
            let (a, b) = (h.stashes as f64, h.weight_jobs as f64);
            if h.converting {
                (a - 1.0) * stash + (b + 1.0) * jobs + per_layer + working
            } else {
                a * stash + b * jobs
            }
        })
        .fold(0.0, f64::max);
    Some(worst)
}

/// The host memory an asynchronous checkpoint holds for one device of `stage` while it is written:
/// the copy of what the device saves — the f32 master values and both f32 Adam moments of the
/// elements it owns (after ZeRO-1, its piece).
pub fn checkpoint_snapshot_bytes(input: &PlanInput, l: &Layout, stage: usize) -> u64 {
    let trainable = match &input.model {
        PlanModel::ParamsOnly(p) => p / (l.tp * l.pp) as f64,
        PlanModel::Shape(cfg) => match &input.lora {
            Some(lora) => lora_params_on_device(cfg, lora, l, stage),
            None => params_on_device(cfg, l, stage),
        },
    };
    let owned = if l.zero >= 1 {
        trainable / l.replicas() as f64
    } else {
        trainable
    };
    (12.0 * owned) as u64
}

/// Memory of one device of `stage`, holding `in_flight` chunk stashes at its peak.
pub fn stage_memory(input: &PlanInput, l: &Layout, stage: usize, in_flight: usize) -> MemoryTerms {
    let pr = &input.precision;
    // ZeRO shards over every replica of a shard: dp × cp devices.
    let replicas = l.replicas();
    let dp = replicas as f64;
    let (params, trainable, activations, head_extra, comm) = match &input.model {
        PlanModel::ParamsOnly(p) => (
            p / (l.tp * l.pp) as f64,
            p / (l.tp * l.pp) as f64,
            0.0,
            0.0,
            0.0,
        ),
        PlanModel::Shape(cfg) => {
            let params = params_on_device(cfg, l, stage);
            let trainable = match &input.lora {
                // LoRA: the adapters train, the base is frozen.
                Some(lora) => lora_params_on_device(cfg, lora, l, stage),
                None => params,
            };
            let act_bytes = pr.weights.bytes();
            let stash = stage_activation_stash(input, l, stage, in_flight);
            let ferrotron = input.activation_model == ActivationModel::Ferrotron;
            let local = super::local_seq(input, l);
            let boundary = (l.micro_batch_size * local * cfg.hidden_size) as f64 * act_bytes;
            // The engine's working set on top of the stash: a block's backward gradients, the
            // boundary tensors coming and going, and context parallelism's blocks in flight.
            let working = if ferrotron {
                let block = block_working_set(input, cfg, l);
                // The last stage's heads: each micro-batch between the end of its forward and the
                // start of its backward holds its head's tensors (the final norm's, the logits). A
                // head's backward frees them before its first block's backward starts, so the
                // peak holds every head in flight (one with its backward's gradients), or all but
                // one beside a block's backward. GPipe
                // turns with every micro-batch in flight; the others run each micro-batch's
                // backward right after its forward on the last stage: one head. (The stash
                // counts one head already.)
                let head = head_stash(input, cfg, l, stage);
                let heads = if l.schedule == crate::layout::Schedule::Gpipe {
                    in_flight.max(1)
                } else {
                    1
                } as f64;
                // The head's backward adds its gradients to its tensors: the final norm's output
                // gradient (whole rows, before the reduction) and its input gradient (this
                // device's rows), in f32.
                let head_backward = if head > 0.0 {
                    let rows = (l.micro_batch_size * local) as f64;
                    let here = if l.sequence_parallel && l.tp > 1 {
                        rows / l.tp as f64
                    } else {
                        rows
                    };
                    4.0 * (rows + here) * cfg.hidden_size as f64
                } else {
                    0.0
                };
                (heads - 1.0) * head + head_backward.max(block - head)
            } else {
                0.0
            };
            let comm = comm_buffers(input, cfg, l, stage, (params, trainable), boundary);
            (params, trainable, stash, working, comm)
        }
    };
    let z = l.zero;
    // ZeRO from `stage_min` shards what trains over the replicas; under expert parallelism a
    // routed expert only over those holding it (dp·cp / ep).
    let experts = trained_experts(input, l, stage);
    let expert_dp = expert_holders(l) as f64;
    let sharded = |n: f64, stage_min: u8| {
        if z >= stage_min {
            let e = experts.min(n);
            (n - e) / dp + e / expert_dp
        } else {
            n
        }
    };
    let (versions, grad_buffers) = weight_versions(l, stage);
    let weights = if input.lora.is_some() {
        // The frozen base stays whole on every replica (ZeRO shards only what trains) and is never
        // versioned; the adapters' compute copy is sharded like any trained parameter.
        frozen_base_bytes(input, l, stage, params)
            + versions * sharded(trainable, 3) * pr.weights.bytes()
    } else {
        versions * sharded(params, 3) * pr.weights.bytes()
    };
    // Mixed precision in this engine: beside the 16-bit gradients, its optimizer reads f32 ones for
    // what it updates (widened at the end of the reduction, as Megatron's f32 main gradients). The
    // published arithmetic (a model given by its parameter count, other engines' activation models)
    // counts the 16-bit gradients alone, as the ZeRO paper's 2 + 2 + 12 does.
    let engine = matches!(input.model, PlanModel::Shape(_))
        && input.activation_model == ActivationModel::Ferrotron;
    // 2BW's two stores are each reduced (so widened) at the end of their step, before the
    // previous one's update: both hold main gradients then.
    let main_grads = if engine && pr.grads.bytes() < pr.master_bytes() {
        grad_buffers * sharded(trainable, 1) * pr.master_bytes()
    } else {
        0.0
    };
    let gradients = grad_buffers * sharded(trainable, 2) * pr.grads.bytes() + main_grads;
    let master_weights = sharded(trainable, 1) * pr.master_bytes();
    let optimizer_states = sharded(trainable, 1) * input.optimizer.state_bytes(pr);
    MemoryTerms {
        weights: weights as u64,
        gradients: gradients as u64,
        master_weights: master_weights as u64,
        optimizer_states: optimizer_states as u64,
        activations: (activations + head_extra) as u64,
        comm_buffers: comm as u64,
        total: 0,
    }
    .with_total()
}

/// The weight versions a device of `stage` holds, and its gradient stores: asynchronous schedules
/// stash versions for their in-flight micro-batches (PipeDream: one per micro-batch in flight but
/// the newest; 2BW: the previous one, but on the last stage) and 2BW holds a step's gradients
/// until its update while the next step's accumulate.
fn weight_versions(l: &Layout, stage: usize) -> (f64, f64) {
    let last = stage + 1 == l.pp;
    match l.schedule {
        crate::layout::Schedule::PipeDream => ((l.pp - stage) as f64, 1.0),
        crate::layout::Schedule::TwoBw => (if last { 1.0 } else { 2.0 }, 2.0),
        _ => (1.0, 1.0),
    }
}

/// The routed experts' weights a device on `stage` holds between steps (0 for a dense model), which
/// `train` shows apart from the rest of the weights term: its experts' parameters (÷ ep; their
/// columns ÷ tp, or whole under `etp=1`) in the weights' format, ÷ the replicas holding the same
/// experts under ZeRO-3; one version (an asynchronous schedule's stashed versions come and go
/// within its segments). With LoRA, the frozen experts (whole on every replica) and their adapters
/// (sharded as any trained tensor).
pub fn expert_weight_bytes(input: &PlanInput, l: &Layout, stage: usize) -> u64 {
    let PlanModel::Shape(cfg) = &input.model else {
        return 0;
    };
    if cfg.moe.is_none() {
        return 0;
    }
    let frozen = match input.lora {
        Some(_) => routed_expert_params(cfg, l) * super::stage_layers(cfg, l, stage) as f64,
        None => 0.0,
    };
    let holders = if l.zero >= 3 { expert_holders(l) } else { 1 };
    let trained = trained_experts(input, l, stage) / holders as f64;
    ((frozen + trained) * input.precision.weights.bytes()) as u64
}

/// The routed experts' parameters that train on a device of `stage` (0 for a dense model): its
/// experts, or with LoRA their adapters.
fn trained_experts(input: &PlanInput, l: &Layout, stage: usize) -> f64 {
    match (&input.model, &input.lora) {
        (PlanModel::Shape(cfg), None) if cfg.moe.is_some() => {
            routed_expert_params(cfg, l) * super::stage_layers(cfg, l, stage) as f64
        }
        (PlanModel::Shape(cfg), Some(lora)) if cfg.moe.is_some() => {
            let per = |m: &LoraTarget, t: usize| lora_target_params_on_device(cfg, lora, t, m);
            sum_over_stage_layers(cfg, l, stage, &|i| lora_layer_sum(cfg, lora, l, i, &per).1)
        }
        _ => 0.0,
    }
}

/// The replicas holding the same experts, over which ZeRO shards their state (dp·cp / ep).
pub(super) fn expert_holders(l: &Layout) -> usize {
    (l.replicas() / l.ep.max(1)).max(1)
}

/// One block's projection weights on a device (each `numel / tp`): what QLoRA quantizes.
fn projection_numels(cfg: &ModelConfig, l: &Layout) -> Vec<usize> {
    cfg.param_specs()
        .iter()
        .filter(|s| is_projection_weight(cfg, &s.name) && cfg.stage_owns(&s.name, &(0..1)))
        .map(|s| s.numel() / l.tp)
        .collect()
}

/// Whether ZeRO-3 shards a QLoRA base's codes on this layout.
fn sharded_codes(input: &PlanInput, l: &Layout) -> bool {
    input.quantize_base.is_some() && l.zero == 3 && l.replicas() > 1
}

/// Bytes of the frozen base on a device of `stage` holding `params` of it: in the weights' format,
/// but (QLoRA) the projections at their quantized size, and under ZeRO-3 their codes a piece of
/// the replicas' (the constants whole).
fn frozen_base_bytes(input: &PlanInput, l: &Layout, stage: usize, params: f64) -> f64 {
    let bytes = input.precision.weights.bytes();
    let (Some(q), PlanModel::Shape(cfg)) = (input.quantize_base, &input.model) else {
        return params * bytes;
    };
    let layers = super::stage_layers(cfg, l, stage);
    let projections = projection_numels(cfg, l);
    let per_layer: usize = projections
        .iter()
        .map(|&n| {
            let (whole, codes) = (q.matrix_bytes(n), n.div_ceil(2));
            if sharded_codes(input, l) {
                whole - codes + codes.div_ceil(l.replicas())
            } else {
                whole
            }
        })
        .sum();
    let unquantized = params - (projections.iter().sum::<usize>() * layers) as f64;
    (per_layer * layers) as f64 + unquantized * bytes
}

/// ZeRO-3 on a QLoRA base: a block's gathered codes and this rank's pieces sent for them.
fn gathered_codes(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> f64 {
    if !sharded_codes(input, l) {
        return 0.0;
    }
    let codes: usize = projection_numels(cfg, l)
        .iter()
        .map(|n| n.div_ceil(2))
        .sum();
    codes as f64 * (1.0 + 1.0 / l.replicas() as f64)
}

/// Σ `per(target, tp)` over layer `i`'s adapters on one device of layout `l`, as (dense, routed
/// experts), `tp` the tensor-parallel degree that splits the target (1 for a routed expert's
/// under `etp=1`): a routed expert's counted `num_experts / ep` times (`/ (tp·ep)` under `etp=1`;
/// the experts are alike, and expert parallelism leaves a device its share; only one expert's
/// names are built, however many there are).
pub fn lora_layer_sum(
    cfg: &ModelConfig,
    lora: &LoraConfig,
    l: &Layout,
    i: usize,
    per: &dyn Fn(&LoraTarget, usize) -> f64,
) -> (f64, f64) {
    let shard;
    let blocks = l.expert_blocks();
    let (one, routed) = match &cfg.moe {
        Some(m) if m.has_experts(i) => {
            shard = cfg.expert_shard(crate::model::ExpertShard::new(0, m.num_experts));
            (&shard, (m.num_experts / (l.ep.max(1) * blocks)) as f64)
        }
        _ => (cfg, 0.0),
    };
    let (mut dense, mut experts) = (0.0, 0.0);
    for t in lora.layer_modules(one, i) {
        if one.routed_expert_of(&t.weight_name()).is_some() {
            experts += routed * per(&t, l.tp / blocks);
        } else {
            dense += per(&t, l.tp);
        }
    }
    (dense, experts)
}

/// A target's adapter parameters on one device of a tensor-parallel group of `t`: its sharded half
/// (a column-parallel base's `B`, a row-parallel base's `A`) divided by `t` (a shared KV head's `B`
/// is one head's), the other half whole.
pub fn lora_target_params_on_device(
    cfg: &ModelConfig,
    lora: &LoraConfig,
    t: usize,
    m: &LoraTarget,
) -> f64 {
    let (r, t) = (lora.rank as f64, t as f64);
    let kv_out = cfg.head_dim as f64 * (cfg.num_kv_heads as f64 / t).max(1.0);
    let (i, o) = (m.in_dim as f64, m.out_dim as f64);
    match m.split {
        TargetSplit::Column if matches!(m.short.as_str(), "k_proj" | "v_proj") => r * (i + kv_out),
        TargetSplit::Column => r * (i + o / t),
        TargetSplit::Row => r * (i / t + o),
    }
}

/// The first block with experts and the first without, those `cfg` has: every block of a kind is
/// alike, so one of each stands for the rest.
fn block_kinds(cfg: &ModelConfig) -> [Option<usize>; 2] {
    let has = |i: usize| cfg.moe.as_ref().is_some_and(|m| m.has_experts(i));
    [true, false].map(|experts| (0..cfg.num_layers).find(|&i| has(i) == experts))
}

/// Σ `per(layer)` over the layers one device of `stage` holds, `per` asked once for a block with
/// experts and once for one without.
pub fn sum_over_stage_layers(
    cfg: &ModelConfig,
    l: &Layout,
    stage: usize,
    per: &dyn Fn(usize) -> f64,
) -> f64 {
    let [with_experts, without] = block_kinds(cfg);
    let kind = |experts: bool| if experts { with_experts } else { without };
    let with = super::stage_expert_layers(cfg, l, stage);
    let without = super::stage_layers(cfg, l, stage) - with;
    [(with, true), (without, false)]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|&(n, experts)| n as f64 * kind(experts).map_or(0.0, per))
        .sum()
}

/// The largest block's adapter parameters on one device, as (dense, routed experts).
pub fn largest_lora_layer_on_device(
    cfg: &ModelConfig,
    lora: &LoraConfig,
    l: &Layout,
) -> (f64, f64) {
    let per = |m: &LoraTarget, t: usize| lora_target_params_on_device(cfg, lora, t, m);
    block_kinds(cfg)
        .into_iter()
        .flatten()
        .map(|i| lora_layer_sum(cfg, lora, l, i, &per))
        .fold((0.0, 0.0), |best, x| {
            if x.0 + x.1 > best.0 + best.1 {
                x
            } else {
                best
            }
        })
}

/// The adapter parameters one device of `stage` holds (its layers' adapters).
pub fn lora_params_on_device(
    cfg: &ModelConfig,
    lora: &LoraConfig,
    l: &Layout,
    stage: usize,
) -> f64 {
    let per = |m: &LoraTarget, t: usize| lora_target_params_on_device(cfg, lora, t, m);
    sum_over_stage_layers(cfg, l, stage, &|i| {
        let (dense, experts) = lora_layer_sum(cfg, lora, l, i, &per);
        dense + experts
    })
}

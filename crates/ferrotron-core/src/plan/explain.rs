//! Plain-language notes on a plan, in the source texts' order: which term dominates, then reduce,
//! shard the optimizer, tensor-parallel inside a node, pipeline across nodes.

use super::cost::links;
use super::{stage_memory, AttentionKernel, MemoryTerms, Plan, PlanInput, PlanModel};
use crate::layout::{Layout, Recompute, Schedule};

pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

fn breakdown(m: &MemoryTerms) -> String {
    m.terms()
        .iter()
        .map(|(n, b)| format!("{n} {}", gb(*b as f64)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Notes on one evaluated layout.
pub fn layout_notes(input: &PlanInput, p: &Plan) -> Vec<String> {
    let l = &p.layout;
    let mut out = Vec::new();
    let worst_stage = p
        .memory_bytes_per_stage
        .iter()
        .position(|m| m.total == p.memory_bytes.total)
        .unwrap_or(0);
    let (name, bytes) = p.memory_bytes.largest();
    out.push(format!(
        "memory per device (worst: stage {worst_stage}): {} of {} usable ({} capacity less {:.0}% reserve) — {}; largest term {name} ({})",
        gb(p.memory_bytes.total as f64),
        gb(p.usable_bytes as f64),
        gb(p.capacity_bytes as f64),
        input.memory_reserve * 100.0,
        if p.fits { "fits" } else { "DOES NOT FIT" },
        gb(bytes as f64)
    ));
    if !p.fits {
        out.push(format!("breakdown: {}", breakdown(&p.memory_bytes)));
    }
    if l.world_size() < input.cluster.world_size() {
        out.push(format!(
            "uses {} of the cluster's {} devices",
            l.world_size(),
            input.cluster.world_size()
        ));
    }
    if matches!(input.model, PlanModel::ParamsOnly(_)) {
        out.push("a bare parameter count gives model-state memory only (no activations, traffic or time)".into());
        return out;
    }
    let lk = links(&input.cluster, l);
    let link_name = |bw: f64| {
        if bw == input.cluster.intra_node.bandwidth_bytes_per_s {
            "intra-node"
        } else {
            "inter-node"
        }
    };
    if l.tp > 1 {
        out.push(format!(
            "tensor parallel tp={}: {} per step per device on the {} link ({:.0} GB/s)",
            l.tp,
            gb(p.comm_bytes_per_step.tp),
            link_name(lk.tp.bandwidth_bytes_per_s),
            lk.tp.bandwidth_bytes_per_s / 1e9
        ));
        if lk.tp.bandwidth_bytes_per_s != input.cluster.intra_node.bandwidth_bytes_per_s {
            out.push("WARNING: the tensor-parallel group spans nodes: every layer's exchange crosses the slow link".into());
        }
    }
    if l.schedule.is_async() {
        out.push(format!(
            "asynchronous: schedule={} runs without a flush, so the pipeline fills and drains once \
             per run (and at each checkpoint or evaluation), not every step; micro-batches train on \
             weights {} — a change of the optimizer's semantics, which `ferrotron verify --steps K` \
             checks against the delayed-update reference; the weights term holds the stashed \
             versions",
            l.schedule.name(),
            if l.schedule == crate::layout::Schedule::TwoBw {
                "one update old (W(t+1) = W(t) − ν·∇f(W(t−1)))"
            } else {
                "as many updates old as micro-batches are in flight behind them"
            }
        ));
    }
    if l.pp > 1 {
        out.push(format!(
            "pipeline pp={} ({}{}), {} micro-batches: {} {:.1}% of the step; {} per step per device on the {} link",
            l.pp,
            l.schedule.name(),
            if l.vpp > 1 { format!(", {} chunks per stage", l.vpp) } else { String::new() },
            p.num_micro_batches,
            if l.schedule.is_async() { "steady-state idle" } else { "bubble" },
            p.bubble_fraction * 100.0,
            gb(p.comm_bytes_per_step.pp),
            link_name(lk.pp.bandwidth_bytes_per_s)
        ));
    }
    if l.cp > 1 {
        out.push(context_line(l, p, link_name(lk.cp.bandwidth_bytes_per_s)));
    }
    if l.dp > 1 {
        out.push(format!(
            "data parallel dp={} (ZeRO-{}): {} per step per device on the {} link, {:.3} s exposed",
            l.dp,
            l.zero,
            gb(p.comm_bytes_per_step.dp),
            link_name(lk.dp.bandwidth_bytes_per_s),
            p.dp_comm_time_s
        ));
    }
    out.push(format!(
        "step {:.3} s, {:.0} tokens/s, {:.1} TFLOP/s per device (with recompute), MFU {:.1}%",
        p.step_time_s,
        p.tokens_per_s,
        p.tflops_per_device,
        p.mfu * 100.0
    ));
    if p.step_time_s > 0.0 {
        // The two FLOP counts behind those figures, per token, from the step's own arithmetic.
        let devices_time = p.step_time_s * p.layout.world_size() as f64;
        let tokens = (input.global_batch * input.seq) as f64;
        out.push(format!(
            "FLOPs per token: {:.3e} model (forward and backward, attention under the causal mask: MFU's numerator, against {:.1} TFLOP/s peak per device), {:.3e} hardware (with recompute, attention in full as Narayanan et al. count it: the TFLOP/s figure's)",
            p.mfu * devices_time * input.cluster.peak_flops / tokens,
            input.cluster.peak_flops / 1e12,
            p.tflops_per_device * 1e12 * devices_time / tokens,
        ));
    }
    if let super::PlanModel::Shape(cfg) = &input.model {
        if let Some(m) = &cfg.moe {
            let blocks = l.expert_blocks();
            let tp_split = if blocks > 1 {
                format!(
                    "etp=1: the tp={} devices divide every block's experts, each expert whole on one of them (its rows already there, its output summed with the group's), ",
                    l.tp
                )
            } else if l.tp > 1 {
                format!("each expert's columns split over tp={}, ", l.tp)
            } else {
                String::new()
            };
            let held = if l.ep > 1 {
                format!(
                    "{tp_split}expert parallel ep={}: each device holds {} of the {} experts of every block, ZeRO shards them over the {} replicas holding the same ones; tokens travel to their experts and back in four all-to-alls per block, {} per step per device at a balanced load on the {} link",
                    l.ep,
                    m.num_experts / (l.ep * blocks),
                    m.num_experts,
                    super::memory::expert_holders(l),
                    gb(p.comm_bytes_per_step.ep),
                    link_name(lk.ep.bandwidth_bytes_per_s)
                )
            } else {
                format!("{tp_split}every expert's weights, gradients and optimizer state are on every replica (sharded only by ZeRO; ep=N divides the experts over N replicas)")
            };
            out.push(format!(
                "a mixture of experts: {:.2} B parameters, {:.2} B active per token ({} of {} experts in {} of {} blocks): {held}; a device of stage 0 holds {} of routed experts' weights (one version) in its {} weights term; compute follows the active parameters",
                cfg.num_params() as f64 / 1e9,
                cfg.num_active_params() as f64 / 1e9,
                m.top_k,
                m.num_experts,
                m.expert_layers(cfg.num_layers),
                cfg.num_layers,
                gb(p.expert_weight_bytes_per_stage[0] as f64),
                gb(p.memory_bytes_per_stage[0].weights as f64)
            ));
        }
        if let Some(a) = cfg.latent_attention {
            out.push(format!(
                "multi-head latent attention: queries through a rank-{} bottleneck, keys and values from a {}-wide latent per token; each device keeps the down-projections whole and its heads' up-projections and output rows; QKᵀ over {}-wide heads, PV over {}-wide ones",
                a.q_lora_rank.map_or("full".to_string(), |r| r.to_string()),
                a.kv_lora_rank,
                cfg.head_dim,
                a.v_head_dim
            ));
        }
        // What `plan` prices but `train` does not run is said, not left to the launch.
        if let Some(why) = cfg.engine_refusal() {
            out.push(format!("priced only: {why}"));
        }
    }
    out
}

/// Why the search chose what it chose: the naive layout's memory, then each cut and what it saves.
pub fn search_notes(input: &PlanInput, best: Option<&Plan>) -> Vec<String> {
    let world = input.cluster.world_size();
    let naive = Layout {
        dp: world,
        ..Layout::default()
    };
    let mut out = Vec::new();
    let usable = input.usable_memory() as f64;
    let mem = |l: &Layout| stage_memory(input, l, 0, if l.pp > 1 { l.pp } else { 1 });
    let n = mem(&naive);
    let (name, bytes) = n.largest();
    out.push(format!(
        "1. the arithmetic first — pure data parallelism (dp={world}, mbs=1, no sharding, no recompute) needs {} per device against {} usable: {}; the largest term is {name} ({})",
        gb(n.total as f64),
        gb(usable),
        if (n.total as f64) <= usable { "it fits" } else { "it does not fit" },
        gb(bytes as f64)
    ));
    if input.precision.weights.bytes() > 2.0 {
        out.push("2. reduce: weights and activations in fp32 — bf16 would halve both (--precision weights=bf16)".into());
    }
    let full = Layout {
        recompute: Recompute::Full,
        ..naive
    };
    let r = mem(&full);
    out.push(format!(
        "2. reduce: full activation recompute cuts activations from {} to {} per device for ~33% more compute; {}",
        gb(n.activations as f64),
        gb(r.activations as f64),
        match input.attention {
            AttentionKernel::Materialized => "selective recompute keeps most of the saving for less",
            AttentionKernel::Flash => "memory-efficient attention already keeps no T×T probabilities (selective recompute has nothing left to drop)",
        }
    ));
    if let Some(lora) = &input.lora {
        out.push(format!("2. reduce: LoRA rank {} on {} leaves gradients and optimizer state only for the adapters ({}); the frozen base keeps its weights", lora.rank, lora.targets.join(", "), gb((n.gradients + n.optimizer_states + n.master_weights) as f64)));
        if let PlanModel::Shape(cfg) = &input.model {
            if crate::model::check_quantized_base(cfg).is_ok() {
                out.push(quantized_base_note(input, &naive));
            }
        }
    }
    if world > 1 {
        let shard = |z| mem(&Layout { zero: z, ..full });
        let (z1, z2, z3) = (shard(1), shard(2), shard(3));
        out.push(format!(
            "3. shard the optimizer over dp={world}: ZeRO-1 {} → ZeRO-2 {} → ZeRO-3 {} per device (with full recompute), at the price of gathering parameters every step",
            gb(z1.total as f64),
            gb(z2.total as f64),
            gb(z3.total as f64)
        ));
    }
    match best {
        Some(b) => {
            let l = &b.layout;
            if l.tp > 1 {
                out.push(format!("4. tensor-parallel inside a node: tp={} splits every layer's weights {}-ways; {} of traffic per step per device on the fast link", l.tp, l.tp, gb(b.comm_bytes_per_step.tp)));
            } else {
                out.push("4. no tensor parallelism needed: the layers fit without splitting them".into());
            }
            if l.cp > 1 {
                out.push(context_note(input, l));
            }
            if l.pp > 1 {
                out.push(format!(
                    "5. pipeline across nodes: pp={} with {} ({} micro-batches) leaves a {:.1}% bubble and moves only {} of boundary activations per step per device",
                    l.pp,
                    if l.schedule == Schedule::Interleaved { format!("interleaved, v={}", l.vpp) } else { l.schedule.name().to_string() },
                    b.num_micro_batches,
                    b.bubble_fraction * 100.0,
                    gb(b.comm_bytes_per_step.pp)
                ));
            } else {
                out.push("5. no pipeline needed".into());
            }
            out.push(format!(
                "chosen: {} — {} per device of {} usable, step {:.3} s, MFU {:.1}%",
                l,
                gb(b.memory_bytes.total as f64),
                gb(usable),
                b.step_time_s,
                b.mfu * 100.0
            ));
        }
        None => out.push("no layout fits: every candidate exceeds device memory even with ZeRO-3, full recompute and the smallest micro-batch; add devices or reduce the model".into()),
    }
    out
}

/// What storing the frozen base's projections in NF4 does to the unsplit layout `naive`: its
/// weights with and without, and whether it is the reduction that makes the run fit without a
/// split (or would be, when the run does not quantize).
fn quantized_base_note(input: &PlanInput, naive: &Layout) -> String {
    let usable = input.usable_memory() as f64;
    let with = |q| {
        let i = PlanInput {
            quantize_base: q,
            ..input.clone()
        };
        stage_memory(&i, naive, 0, 1)
    };
    let nf4 = crate::precision::BaseQuantization::Nf4;
    let (plain, quantized) = (with(None), with(Some(nf4)));
    let fits = |m: &MemoryTerms| (m.total as f64) <= usable;
    let verdict = match (fits(&plain), fits(&quantized)) {
        (false, true) => "this is the reduction that makes the run fit without a split",
        (true, _) => "the run fits without it",
        (false, false) => "not enough alone: a split is still needed",
    };
    let asked = if input.quantize_base.is_some() {
        "the frozen base's projections in NF4"
    } else {
        "quantizing the frozen base's projections to NF4 (--quantize-base nf4)"
    };
    format!(
        "2. reduce: {asked}: weights {} → {} per device ({} → {} in all, {} usable): {verdict}",
        gb(plain.weights as f64),
        gb(quantized.weights as f64),
        gb(plain.total as f64),
        gb(quantized.total as f64),
        gb(usable)
    )
}

/// Why the chosen layout splits sequences: the activations per device without context parallelism
/// (the same layout, its cp devices as data-parallel replicas) against with it, and whether the
/// split is what makes the run fit.
fn context_note(input: &PlanInput, l: &Layout) -> String {
    let usable = input.usable_memory() as f64;
    let peak = |l: &Layout| {
        let m = input.global_batch / (l.dp * l.micro_batch_size).max(1);
        (0..l.pp)
            .map(|s| stage_memory(input, l, s, super::in_flight(l, m, s)))
            .max_by_key(|m| m.total)
            .unwrap_or_default()
    };
    let without = Layout {
        cp: 1,
        dp: l.dp * l.cp,
        ..*l
    };
    let (with_cp, no_cp) = (peak(l), peak(&without));
    let verdict = if no_cp.total as f64 > usable {
        format!(
            "without it ({without}) a device would need {}, over the {} usable: context \
             parallelism is the cut that makes this run fit",
            gb(no_cp.total as f64),
            gb(usable)
        )
    } else {
        format!(
            "without it ({without}) a device would need {}, which fits: the split is chosen for \
             speed",
            gb(no_cp.total as f64)
        )
    };
    format!(
        "4b. split the sequences: cp={} gives each device {} of every {}-token sequence, so \
         activations fall from {} to {} per device; {verdict}",
        l.cp,
        input.seq / l.cp,
        input.seq,
        gb(no_cp.activations as f64),
        gb(with_cp.activations as f64)
    )
}

/// What context parallelism does in a layout: the split, its traffic and link.
fn context_line(l: &Layout, p: &Plan, link: &str) -> String {
    format!(
        "context parallel cp={} ({}): every sequence split {}-ways (activations ÷ {}); {} per \
             step per device on the {} link{}",
        l.cp,
        match l.cp_comm {
            crate::layout::CpComm::Ring =>
                "ring attention, K/V blocks overlapped with the block products",
            crate::layout::CpComm::A2a => "all-to-all over heads",
        },
        l.cp,
        l.cp,
        gb(p.comm_bytes_per_step.cp),
        link,
        if l.dp > 1 {
            format!(
                "; the dp × cp = {} replicas reduce gradients together",
                l.replicas()
            )
        } else {
            String::new()
        }
    )
}

/// How a candidate ranks against the best one, given the time model's own error on this cluster:
/// a note when its predicted step is within that error of the best's (the two are then not told
/// apart), none when it is further or the error was never measured (see [`ranking_note`]).
pub fn within_error_of_best(input: &PlanInput, best: &Plan, p: &Plan) -> Option<String> {
    let err = input.cluster.calibration.step_time_error?;
    let slower = p.step_time_s / best.step_time_s.max(f64::MIN_POSITIVE) - 1.0;
    (slower <= err).then(|| {
        format!(
            "within error of #1: {:+.1}% predicted, inside the ±{:.1}% the step time is measured to be off on {}",
            100.0 * slower,
            100.0 * err,
            input.cluster.name
        )
    })
}

/// What the ranking of candidates rests on: the time model's measured error on this cluster, or
/// that it was never measured.
pub fn ranking_note(input: &PlanInput) -> String {
    match input.cluster.calibration.step_time_error {
        Some(e) => format!(
            "ranking: by predicted step time; candidates within ±{:.1}% of #1 (the step time's measured error on {}) are marked, not told apart",
            100.0 * e,
            input.cluster.name
        ),
        None => format!(
            "ranking: by predicted step time; the step time's error on {} was never measured (`calibrate --runs FILE --leave-one-out` measures it), so close candidates are not marked",
            input.cluster.name
        ),
    }
}

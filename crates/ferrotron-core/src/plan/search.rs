//! Every valid layout for the cluster, ranked by step time among those that fit.

use super::cost::costs;
use super::{
    check_layout, evaluate, in_flight, params_on_device, stage_memory, AttentionKernel, Plan,
    PlanInput, PlanModel,
};
use crate::error::{ConfigError, Result};
use crate::layout::{CpComm, Layout, Recompute, Schedule};

/// Micro-batch sizes the search tries (those that divide the batch per replica survive the rules).
const MICRO_BATCH_SIZES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// How many of the cheapest candidates (by a closed-form estimate) are simulated exactly.
const SIMULATED: usize = 32;

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// All layouts that keep the rules and use every device.
pub(super) fn enumerate(input: &PlanInput) -> Vec<Layout> {
    let world = input.cluster.world_size();
    let layers = match &input.model {
        PlanModel::Shape(cfg) => cfg.num_layers,
        PlanModel::ParamsOnly(_) => world,
    };
    let moe = matches!(&input.model, PlanModel::Shape(cfg) if cfg.moe.is_some());
    let mut out = Vec::new();
    for tp in divisors(world) {
        // Stages need not divide the layers: an uneven split is priced as the engine runs it.
        for pp in divisors(world / tp).into_iter().filter(|&pp| pp <= layers) {
            // Context parallelism takes part of the replicas: cp × dp = world / (tp · pp). A model
            // given by its parameter count alone has no activations for it to split.
            for (cp, cp_comm) in context_options(input, tp, pp, world / (tp * pp)) {
                let dp = world / (tp * pp * cp);
                let chunk_options: Vec<usize> = if pp > 1 {
                    (1..=8).filter(|v| pp * v <= layers).collect()
                } else {
                    vec![1]
                };
                for vpp in chunk_options {
                    // The asynchronous schedules change the optimizer's semantics: only when asked.
                    let schedules: &[Schedule] = match (pp, vpp, input.allow_async) {
                        (1, _, _) => &[Schedule::OneFOneB],
                        (_, 1, false) => &[Schedule::OneFOneB, Schedule::Gpipe, Schedule::Zbh1],
                        (_, 1, true) => &[
                            Schedule::OneFOneB,
                            Schedule::Gpipe,
                            Schedule::Zbh1,
                            Schedule::TwoBw,
                            Schedule::PipeDream,
                        ],
                        _ => &[Schedule::Interleaved],
                    };
                    for (&schedule, ep) in schedules.iter().flat_map(|s| {
                        expert_options(input, dp * cp)
                            .into_iter()
                            .map(move |e| (s, e))
                    }) {
                        for zero in 0..=if dp > 1 { 3 } else { 0 } {
                            for mbs in MICRO_BATCH_SIZES {
                                for recompute in
                                    [Recompute::None, Recompute::Selective, Recompute::Full]
                                {
                                    for sp in [false, true] {
                                        if sp && tp == 1 {
                                            continue;
                                        }
                                        // With memory-efficient attention selective recompute is
                                        // no recompute (no probabilities to drop): one candidate.
                                        if recompute == Recompute::Selective
                                            && input.attention == AttentionKernel::Flash
                                        {
                                            continue;
                                        }
                                        let l = Layout {
                                            dp,
                                            tp,
                                            pp,
                                            vpp,
                                            zero,
                                            micro_batch_size: mbs,
                                            schedule,
                                            sequence_parallel: sp,
                                            recompute,
                                            stages: None,
                                            cp,
                                            cp_comm,
                                            ep,
                                            etp: None,
                                        };
                                        let split_ok =
                                            cp == 1 || (mbs == 1 && recompute != Recompute::Full);
                                        if split_ok && check_layout(input, &l).is_ok() {
                                            out.push(l);
                                        }
                                        // A mixture of experts over a tp group: also each
                                        // expert whole, the group dividing the experts.
                                        let whole = Layout { etp: Some(1), ..l };
                                        if split_ok
                                            && tp > 1
                                            && moe
                                            && check_layout(input, &whole).is_ok()
                                        {
                                            out.push(whole);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The expert-parallel groups worth pricing over `replicas` (dp·cp) devices: none, and for a
/// mixture of experts every size that divides both the replicas and the experts.
fn expert_options(input: &PlanInput, replicas: usize) -> Vec<usize> {
    match &input.model {
        PlanModel::Shape(cfg) => match &cfg.moe {
            Some(m) => divisors(replicas)
                .into_iter()
                .filter(|&ep| m.num_experts.is_multiple_of(ep))
                .collect(),
            None => vec![1],
        },
        PlanModel::ParamsOnly(_) => vec![1],
    }
}

/// The context-parallel splits worth pricing for `replicas` devices per (tp, pp) shard: none, and
/// when the shard's activations call for it, each power of two up to 64 dividing them whose 2·cp
/// chunks divide the sequence, as a ring and, inside a node, as all-to-all (the layout rules refuse
/// the splits the model's heads do not allow). Split sequences are long ones, one per micro-batch,
/// and a split is the alternative to recomputing whole layers: the search does not pair it with
/// full recompute (a `--layout` may ask for both).
fn context_options(
    input: &PlanInput,
    tp: usize,
    pp: usize,
    replicas: usize,
) -> Vec<(usize, CpComm)> {
    let mut out = vec![(1, CpComm::Ring)];
    if matches!(input.model, PlanModel::ParamsOnly(_)) || !context_needed(input, tp, pp, replicas) {
        return out;
    }
    for cp in (1..=6)
        .map(|k| 1usize << k)
        .filter(|&cp| replicas.is_multiple_of(cp) && input.seq.is_multiple_of(2 * cp))
    {
        out.push((cp, CpComm::Ring));
        if cp <= input.cluster.devices_per_node {
            out.push((cp, CpComm::A2a));
        }
    }
    out
}

/// Sequences from this long are "long": the search weighs splitting them against recomputing them
/// (attention's share of a layer grows with the sequence, and with it what full recompute costs);
/// shorter ones are split only when nothing else fits.
pub const LONG_SEQUENCE: usize = 8192;

/// Whether a (tp, pp) shard's sequences call for splitting, with all its `replicas` as
/// data-parallel ones and everything else that saves memory (ZeRO-3, one sequence per micro-batch,
/// sequence parallelism): the layout breaks a rule (a global batch too small to share out); or it
/// does not fit even with full recompute; or, for long sequences, it does not fit without recompute
/// with activations its largest term. Otherwise a split only adds communication to the same work:
/// the search leaves it out.
fn context_needed(input: &PlanInput, tp: usize, pp: usize, replicas: usize) -> bool {
    let lean = Layout {
        tp,
        pp,
        dp: replicas,
        zero: if replicas > 1 { 3 } else { 0 },
        sequence_parallel: tp > 1,
        ..Layout::default()
    };
    if check_layout(input, &lean).is_err() {
        return true;
    }
    let m = input.global_batch / (lean.dp * lean.micro_batch_size);
    let over = |l: &Layout, activations_largest: bool| {
        (0..pp).any(|s| {
            let mem = stage_memory(input, l, s, in_flight(l, m, s));
            mem.total > input.usable_memory()
                && (!activations_largest || mem.largest().0 == "activations")
        })
    };
    let recomputed = Layout {
        recompute: Recompute::Full,
        ..lean
    };
    over(&recomputed, false) || (input.seq >= LONG_SEQUENCE && over(&lean, true))
}

/// For each way to cut the devices into tp × pp × dp, the first rule the plainest such layout
/// (micro-batch 1, no ZeRO, no recompute) breaks: what did not divide, or what did not fit.
pub fn why_no_layout(input: &PlanInput) -> Vec<String> {
    let world = input.cluster.world_size();
    let layers = match &input.model {
        PlanModel::Shape(cfg) => Some(cfg.num_layers),
        PlanModel::ParamsOnly(_) => None,
    };
    let mut out = Vec::new();
    let mut unlisted = 0;
    for tp in divisors(world) {
        for pp in divisors(world / tp) {
            let dp = world / (tp * pp);
            if out.len() == MAX_LISTED_CUTS {
                unlisted += 1;
                continue;
            }
            let l = Layout {
                dp,
                tp,
                pp,
                ..Layout::default()
            };
            let why = match layers {
                Some(n) if pp > n => {
                    format!("pp={pp} stages cannot each hold one of the model's {n} layers")
                }
                _ => match check_layout(input, &l).and_then(|()| evaluate(input, &l)) {
                    Err(e) => e.to_string(),
                    Ok(p) if !p.fits => format!(
                        "keeps the rules; needs {:.1} MB per device without ZeRO or recompute \
                         (usable: {:.1} MB)",
                        p.memory_bytes.total as f64 / 1e6,
                        input.usable_memory() as f64 / 1e6
                    ),
                    Ok(_) => continue,
                },
            };
            out.push(format!("  dp={dp},tp={tp},pp={pp}: {why}"));
        }
    }
    if unlisted > 0 {
        out.push(format!(
            "  … and {unlisted} more ways to cut {world} devices into dp × tp × pp"
        ));
    }
    out
}

/// The cuts [`why_no_layout`] explains one by one; the rest are counted (an error stays readable
/// however many devices the cluster has).
const MAX_LISTED_CUTS: usize = 12;

/// Closed-form memory and step time, for pruning before the exact simulation.
fn estimate(input: &PlanInput, l: &Layout) -> (bool, f64, u64) {
    let m = input.global_batch / (l.dp * l.micro_batch_size);
    let worst = (0..l.pp)
        .map(|s| stage_memory(input, l, s, in_flight(l, m, s)))
        .max_by_key(|t| t.total)
        .expect("a stage");
    let fits = worst.total <= input.usable_memory();
    let PlanModel::Shape(cfg) = &input.model else {
        return (fits, worst.total as f64, worst.total);
    };
    if !fits {
        // The search drops it: no need to price it.
        return (false, f64::INFINITY, worst.total);
    }
    let c = costs(input, cfg, l, params_on_device(cfg, l, 0));
    let chunk: Vec<f64> = c
        .actions
        .iter()
        .map(|a| a.forward + a.backward_input + a.backward_weight)
        .collect();
    let per_stage_max = (0..l.pp)
        .map(|s| (0..l.vpp).map(|v| chunk[v * l.pp + s]).sum::<f64>())
        .fold(0.0, f64::max);
    // An asynchronous schedule fills its pipeline once per run, not per step.
    let fill = if l.schedule.is_async() {
        0.0
    } else {
        chunk.iter().sum::<f64>() / l.vpp as f64 * (l.pp - 1) as f64 / l.pp as f64
    };
    (
        fits,
        m as f64 * per_stage_max + fill + c.per_step_time(),
        worst.total,
    )
}

/// The layouts that fit, best (shortest step; smallest memory for a bare parameter count) first.
pub fn search(input: &PlanInput) -> Result<Vec<Plan>> {
    input.check()?;
    let all = enumerate(input);
    if all.is_empty() {
        return Err(ConfigError::Invalid(format!(
            "no layout of {} devices keeps the rules for this model and batch:\n{}",
            input.cluster.world_size(),
            why_no_layout(input).join("\n")
        )));
    }
    let mut scored: Vec<(f64, u64, Layout)> = all
        .iter()
        .filter_map(|l| {
            let (fits, est, mem) = estimate(input, l);
            fits.then_some((est, mem, *l))
        })
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut plans = Vec::new();
    for (_, _, l) in scored.into_iter().take(SIMULATED) {
        let p = evaluate(input, &l)?;
        if p.fits {
            plans.push(p);
        }
    }
    let params_only = matches!(input.model, PlanModel::ParamsOnly(_));
    plans.sort_by(|a, b| {
        if params_only {
            a.memory_bytes.total.cmp(&b.memory_bytes.total)
        } else {
            a.step_time_s.total_cmp(&b.step_time_s)
        }
    });
    Ok(plans)
}

use super::{Action, PipelineSchedule};
use crate::error::{ConfigError, Result};
use crate::layout::Schedule;

/// The most actions a schedule may hold (all stages together): ~16M, far beyond any real pipeline
/// (128 stages × 4,096 micro-batches × 8 chunks is 12.6M), so a mistyped size is an error, not
/// gigabytes.
pub const MAX_ACTIONS: usize = 1 << 24;

/// Builds the per-stage action lists of `kind` for `stages` × `micro_batches` × `chunks`.
pub fn build(
    kind: Schedule,
    stages: usize,
    micro_batches: usize,
    chunks: usize,
) -> Result<PipelineSchedule> {
    let (p, m, v) = (stages, micro_batches, chunks);
    if p == 0 || m == 0 || v == 0 {
        return Err(ConfigError::Invalid(
            "a schedule needs at least one stage, micro-batch and chunk".into(),
        ));
    }
    // Actions per stage: a forward and a backward (or its two halves) per micro-batch and chunk.
    let actions = p.saturating_mul(m).saturating_mul(v).saturating_mul(3);
    if actions > MAX_ACTIONS {
        return Err(ConfigError::Invalid(format!(
            "{p} stages × {m} micro-batches × {v} chunks is ~{actions} actions, beyond the {MAX_ACTIONS} a schedule may hold"
        )));
    }
    if v > 1 && kind != Schedule::Interleaved {
        return Err(ConfigError::Invalid(format!(
            "vpp={v} needs schedule=interleaved ({} runs one chunk per stage)",
            kind.name()
        )));
    }
    let actions = match kind {
        Schedule::Gpipe => (0..p).map(|_| gpipe(m)).collect(),
        Schedule::OneFOneB => (0..p).map(|s| one_f_one_b(p, s, m)).collect(),
        Schedule::Interleaved => {
            if v > 1 && m % p != 0 {
                return Err(ConfigError::Invalid(format!(
                    "the interleaved schedule needs the micro-batch count ({m}) to be a multiple of the stage count ({p})"
                )));
            }
            (0..p).map(|s| interleaved(p, s, m, v)).collect()
        }
        Schedule::Zbh1 => zb_h1_all(p, m),
        Schedule::PipeDream | Schedule::TwoBw => {
            return Err(ConfigError::Invalid(format!(
                "schedule={} is asynchronous: it spans optimizer steps (`build_async`)",
                kind.name()
            )))
        }
    };
    Ok(PipelineSchedule {
        stages: p,
        micro_batches: m,
        chunks: v,
        actions,
        versions: Vec::new(),
        micro_batches_per_update: m,
        sync_updates: true,
    })
}

/// GPipe: every forward, then every backward.
fn gpipe(m: usize) -> Vec<Action> {
    let f = (0..m).map(|mb| Action::Forward { mb, chunk: 0 });
    let b = (0..m).map(|mb| Action::Backward { mb, chunk: 0 });
    f.chain(b).collect()
}

/// 1F1B (PipeDream-Flush): p − s − 1 warm-up forwards, then one forward / one backward, then drain.
/// Stage s never holds more than min(m, p − s) micro-batches' activations.
pub(super) fn one_f_one_b(p: usize, s: usize, m: usize) -> Vec<Action> {
    let warmup = (p - s - 1).min(m);
    let mut out: Vec<Action> = (0..warmup)
        .map(|mb| Action::Forward { mb, chunk: 0 })
        .collect();
    for i in 0..m - warmup {
        out.push(Action::Forward {
            mb: warmup + i,
            chunk: 0,
        });
        out.push(Action::Backward { mb: i, chunk: 0 });
    }
    out.extend((m - warmup..m).map(|mb| Action::Backward { mb, chunk: 0 }));
    out
}

/// Interleaved 1F1B (Narayanan et al. 2021): micro-batches go through the chunks in groups of p.
fn interleaved(p: usize, s: usize, m: usize, v: usize) -> Vec<Action> {
    if v == 1 {
        return one_f_one_b(p, s, m);
    }
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |k: usize| Action::Forward {
        mb: mb_of(k),
        chunk: (k / p) % v,
    };
    let bwd = |k: usize| Action::Backward {
        mb: mb_of(k),
        chunk: v - 1 - (k / p) % v,
    };
    let warmup = ((p - s - 1) * 2 + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warmup).map(fwd).collect();
    for i in 0..total - warmup {
        out.push(fwd(warmup + i));
        out.push(bwd(i));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}

/// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
/// an input-gradient action (I, on the critical path) and a weight-gradient action (W) that can wait.
/// Built by list scheduling with unit costs: whenever a stage is free it runs its next 1F1B action if
/// that action's input has arrived, and otherwise fills the slot with a pending W. At most p − s − 1
/// W's may be pending on stage s, which bounds its activation memory near 1F1B's.
fn zb_h1_all(p: usize, m: usize) -> Vec<Vec<Action>> {
    // The critical-path order of each stage: 1F1B with every backward reduced to its input gradient.
    let base: Vec<Vec<Action>> = (0..p)
        .map(|s| {
            one_f_one_b(p, s, m)
                .into_iter()
                .map(|a| match a {
                    Action::Backward { mb, chunk } => Action::BackwardInput { mb, chunk },
                    f => f,
                })
                .collect()
        })
        .collect();
    let mut f_done = vec![vec![usize::MAX; m]; p];
    let mut i_done = vec![vec![usize::MAX; m]; p];
    let mut next = vec![0usize; p];
    let mut pending: Vec<std::collections::VecDeque<Action>> = vec![Default::default(); p];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
    let total = 3 * m;
    let mut t = 0usize;
    while out.iter().any(|o| o.len() < total) {
        for s in 0..p {
            let ready = base[s].get(next[s]).filter(|a| match **a {
                Action::Forward { mb, .. } => s == 0 || f_done[s - 1][mb] <= t,
                Action::BackwardInput { mb, .. } => {
                    f_done[s][mb] <= t && (s == p - 1 || i_done[s + 1][mb] <= t)
                }
                _ => false,
            });
            let must_flush = pending[s].len() > p - s - 1;
            let action = match (ready, must_flush) {
                (Some(&a), false) => {
                    next[s] += 1;
                    Some(a)
                }
                _ => pending[s].pop_front(),
            };
            let Some(a) = action else { continue };
            // Unit cost: the action occupies [t, t + 1).
            match a {
                Action::Forward { mb, .. } => f_done[s][mb] = t + 1,
                Action::BackwardInput { mb, chunk } => {
                    i_done[s][mb] = t + 1;
                    pending[s].push_back(Action::BackwardWeight { mb, chunk });
                }
                _ => {}
            }
            out[s].push(a);
        }
        t += 1;
    }
    out
}

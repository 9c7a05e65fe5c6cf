//! Asynchronous pipeline schedules: 1F1B without flushes across optimizer steps, the updates in the
//! lists, and the weight version of every action (weight stashing).
//!
//! - **PipeDream** (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
//!   Training", SOSP 2019): each stage updates after every backward (`Update{j}` follows `B{j}`), a
//!   micro-batch's forward uses the stage's latest weights and stashes that version for its
//!   backward. Stage s then holds up to p − s versions at once (its in-flight micro-batches'), the
//!   last stage one. Vertical sync is off, as in the paper's default: one micro-batch may see
//!   different versions on different stages.
//! - **PipeDream-2BW** (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML
//!   2021): gradients are coalesced over the m micro-batches of a step (m ≥ p), one update per step,
//!   two weight versions. The update of step t comes just before the stage's first forward of step
//!   t + 2, so every micro-batch of step t + 1 runs forward on W(t) and every one of step t backward
//!   on the version its forward used: `W(t+1) = W(t) − ν·∇f(W(t−1))`, a delay of exactly 1 at every
//!   stage. The first step has no older version: it uses W(0), as the second does.
//!
//! In both, the version of a forward is the number of updates that precede it in its stage's list
//! (the stage's latest weights), and a backward uses its forward's. A list starts from the weights at
//! hand (a run's start, or a drain: a checkpoint or evaluation), as version 0.

use super::generate::one_f_one_b;
use super::{Action, PipelineSchedule, MAX_ACTIONS};
use crate::error::{ConfigError, Result};
use crate::layout::Schedule;

/// How an asynchronous schedule's updates are placed (kept for readers of the lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncRule {
    /// An update after every backward (PipeDream).
    EveryMicroBatch,
    /// An update per step of m micro-batches, just before the first forward of the step after next
    /// (PipeDream-2BW).
    EveryStep,
}

/// The per-stage lists of `kind` (PipeDream or PipeDream-2BW) for `stages` stages running `steps`
/// optimizer steps of `micro_batches` micro-batches each, one chunk per stage, with a warm-up at the
/// start and a drain at the end only. `sync_updates`: an update waits for every stage's backwards
/// of its micro-batches (global-norm clipping, a tied embedding), or for this stage's only.
pub fn build_async(
    kind: Schedule,
    stages: usize,
    micro_batches: usize,
    steps: usize,
    sync_updates: bool,
) -> Result<PipelineSchedule> {
    let (p, m, k) = (stages, micro_batches, steps);
    if p == 0 || m == 0 || k == 0 {
        return Err(ConfigError::Invalid(
            "a schedule needs at least one stage, micro-batch and step".into(),
        ));
    }
    let total = m.saturating_mul(k);
    let actions = p.saturating_mul(total).saturating_mul(3);
    if actions > MAX_ACTIONS {
        return Err(ConfigError::Invalid(format!(
            "{p} stages × {m} micro-batches × {k} steps is ~{actions} actions, beyond the \
             {MAX_ACTIONS} a schedule may hold"
        )));
    }
    let rule = match kind {
        Schedule::PipeDream => AsyncRule::EveryMicroBatch,
        Schedule::TwoBw => {
            if m < p {
                return Err(ConfigError::Invalid(format!(
                    "schedule=2bw coalesces each step's {m} micro-batches into one update, which \
                     needs at least as many micro-batches as stages (m ≥ p = {p}) for every \
                     micro-batch of a step to run on the same version"
                )));
            }
            AsyncRule::EveryStep
        }
        other => {
            return Err(ConfigError::Invalid(format!(
                "schedule={} is synchronous (`build`)",
                other.name()
            )))
        }
    };
    let mut lists = Vec::with_capacity(p);
    let mut versions = Vec::with_capacity(p);
    for s in 0..p {
        let mut list = Vec::with_capacity(3 * total);
        let mut next_update = 0;
        for a in one_f_one_b(p, s, total) {
            if let (AsyncRule::EveryStep, Action::Forward { mb, .. }) = (rule, a) {
                // 2BW: the update of step t just before the first forward of step t + 2.
                while next_update + 2 <= mb / m && mb % m == 0 {
                    list.push(Action::Update { step: next_update });
                    next_update += 1;
                }
            }
            list.push(a);
            if let (AsyncRule::EveryMicroBatch, Action::Backward { mb, .. }) = (rule, a) {
                list.push(Action::Update { step: mb });
            }
        }
        let updates = match rule {
            AsyncRule::EveryMicroBatch => total,
            AsyncRule::EveryStep => k,
        };
        if rule == AsyncRule::EveryStep {
            list.extend((next_update..updates).map(|step| Action::Update { step }));
        }
        versions.push(version_of_each(&list, total));
        lists.push(list);
    }
    Ok(PipelineSchedule {
        stages: p,
        micro_batches: total,
        chunks: 1,
        actions: lists,
        versions,
        micro_batches_per_update: match rule {
            AsyncRule::EveryMicroBatch => 1,
            AsyncRule::EveryStep => m,
        },
        sync_updates,
    })
}

/// The version every action of a stage's list uses: a forward the updates before it, its backward
/// the same, an update the version it makes.
fn version_of_each(list: &[Action], micro_batches: usize) -> Vec<usize> {
    let mut done = 0;
    let mut forward = vec![0; micro_batches];
    list.iter()
        .map(|a| match *a {
            Action::Forward { mb, .. } => {
                forward[mb] = done;
                done
            }
            Action::Backward { mb, .. } => forward[mb],
            Action::Update { .. } => {
                done += 1;
                done
            }
            _ => unreachable!("asynchronous lists hold forwards, backwards and updates"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{simulate, ActionCosts};

    fn versions_of(s: &PipelineSchedule, stage: usize, kind: char) -> Vec<(usize, usize)> {
        s.actions[stage]
            .iter()
            .zip(&s.versions[stage])
            .filter(|(a, _)| a.letter() == kind)
            .map(|(a, &v)| (a.mb(), v))
            .collect()
    }

    #[test]
    fn two_bw_runs_step_t_on_the_weights_of_step_t_minus_1_at_every_stage() {
        let (p, m, k) = (4, 8, 4);
        let s = build_async(Schedule::TwoBw, p, m, k, true).unwrap();
        for stage in 0..p {
            for (mb, v) in versions_of(&s, stage, 'F') {
                let t = mb / m;
                assert_eq!(v, t.saturating_sub(1), "stage {stage} F{mb}");
            }
            // Two versions at most: the current one and the one in-flight micro-batches read.
            assert!(s.peak_stashed_versions()[stage] <= 1, "stage {stage}");
        }
        simulate(&s, &[ActionCosts::uniform(1.0, 2.0)]).unwrap();
        assert!(build_async(Schedule::TwoBw, 4, 3, 2, true)
            .unwrap_err()
            .to_string()
            .contains("m ≥ p"));
    }

    #[test]
    fn the_simulator_refuses_versions_the_lists_do_not_imply() {
        let costs = [ActionCosts::uniform(1.0, 2.0)];
        let good = build_async(Schedule::PipeDream, 2, 2, 2, false).unwrap();
        // A backward that reads another version than its forward.
        let mut s = good.clone();
        let b = s.actions[0].iter().position(|a| a.letter() == 'B').unwrap();
        s.versions[0][b] += 1;
        let e = simulate(&s, &costs).unwrap_err().to_string();
        assert!(
            e.contains("stage 0") && e.contains("not its forward's"),
            "{e}"
        );
        // An update moved before the backward whose gradient it applies.
        let mut s = good.clone();
        let u = s.actions[1].iter().position(|a| a.letter() == 'U').unwrap();
        s.actions[1].swap(u - 1, u);
        s.versions[1].swap(u - 1, u);
        let e = simulate(&s, &costs).unwrap_err().to_string();
        assert!(
            e.contains("before the backwards of its micro-batches"),
            "{e}"
        );
        // A missing update.
        let mut s = good;
        let u = s.actions[0]
            .iter()
            .rposition(|a| a.letter() == 'U')
            .unwrap();
        s.actions[0].remove(u);
        s.versions[0].remove(u);
        let e = simulate(&s, &costs).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn pipedream_stashes_a_version_per_micro_batch_in_flight() {
        let (p, m, k) = (4, 4, 3);
        let s = build_async(Schedule::PipeDream, p, m, k, false).unwrap();
        for stage in 0..p {
            for (mb, v) in versions_of(&s, stage, 'F') {
                assert_eq!(v, mb.saturating_sub(p - stage - 1), "stage {stage} F{mb}");
            }
        }
        // p − s micro-batches in flight at stage s, each on its own version: p − s − 1 stashed
        // besides the current one; the last stage keeps one version.
        assert_eq!(s.peak_stashed_versions(), vec![3, 2, 1, 0]);
        let t = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)]).unwrap();
        // No flush between steps: the bubble is the one warm-up and drain.
        let once = (p - 1) as f64 / (m * k + p - 1) as f64;
        assert!(
            (t.bubble_fraction() - once).abs() < 1e-9,
            "{}",
            t.bubble_fraction()
        );
    }
}

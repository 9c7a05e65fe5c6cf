//! Pipeline schedules as data: for p stages, m micro-batches and v model chunks per stage, each stage
//! gets an ordered list of actions. The runtime executes these lists and the planner simulates them:
//! one source of truth. Chunk c of stage s is virtual stage c·p + s (Megatron's interleaving), so with
//! v = 1 the virtual stage is the stage.
//!
//! The asynchronous schedules (PipeDream, PipeDream-2BW; `asynchronous.rs`) span several optimizer
//! steps without a flush: their lists hold the updates too, and say which weight version every
//! forward and backward uses.

mod asynchronous;
mod generate;
mod partition;
mod simulate;

pub use asynchronous::{build_async, AsyncRule};
pub use generate::{build, MAX_ACTIONS};
pub use partition::StagePartition;
pub use simulate::{replay, simulate, ActionCosts, Event, Held, Timeline};

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Forward {
        mb: usize,
        chunk: usize,
    },
    /// Input and weight gradients together.
    Backward {
        mb: usize,
        chunk: usize,
    },
    /// Zero-bubble split: the input gradient (on the critical path)...
    BackwardInput {
        mb: usize,
        chunk: usize,
    },
    /// ...and the weight gradient, which can wait to fill a bubble.
    BackwardWeight {
        mb: usize,
        chunk: usize,
    },
    /// The stage's optimizer update number `step` (asynchronous schedules only; a synchronous
    /// schedule's one update follows its list), applying the gradients of that update's
    /// micro-batches.
    Update {
        step: usize,
    },
}

impl Action {
    /// What kind of work the action is, as traces and pictures name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Forward { .. } => "forward",
            Action::Backward { .. } => "backward",
            Action::BackwardInput { .. } => "backward_input",
            Action::BackwardWeight { .. } => "backward_weight",
            Action::Update { .. } => "update",
        }
    }
    /// The micro-batch (for an update: its number).
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
            Action::Update { step } => step,
        }
    }
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. } => chunk,
            Action::Update { .. } => 0,
        }
    }
    /// One letter, as PyTorch's pipelining prints them: F, B, I (input grad), W (weight grad); U
    /// for an asynchronous schedule's update.
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
            Action::Update { .. } => 'U',
        }
    }
}

impl fmt::Display for Action {
    /// `F3` (micro-batch 3) or `F3.1` (micro-batch 3 of chunk 1 when interleaved).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.letter(), self.mb())?;
        if self.chunk() > 0 {
            write!(f, ".{}", self.chunk())?;
        }
        Ok(())
    }
}

/// Per-stage action lists and the shape they were built for.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSchedule {
    pub stages: usize,
    /// Micro-batches in the lists (an asynchronous schedule's span: every step's).
    pub micro_batches: usize,
    pub chunks: usize,
    pub actions: Vec<Vec<Action>>,
    /// Asynchronous schedules: per stage, per action, the weight version it uses (a forward and
    /// its backward: the version the forward read; an update: the version it makes). Version k is
    /// the stage's weights after k updates of the list. Empty for synchronous schedules.
    pub versions: Vec<Vec<usize>>,
    /// Micro-batches whose gradients one update applies: update u applies micro-batches
    /// `u·n .. (u+1)·n` (synchronous schedules: all of them, after the list).
    pub micro_batches_per_update: usize,
    /// Whether an update waits for every stage's backwards of its micro-batches (the global norm
    /// of the gradients that clipping needs, a tied embedding's two halves), or only this stage's.
    pub sync_updates: bool,
}

impl PipelineSchedule {
    /// Whether the lists span optimizer updates (PipeDream, PipeDream-2BW).
    pub fn is_async(&self) -> bool {
        !self.versions.is_empty()
    }

    /// The update micro-batch `mb`'s gradient belongs to.
    pub fn update_of(&self, mb: usize) -> usize {
        mb / self.micro_batches_per_update.max(1)
    }

    /// Per stage, the most weight versions held at once besides the current one (weight stashing):
    /// the versions in-flight micro-batches read, at the moment of the list where they are most.
    pub fn peak_stashed_versions(&self) -> Vec<usize> {
        self.actions
            .iter()
            .zip(&self.versions)
            .map(|(list, versions)| {
                let mut current = 0;
                let mut in_flight: std::collections::HashMap<usize, usize> = Default::default();
                let mut peak = 0;
                for (a, &v) in list.iter().zip(versions) {
                    match a {
                        Action::Forward { mb, .. } => {
                            in_flight.insert(*mb, v);
                        }
                        Action::Backward { mb, .. } => {
                            in_flight.remove(mb);
                        }
                        Action::Update { .. } => current = v,
                        _ => {}
                    }
                    let mut old: Vec<usize> = in_flight
                        .values()
                        .copied()
                        .filter(|&x| x != current)
                        .collect();
                    old.sort_unstable();
                    old.dedup();
                    peak = peak.max(old.len());
                }
                peak
            })
            .collect()
    }

    /// A text chart: one row per stage, one column per action in list order.
    pub fn chart(&self) -> String {
        let mut out = String::new();
        for (s, list) in self.actions.iter().enumerate() {
            out.push_str(&format!("stage {s:>2} |"));
            for (i, a) in list.iter().enumerate() {
                match self.versions.get(s) {
                    // Asynchronous: the version each action reads (`F9@1`), or makes (`U1→2`).
                    Some(v) if matches!(a, Action::Update { .. }) => {
                        out.push_str(&format!(" {:<7}", format!("{a}→{}", v[i])))
                    }
                    Some(v) => out.push_str(&format!(" {:<7}", format!("{a}@{}", v[i]))),
                    None => out.push_str(&format!(" {a:<5}")),
                }
            }
            out.push('\n');
        }
        out
    }
}

//! Pipeline schedules as data: for p stages, m micro-batches and v model chunks per stage, each stage
//! gets an ordered list of actions. The runtime executes these lists and the planner simulates them:
//! one source of truth. Chunk c of stage s is virtual stage c·p + s (Megatron's interleaving), so with
//! v = 1 the virtual stage is the stage.

mod generate;
mod partition;
mod simulate;

pub use generate::{build, MAX_ACTIONS};
pub use partition::StagePartition;
pub use simulate::{replay, simulate, ActionCosts, Event, Timeline};

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
}

impl Action {
    /// What kind of work the action is, as traces and pictures name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Forward { .. } => "forward",
            Action::Backward { .. } => "backward",
            Action::BackwardInput { .. } => "backward_input",
            Action::BackwardWeight { .. } => "backward_weight",
        }
    }
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
        }
    }
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. } => chunk,
        }
    }
    /// One letter, as PyTorch's pipelining prints them: F, B, I (input grad), W (weight grad).
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
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
    pub micro_batches: usize,
    pub chunks: usize,
    pub actions: Vec<Vec<Action>>,
}

impl PipelineSchedule {
    /// A text chart: one row per stage, one column per action in list order.
    pub fn chart(&self) -> String {
        let mut out = String::new();
        for (s, list) in self.actions.iter().enumerate() {
            out.push_str(&format!("stage {s:>2} |"));
            for a in list {
                out.push_str(&format!(" {a:<5}"));
            }
            out.push('\n');
        }
        out
    }
}

//! Runs training: resolves the model and data, executes steps, evaluates, records metrics, saves.

mod source;
mod step;
mod train;

pub use crate::memory::MemoryTerms;
pub use source::{resolve_model, ModelSource};
pub use step::{check_layout_runnable, layout_step, layout_step_on, run_step, StepOutput};
pub use train::{train, StepReport, TrainConfig, TrainSummary};

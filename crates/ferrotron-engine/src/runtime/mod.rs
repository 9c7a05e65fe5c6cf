//! Runs training: resolves the model and data, executes steps, evaluates, records metrics, saves.

mod checkpointing;
mod mesh_train;
mod source;
mod step;
mod train;

pub use crate::memory::MemoryTerms;
pub use source::{resolve_model, ModelSource};
pub use step::{layout_step, layout_step_on, run_step, StepOutput};
pub use train::{
    parse_bytes, plan_input, resolve_layout, train, DeviceSummary, StepReport, TrainConfig,
    TrainSummary,
};

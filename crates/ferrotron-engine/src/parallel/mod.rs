//! Running a model split over devices. Each parallel dimension has its own file; the model code knows
//! nothing of them.

mod pipeline;
pub mod tensor;

pub use pipeline::{pipeline_step, pipeline_steps, DeviceResult, MeshStep, PipelineRun};
pub use tensor::{TpGroup, TpShard};

//! Running a model split over devices. Each parallel dimension has its own file; the model code knows
//! nothing of them.

pub mod context;
pub mod data;
mod expert;
mod mesh;
mod pipedream;
mod pipeline;
pub mod slice;
pub mod tensor;
pub mod weights;

pub use context::ContextShard;
pub use mesh::{
    pipeline_step, pipeline_steps, pipeline_steps_of, Device, LossScaling, MeshStep, Resume,
    StepReport, Training,
};
pub use pipeline::{action_event, DeviceResult, PipelineRun};
pub use tensor::{TpGroup, TpShard};
pub use weights::WeightSource;

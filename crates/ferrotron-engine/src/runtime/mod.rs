//! Runs training: settings (`config`), the planner's view and the layouts to try (`resolve`), the
//! run (`train`) on a world of threads or MPI ranks (`world`), what every device does
//! (`device_loop`), what is reported (`metrics`), checkpoints (`checkpointing`).

mod checkpointing;
mod config;
mod delayed;
mod device_loop;
mod effective_batch;
mod hang;
mod lora_run;
mod metrics;
pub mod preemption;
pub mod rank_status;
mod resolve;
mod run_dir;
mod step;
mod train;
mod training_run;
mod world;

pub use crate::memory::MemoryTerms;
pub use crate::model_source::{engine_preset, resolve_model, ModelSource};
pub use config::{parse_bytes, TrainConfig};
pub use delayed::DelayedReference;
pub use metrics::{keep_steps_up_to, DeviceSummary, StepReport};
pub use resolve::{cluster_for_job, plan_input, resolve_layout};
pub use step::{layout_step, layout_step_of, layout_step_on, run_step, train_steps, StepOutput};
pub use train::{train, TrainSummary};
pub use world::{launcher_rank, World};

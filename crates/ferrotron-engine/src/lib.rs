//! The engine: kernels, the single-device model executor, optimizer, data pipeline, Hugging Face I/O
//! and the training loop.

pub mod error;
pub mod hf;
pub mod kernels;
pub mod transformer;

pub use error::{EngineError, Result};
pub mod comm;
pub mod data;
pub mod optim;
pub mod parallel;
pub mod runtime;

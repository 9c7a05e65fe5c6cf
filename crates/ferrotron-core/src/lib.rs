//! The light half of ferrotron: what a model is (shapes, names, FLOPs, bytes) and what a cluster is.
//! Pure computation with no heavy dependencies, so planners and other tools can link it cheaply.

pub mod bounded;
pub mod error;
pub mod layout;
pub mod model;
pub mod plan;
pub mod precision;
pub mod rank;
pub mod schedule;
pub mod text_value;
pub mod topology;

pub use error::{ConfigError, Result};

pub mod backend;
pub mod bench;
pub mod grads;
pub mod plan;
pub mod schedule;
pub mod train;
pub mod verify;

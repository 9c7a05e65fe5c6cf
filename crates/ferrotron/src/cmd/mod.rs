pub mod bench;
pub mod grads;
pub mod train;

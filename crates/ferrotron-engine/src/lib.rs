//! The engine: kernels, the single-device model executor, optimizer, data pipeline, Hugging Face I/O
//! and the training loop.

/// The 16-bit float types the public interfaces take (bf16 compute copies).
pub use half;
pub mod error;
mod half_storage;
pub mod hf;
pub mod kernels;
pub mod lora;
pub mod memory;
pub mod model_source;
pub mod transformer;

pub use error::{EngineError, Result};
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod dir_lock;
pub mod optim;
pub mod parallel;
pub mod paths;
mod pieces;
pub mod runtime;
pub mod storage;

/// Training frees and reallocates the same large activation buffers every step. glibc would hand them
/// back to the kernel and fault every page in again; keep them in the heap instead. Call once, early,
/// before other threads start.
pub fn keep_freed_memory_in_process() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}

//! Measuring this machine: the peaks of its cores (`peak`), the kernels at a model's shapes
//! (`kernel_bench`) and attention at one (`attention_bench`), and what one device of the threads
//! backend does on it, fitted into the `this-machine` cluster file (`this_machine`).

pub mod attention_bench;
pub mod kernel_bench;
pub mod peak;
pub mod this_machine;

use anyhow::{Context, Result};
use ferrotron_core::topology::Cluster;
use std::path::Path;

/// Writes a cluster file atomically (a temporary beside it, then renamed).
pub fn write_cluster(path: &Path, c: &Cluster, header: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, c.to_toml(header))
        .with_context(|| format!("{}: cannot write", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot write", path.display()))?;
    println!(
        "cluster file: {} (use it as --cluster {})",
        path.display(),
        path.display()
    );
    Ok(())
}

//! What every way of writing a checkpoint shares: the files' hashes and the crash drills.

use crate::error::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Testing: `point@step` (e.g. `manifest@2`) aborts the process at that point of the save of that
/// step: `rank-file` (a rank file half written), `manifest` (rank files complete, no manifest),
/// `rename` (manifest written, not renamed), `latest` (renamed, `latest` not yet replaced).
pub const CRASH_ENV: &str = "FERROTRON_CHECKPOINT_CRASH";

pub(super) fn crash_point(point: &str, step: usize) -> bool {
    std::env::var(CRASH_ENV).is_ok_and(|v| v == format!("{point}@{step}"))
}

pub(super) fn crash_at(point: &str, step: usize) {
    if crash_point(point, step) {
        eprintln!("{CRASH_ENV}: aborting at `{point}` of the save of step {step}");
        std::process::abort();
    }
}

/// The SHA-256 of a file, read in blocks.
pub(super) fn sha256_file(file: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(file).map_err(|e| EngineError::io(file, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 22];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| EngineError::io(file, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    let hex = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((total, hex))
}

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

/// The hex SHA-256 of `bytes`.
pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Arrays are hashed in blocks of this many bytes (the last one shorter): a reader of part of an
/// array fetches and checks only the blocks it touches.
pub(super) const HASH_BLOCK_BYTES: usize = 256 << 10;

/// The SHA-256 of each block of `bytes`, concatenated (hex).
pub(super) fn block_hashes(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return sha256_hex(bytes);
    }
    bytes.chunks(HASH_BLOCK_BYTES).map(sha256_hex).collect()
}

/// The metadata key of a rank file that holds array `key`'s block hashes.
pub(super) fn array_sha_key(key: &str) -> String {
    format!("sha256:{key}")
}

/// The SHA-256 of a safetensors file's header: its 8-byte length and its JSON.
pub(super) fn header_sha256(file: &Path) -> Result<String> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).map_err(|e| EngineError::io(file, e))?;
    let mut len = [0u8; 8];
    f.read_exact_at(&mut len, 0)
        .map_err(|e| EngineError::io(file, e))?;
    let n = u64::from_le_bytes(len);
    let size = f.metadata().map_err(|e| EngineError::io(file, e))?.len();
    if n > size.saturating_sub(8) {
        return Err(EngineError::format(
            file,
            format!("a header of {n} bytes in a file of {size}"),
        ));
    }
    let mut head = vec![0u8; 8 + n as usize];
    f.read_exact_at(&mut head, 0)
        .map_err(|e| EngineError::io(file, e))?;
    Ok(sha256_hex(&head))
}

//! Test directories that earlier runs left behind: each test process names its directories with
//! its process id and keeps them (a failing test's files are what one reads to see why), so every
//! run of the suite left them in the temporary directory for good — 286 directories, 1.4 GB a run.
//! The first directory a test process asks for removes those of its own kind whose process is no
//! longer running. Where there is no `/proc` (not Linux) nothing is removed.

use std::path::Path;

/// Once per process: removes each directory in the temporary directory named `prefix…-PID` whose
/// process `PID` no longer runs (never this process's, never another name's).
pub fn remove_stale(prefix: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !Path::new("/proc/self").exists() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(prefix) else {
                continue;
            };
            let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            let running = Path::new(&format!("/proc/{pid}")).exists();
            if pid != std::process::id() && !running {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

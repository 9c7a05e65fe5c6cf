//! What a rank of a launched job says about its own end, for `ferrotron launch` to tell the hosts
//! that died from those that were stopped: with `FERROTRON_RANK_STATUS=DIR` set, rank r writes
//! `DIR/rank-r` when it starts (its host and process), then one more line as it ends — `finished`,
//! `error: …` (the error names the peer it lost or waited for in vain), or `terminated` (a signal
//! from mpirun ending the job). A rank whose file still says `running` after the job is gone ended
//! without a word: it was killed, with its host.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, Ordering};

/// The directory `launch` names through the environment.
pub const ENV: &str = "FERROTRON_RANK_STATUS";

/// The open status file of this process (-1: none), for the signal handler.
static FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_terminate(signal: libc::c_int) {
    let fd = FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let msg = b"terminated\n";
        // SAFETY: write(2) on an open descriptor is async-signal-safe.
        unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
    }
    // SAFETY: _exit is async-signal-safe; the conventional status of death by this signal.
    unsafe { libc::_exit(128 + signal) };
}

/// Starts this rank's status file when the job runs under `launch`.
pub fn start(rank: usize) {
    let Ok(dir) = std::env::var(ENV) else { return };
    let dir = std::path::PathBuf::from(dir);
    let _ = std::fs::create_dir_all(&dir);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let Ok(mut f) = std::fs::File::create(dir.join(format!("rank-{rank}"))) else {
        return;
    };
    let _ = writeln!(f, "rank {rank} host {host} pid {}", std::process::id());
    let _ = writeln!(f, "running");
    FD.store(f.as_raw_fd(), Ordering::Relaxed);
    std::mem::forget(f); // open for the rest of the process, for the handler
                         // SAFETY: installs a handler that only writes to an open descriptor and exits.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_terminate as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_terminate as *const () as libc::sighandler_t,
        );
    }
}

/// Records how this rank ends (`finished`, or `error: …`).
pub fn note(line: &str) {
    let fd = FD.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    let text = format!("{}\n", line.replace('\n', " "));
    // SAFETY: the descriptor stays open for the process's life (see `start`).
    unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
}

//! Graceful preemption: schedulers send SIGTERM (and people press Ctrl-C, SIGINT) some time before
//! they kill. The first such signal is only noted here; the training loop sees it at the end of a
//! step, every device agrees on it in the step's closing all-reduce, and the run writes a checkpoint
//! of that step and exits 128 + the signal (143, 130). A second signal exits at once.

use std::sync::atomic::{AtomicI32, Ordering};

/// The first stopping signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Only async-signal-safe work: an atomic swap, and `_exit` on the second signal.
    if RECEIVED.swap(signal, Ordering::SeqCst) != 0 {
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Installs the handlers for SIGTERM and SIGINT (once per process; later calls do nothing).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for signal in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: a zeroed sigaction with a plain handler is valid; the handler only does
            // async-signal-safe work.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
    });
}

/// The stopping signal this process received, if any.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

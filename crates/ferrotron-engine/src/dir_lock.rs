//! An advisory lock on a directory that a run (or an offline checkpoint tool) writes: a file
//! naming its holder (pid, host, when, what), made atomically before anything in the directory is
//! read or written, removed when the holder finishes. Two writers in one directory would mix two
//! runs' metrics and checkpoints, and `--overwrite` would delete a living run's files; the lock
//! refuses the second one, naming the first.
//!
//! A holder that died without releasing it (killed, its host rebooted) leaves a stale lock: on the
//! holder's own host that is told by its pid (and the pid's start time, so a reused pid is not
//! mistaken for it), and the caller decides whether it may be taken over. A lock held on another
//! host cannot be checked from here: it is refused, and the message says how to remove it.

use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The lock's file name inside the directory it locks.
pub const LOCK_FILE: &str = ".ferrotron.lock";

/// Who holds a lock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// Seconds since the Unix epoch when the lock was taken.
    pub since: u64,
    /// The process's start time in clock ticks since boot (Linux), to tell a reused pid apart.
    pub process_start: Option<u64>,
    /// What holds it: `train`, `checkpoint reshard`, ….
    pub what: String,
}

impl Holder {
    fn me(what: &str) -> Holder {
        let pid = std::process::id();
        Holder {
            pid,
            host: host_name(),
            since: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            process_start: process_start(pid),
            what: what.to_string(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "`{}` (pid {} on host {}, since {} s ago)",
            self.what,
            self.pid,
            self.host,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
                .saturating_sub(self.since)
        )
    }

    /// Whether the holder still runs: `Some` on its own host, `None` elsewhere (cannot tell).
    fn alive(&self) -> Option<bool> {
        if self.host != host_name() {
            return None;
        }
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return Some(false);
        };
        if pid <= 0 {
            return Some(false);
        }
        // SAFETY: signal 0 only checks that the process exists and may be signalled.
        let exists = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        Some(
            exists
                && (self.process_start.is_none() || process_start(self.pid) == self.process_start),
        )
    }
}

/// What a lock found held by a holder that is gone may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// Refuse, saying which flag would take it over.
    Refuse(&'static str),
    /// Take it over (saying so on stderr).
    TakeOver,
}

/// A held lock; dropping it releases the directory.
#[derive(Debug)]
pub struct DirLock {
    path: PathBuf,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Only our own lock: if someone took it over (it went stale under a frozen process), it is
        // theirs now.
        if read_holder(&self.path).is_some_and(|h| h.pid == std::process::id()) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Locks `dir` (created if missing) for `what`. A lock held by a live process is refused, naming
/// it; one held on another host too; a stale one as `stale` says.
pub fn acquire(dir: &Path, what: &str, stale: Stale) -> Result<DirLock> {
    if dir.exists() && !dir.is_dir() {
        return Err(EngineError::Invalid(format!(
            "`{}` is a file, not a directory: `{what}` writes a directory there; give another path",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let path = dir.join(LOCK_FILE);
    let me = Holder::me(what);
    let text = serde_json::to_string(&me).expect("a holder serialises");
    // Two attempts: the second after taking over a stale lock (a third writer racing us for it
    // then wins, and we report it).
    for _ in 0..2 {
        if create_with(&path, &text).map_err(|e| EngineError::io(&path, e))? {
            return Ok(DirLock { path });
        }
        let Some(holder) = read_holder(&path) else {
            // Being written by a writer that won the race just now (or garbled): not ours.
            return Err(EngineError::Invalid(format!(
                "`{}` is locked by another ferrotron process (its lock file {} is unreadable); if no run uses the directory, delete that file",
                dir.display(),
                path.display()
            )));
        };
        match (holder.alive(), stale) {
            (Some(true), _) => {
                return Err(EngineError::Invalid(format!(
                    "`{}` is in use by {}: wait for it to finish or stop it, or use another directory",
                    dir.display(),
                    holder.describe()
                )))
            }
            (None, _) => {
                return Err(EngineError::Invalid(format!(
                    "`{}` is locked by {}, which cannot be checked from this host; if that run is gone, delete {}",
                    dir.display(),
                    holder.describe(),
                    path.display()
                )))
            }
            (Some(false), Stale::Refuse(flag)) => {
                return Err(EngineError::Invalid(format!(
                    "`{}` holds the lock of {}, which is gone: it stopped without finishing; {flag}",
                    dir.display(),
                    holder.describe()
                )))
            }
            (Some(false), Stale::TakeOver) => {
                eprintln!(
                    "note: taking over the lock of {} on `{}`: that process is gone",
                    holder.describe(),
                    dir.display()
                );
                std::fs::remove_file(&path).map_err(|e| EngineError::io(&path, e))?;
            }
        }
    }
    Err(EngineError::Invalid(format!(
        "`{}` was locked by another process while this one took over its stale lock; try again when it is free",
        dir.display()
    )))
}

/// Creates `path` holding `text`, atomically: the file appears whole or not at all (written
/// beside it, then hard-linked into place, which fails if it exists). False if it exists.
fn create_with(path: &Path, text: &str) -> std::io::Result<bool> {
    use std::io::Write;
    // Unique per process and call: threads of one process may race for the same lock.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("lock.{}.{call}.tmp", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        // A file system without hard links: create-new, then write (a reader racing the write
        // sees an unreadable lock and is refused, which is safe).
        Err(_) => match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(mut f) => f.write_all(text.as_bytes()).map(|()| true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        },
    }
}

/// The holder a lock file names, if it can be read.
pub fn read_holder(path: &Path) -> Option<Holder> {
    let text =
        ferrotron_core::bounded::read_to_string(path, ferrotron_core::bounded::SMALL).ok()?;
    serde_json::from_str(&text).ok()
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; the name is NUL-terminated when it fits.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".to_string()
    }
}

/// A process's start time (field 22 of `/proc/<pid>/stat`), where there is a `/proc`.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from its end.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferrotron-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_holder_is_refused_and_the_lock_goes_with_the_first() {
        let d = dir("second");
        let first = acquire(&d, "train", Stale::Refuse("x")).unwrap();
        let e = acquire(&d, "checkpoint reshard", Stale::TakeOver)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("in use by `train`") && e.contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        assert_eq!(read_holder(&d.join(LOCK_FILE)).unwrap().alive(), Some(true));
        drop(first);
        assert!(!d.join(LOCK_FILE).exists());
        assert!(acquire(&d, "train", Stale::Refuse("x")).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_stale_lock_is_reported_and_taken_over_only_when_allowed() {
        let d = dir("stale");
        std::fs::create_dir_all(&d).unwrap();
        // A pid that cannot be running: beyond the kernel's largest (2²²).
        let gone = Holder {
            pid: 999_999_999,
            ..Holder::me("train")
        };
        std::fs::write(d.join(LOCK_FILE), serde_json::to_string(&gone).unwrap()).unwrap();
        assert_eq!(gone.alive(), Some(false));
        let e = acquire(&d, "train", Stale::Refuse("replace it with --overwrite"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("which is gone") && e.contains("--overwrite"),
            "{e}"
        );
        let taken = acquire(&d, "train", Stale::TakeOver).unwrap();
        assert_eq!(
            read_holder(&d.join(LOCK_FILE)).unwrap().pid,
            std::process::id()
        );
        drop(taken);
        // Another host's lock cannot be checked: refused, with the way out.
        let elsewhere = Holder {
            host: "elsewhere.example".into(),
            ..Holder::me("train")
        };
        std::fs::write(
            d.join(LOCK_FILE),
            serde_json::to_string(&elsewhere).unwrap(),
        )
        .unwrap();
        let e = acquire(&d, "train", Stale::TakeOver)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("elsewhere.example") && e.contains("delete"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn concurrent_takers_get_exactly_one_lock() {
        let d = dir("race");
        for _ in 0..20 {
            let won: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|_| s.spawn(|| acquire(&d, "train", Stale::Refuse("x"))))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(won.iter().filter(|r| r.is_ok()).count(), 1);
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

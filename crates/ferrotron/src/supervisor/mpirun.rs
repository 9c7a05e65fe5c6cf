//! The `mpirun` a launch drives: the job started on some hosts (one rank per slot, mapped by slot,
//! each rank told where to write its status), a host probed, and `train`'s arguments rewritten.

use super::hosts::Host;
use anyhow::{Context, Result};
use ferrotron_engine::runtime::rank_status;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// mpirun and the arguments the user gave it, and how long a probe may take.
pub(crate) struct Mpirun {
    pub base: Vec<String>,
    pub probe_timeout: f64,
}

/// Placement flags launch sets itself: a user's would break its rank-to-host map.
const PLACEMENT_FLAGS: [&str; 11] = [
    "-np",
    "-n",
    "--np",
    "-c",
    "--host",
    "-H",
    "--hostfile",
    "--machinefile",
    "--map-by",
    "--bynode",
    "--byslot",
];

impl Mpirun {
    /// `mpirun` (as words) with `args` (as words), refusing placement flags and a probe timeout
    /// that is not a positive number.
    pub(crate) fn new(mpirun: &str, args: &str, probe_timeout: f64) -> Result<Self> {
        for w in words(args) {
            let flag = w.split('=').next().unwrap_or("");
            if PLACEMENT_FLAGS.contains(&flag) {
                anyhow::bail!("--mpirun-args `{w}`: launch sets the ranks and their placement itself (one rank per hostfile slot, by slot, which is how it maps a rank to its host); drop it");
            }
        }
        if !(probe_timeout.is_finite() && probe_timeout > 0.0) {
            anyhow::bail!("--probe-timeout {probe_timeout}: must be a positive number of seconds");
        }
        let mut base = words(mpirun);
        base.extend(words(args));
        Ok(Self {
            base,
            probe_timeout,
        })
    }

    /// Whether a process can be started on `host` within the probe timeout.
    pub(crate) fn probe(&self, host: &str, exe: &Path) -> bool {
        let mut w = self.base.clone();
        w.extend(["-np", "1", "--host", host].map(String::from));
        w.push(exe.display().to_string());
        w.push("--version".into());
        let Ok(mut child) = Command::new(&w[0])
            .args(&w[1..])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        let deadline = Instant::now() + Duration::from_secs_f64(self.probe_timeout);
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return false;
                }
            }
        }
    }

    /// Starts `exe train ARGS` on `hosts`, one rank per slot, each writing its status under
    /// `statuses`; stdout and stderr piped.
    pub(crate) fn spawn(
        &self,
        hosts: &[Host],
        exe: &Path,
        train: &[String],
        statuses: &Path,
    ) -> Result<Child> {
        let mut w = self.base.clone();
        w.extend([
            "-x".to_string(),
            format!("{}={}", rank_status::ENV, statuses.display()),
        ]);
        let np: usize = hosts.iter().map(|h| h.slots).sum();
        let list: Vec<String> = hosts
            .iter()
            .map(|h| format!("{}:{}", h.name, h.slots))
            .collect();
        w.extend([
            "-np".to_string(),
            np.to_string(),
            "--host".into(),
            list.join(","),
        ]);
        w.extend(["--map-by", "slot"].map(String::from));
        w.push(exe.display().to_string());
        w.push("train".into());
        w.extend(train.iter().cloned());
        Command::new(&w[0])
            .args(&w[1..])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run `{}`", w[0]))
    }
}

/// The words of `s` (whitespace-separated).
pub(crate) fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

/// `train`'s arguments with `flag value` set (replaced when given, appended when not).
pub(crate) fn with_flag(train: &[String], flag: &str, value: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(train.len() + 2);
    let mut i = 0;
    let mut set = false;
    while i < train.len() {
        let w = &train[i];
        if w == flag {
            out.extend([flag.to_string(), value.to_string()]);
            i += 2;
            set = true;
            continue;
        }
        if let Some(v) = w.strip_prefix(&format!("{flag}=")) {
            let _ = v;
            out.push(format!("{flag}={value}"));
            set = true;
        } else {
            out.push(w.clone());
        }
        i += 1;
    }
    if !set {
        out.extend([flag.to_string(), value.to_string()]);
    }
    out
}

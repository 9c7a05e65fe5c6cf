//! The relaunch supervisor behind `ferrotron launch`: it runs a training job through `mpirun`, one
//! rank per host slot, and survives hosts that die. When the job fails it finds the hosts that are
//! gone — those the ranks' and mpirun's errors name (`findings.rs`), and those a probe cannot start
//! a process on (`mpirun.rs`) — drops them, plans a layout for the devices that remain (`auto`, or
//! the relayout rule; the global batch is kept), and relaunches from the latest complete
//! checkpoint. Every event goes to `<out_dir>/events.jsonl` (`events.rs`).
//!
//! Checkpoints are assumed to be on a filesystem every host shares (as the out directory is).

mod events;
mod findings;
mod hosts;
mod mpirun;
#[cfg(test)]
mod tests;

pub use hosts::{parse_hostfile, Host};
pub(crate) use mpirun::Mpirun;

use anyhow::{bail, Context, Result};
use events::{forward, Events, ResumeWatch};
use ferrotron_engine::checkpoint::Checkpoint;
use ferrotron_engine::runtime::TrainConfig;
use findings::{rank_ends, read_statuses, Findings};
use hosts::cluster_of;
pub(crate) use mpirun::with_flag;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A launch: where it runs, what it runs, and how it relaunches.
pub(crate) struct Supervisor {
    pub hosts: Vec<Host>,
    pub mpirun: Mpirun,
    /// `train`'s arguments (without `train`; `--backend mpi` set).
    pub train: Vec<String>,
    /// The run those arguments describe.
    pub cfg: TrainConfig,
    /// The layout of a relaunch on fewer devices (`auto`, or a layout with `auto` keys).
    pub relayout: String,
    pub max_restarts: usize,
}

/// One attempt of the job, ended.
struct Attempt {
    status: ExitStatus,
    /// Everything the job printed.
    output: String,
    started: Instant,
    statuses: PathBuf,
}

impl Supervisor {
    /// Runs the job until it finishes, relaunching after each host failure.
    pub(crate) fn run(mut self) -> Result<()> {
        let exe = std::env::current_exe().context("cannot find this program")?;
        let out_dir = &self.cfg.checkpointing.out_dir;
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("{}: cannot create", out_dir.display()))?;
        let events = Arc::new(Events {
            path: out_dir.join("events.jsonl"),
        });
        let mut command = match cluster_of(&self.cfg, &self.hosts) {
            Some(c) => with_flag(&self.train, "--cluster", &c),
            None => self.train.clone(),
        };
        events.record(
            "start",
            serde_json::json!({
                "hosts": self.hosts.iter().map(|h| &h.name).collect::<Vec<_>>(),
                "devices": self.devices(),
                "layout": self.cfg.parallelism.layout,
                "out_dir": self.cfg.checkpointing.out_dir,
            }),
        )?;
        let (mut restarts, launched) = (0, Instant::now());
        let mut watch: Option<ResumeWatch> = None;
        loop {
            let attempt = self.attempt(&exe, &command)?;
            drop(watch.take());
            if attempt.status.success() {
                return events.record(
                    "finished",
                    serde_json::json!({
                        "restarts": restarts,
                        "seconds": launched.elapsed().as_secs_f64(),
                        "last_attempt_seconds": attempt.started.elapsed().as_secs_f64(),
                    }),
                );
            }
            let failed_at = Instant::now();
            let gone = self.diagnose(&attempt, &exe, &events)?;
            if restarts >= self.max_restarts {
                bail!(
                    "the job failed again after {restarts} relaunches (--max-restarts {})",
                    self.max_restarts
                );
            }
            let released = self.release_lock_of_failed_job()?;
            self.hosts.retain(|h| !gone.contains(&h.name));
            if self.hosts.is_empty() {
                bail!("no host is left to relaunch on");
            }
            restarts += 1;
            let resume_step;
            (command, resume_step) = self.relaunch_command(restarts, &events, &released)?;
            // The failed run's steps past its checkpoint go now (the relaunched run would drop
            // them anyway): what the watch sees appended is the relaunched run's.
            let metrics = self.cfg.checkpointing.out_dir.join("metrics.jsonl");
            ferrotron_engine::runtime::keep_steps_up_to(&metrics, resume_step)?;
            // Records `resumed` while the relaunched job runs (replacing, and so ending, the last).
            watch = Some(ResumeWatch::start(
                self.cfg.checkpointing.out_dir.join("metrics.jsonl"),
                resume_step,
                failed_at,
                events.clone(),
            ));
        }
    }

    /// The failed job's rank 0 may have died holding the run directory's lock (or be alive on a
    /// host cut off from the rest, where no check from here can reach it): mpirun has exited, so
    /// the job is over, and a lock its own hosts took for `train` is released for the relaunch.
    /// The directories released (the relaunch event lists them).
    fn release_lock_of_failed_job(&self) -> Result<Vec<std::path::PathBuf>> {
        let out = &self.cfg.checkpointing.out_dir;
        let mut released = Vec::new();
        for dir in [out.clone(), self.cfg.checkpoint_root()] {
            let lock = dir.join(ferrotron_engine::dir_lock::LOCK_FILE);
            let Some(holder) = ferrotron_engine::dir_lock::read_holder(&lock) else {
                continue;
            };
            if holder.what == "train" && self.hosts.iter().any(|h| h.name == holder.host) {
                std::fs::remove_file(&lock)
                    .with_context(|| format!("{}: cannot remove", lock.display()))?;
                released.push(dir);
            }
        }
        Ok(released)
    }

    fn devices(&self) -> usize {
        self.hosts.iter().map(|h| h.slots).sum()
    }

    /// Runs the job once on the hosts, its output forwarded and kept.
    fn attempt(&self, exe: &std::path::Path, command: &[String]) -> Result<Attempt> {
        let started = Instant::now();
        let statuses = self.cfg.checkpointing.out_dir.join(".ranks");
        let _ = std::fs::remove_dir_all(&statuses);
        std::fs::create_dir_all(&statuses)
            .with_context(|| format!("{}: cannot create", statuses.display()))?;
        let mut child = self.mpirun.spawn(&self.hosts, exe, command, &statuses)?;
        let kept = Arc::new(Mutex::new(String::new()));
        forward(child.stdout.take().expect("piped"), false, kept.clone());
        forward(child.stderr.take().expect("piped"), true, kept.clone());
        let status = child.wait().context("waiting for mpirun")?;
        // Let the forwarding threads finish the job's last words.
        std::thread::sleep(Duration::from_millis(200));
        let output = kept.lock().expect("no panics").clone();
        Ok(Attempt {
            status,
            output,
            started,
            statuses,
        })
    }

    /// The hosts a failed attempt lost (an error when it lost none: not a host failure), recorded
    /// as the `failure` event.
    fn diagnose(
        &self,
        attempt: &Attempt,
        exe: &std::path::Path,
        events: &Events,
    ) -> Result<BTreeSet<String>> {
        let rank_host: Vec<String> = self
            .hosts
            .iter()
            .flat_map(|h| std::iter::repeat_n(h.name.clone(), h.slots))
            .collect();
        let ends = read_statuses(&attempt.statuses, rank_host.len());
        let none_started = ends.iter().all(|e| e.text.is_none());
        let texts: Vec<Option<String>> = ends.iter().map(|e| e.text.clone()).collect();
        let mut found = Findings::read(&attempt.output, &texts, &rank_host);
        for h in &self.hosts {
            if !found.gone.iter().any(|g| g.0 == h.name) && !self.mpirun.probe(&h.name, exe) {
                found.add_gone(
                    &h.name,
                    format!(
                        "a probe could not start a process on it within {} s",
                        self.mpirun.probe_timeout
                    ),
                );
            }
        }
        let all_gone = self
            .hosts
            .iter()
            .all(|h| found.gone.iter().any(|g| g.0 == h.name));
        if none_started && all_gone {
            // Not one rank started and not one probe either, on any host: mpirun itself cannot
            // start a process (it refused, or cannot find a program). That is not a host failure,
            // and relaunching on fewer hosts would not mend it.
            let said: Vec<&str> = attempt.output.lines().rev().take(12).collect();
            let said: Vec<&str> = said.into_iter().rev().collect();
            events.record(
                "launch_failed",
                serde_json::json!({"exit_code": attempt.status.code(), "last_output": said}),
            )?;
            bail!(
                "mpirun could not start the job (exit {:?}): no rank and no probe started on any host, so no host is taken for gone; fix what mpirun says (`--mpirun`, `--mpirun-args`):\n{}",
                attempt.status.code(),
                said.join("\n")
            );
        }
        found.settle(&self.hosts);
        let last_lines: Vec<&str> = attempt.output.lines().rev().take(6).collect();
        let gone_json: Vec<_> = found
            .gone
            .iter()
            .map(|(h, how)| serde_json::json!({"host": h, "how": how}))
            .collect();
        events.record(
            "failure",
            serde_json::json!({
                "exit_code": attempt.status.code(),
                "ranks": rank_ends(&ends, &rank_host),
                "gone": gone_json,
                "last_output": last_lines.into_iter().rev().collect::<Vec<_>>(),
            }),
        )?;
        if found.gone.is_empty() {
            let why = match found.other_errors.first() {
                Some(e) => format!(": {e}"),
                None => " (see its output above)".to_string(),
            };
            bail!(
                "the job failed (exit {:?}) with every host alive: not a host failure, so it is not relaunched{why}",
                attempt.status.code()
            );
        }
        Ok(found.gone.into_iter().map(|g| g.0).collect())
    }

    /// `train`'s arguments for relaunch `attempt` on the hosts left — the relayout rule, their
    /// cluster, and the latest checkpoint to resume (or a fresh start when nothing was saved) — and
    /// the step it resumes at, recorded as the `relaunch` event.
    fn relaunch_command(
        &self,
        attempt: usize,
        events: &Events,
        locks_released: &[std::path::PathBuf],
    ) -> Result<(Vec<String>, usize)> {
        let checkpoints = self.cfg.checkpoint_root();
        let resume = Checkpoint::open(&checkpoints).ok();
        let mut next = with_flag(&self.train, "--layout", &self.relayout);
        if let Some(c) = cluster_of(&self.cfg, &self.hosts) {
            next = with_flag(&next, "--cluster", &c);
        }
        let resume_step = match &resume {
            Some(ck) => {
                next = with_flag(&next, "--resume", &checkpoints.display().to_string());
                ck.manifest.step
            }
            None => {
                // Nothing was saved: the run starts over in its own directory.
                next.push("--overwrite".into());
                0
            }
        };
        events.record(
            "relaunch",
            serde_json::json!({
                "attempt": attempt,
                "hosts": self.hosts.iter().map(|h| &h.name).collect::<Vec<_>>(),
                "devices": self.devices(),
                "layout": self.relayout,
                "resume_from": resume.as_ref().map(|ck| ck.dir.display().to_string()),
                "resume_step": resume_step,
                "locks_released": locks_released,
            }),
        )?;
        Ok((next, resume_step))
    }
}

//! `ferrotron launch`: runs a training job through `mpirun`, one rank per host slot, and survives
//! hosts that die. When the job fails it finds the hosts that are gone — those the ranks' and
//! mpirun's errors name, and those a probe cannot start a process on — drops them, plans a layout for
//! the devices that remain (`auto`, or the `--relayout` rule; the global batch is kept), and
//! relaunches from the latest complete checkpoint. Every event goes to `<out_dir>/events.jsonl`.
//!
//! Checkpoints are assumed to be on a filesystem every host shares (as the out directory is).

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotron_engine::runtime::{rank_status, TrainConfig};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct LaunchArgs {
    /// OpenMPI's hostfile: a host a line, `h1 slots=2` (slots default to 1; `#` starts a comment).
    #[arg(long)]
    hostfile: PathBuf,
    /// Relaunches after failures before giving up.
    #[arg(long, default_value_t = 3)]
    max_restarts: usize,
    /// The mpirun to run, as words (e.g. `ip netns exec mpihead mpirun`).
    #[arg(long, default_value = "mpirun")]
    mpirun: String,
    /// Arguments for mpirun before the ones launch adds (`-np`, `--host`, `--map-by slot`), as words.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    mpirun_args: String,
    /// The layout of a relaunch on fewer devices: `auto` (the planner's choice for them), or a
    /// layout whose `auto` keys the planner fills (`tp=2,dp=auto,pp=auto`).
    #[arg(long, default_value = "auto")]
    relayout: String,
    /// Seconds a probe of a host may take before the host counts as gone.
    #[arg(long, default_value_t = 15.0)]
    probe_timeout: f64,
    /// `train` and its arguments (`--backend mpi` is implied).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// One host of the hostfile and its slots (devices).
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub name: String,
    pub slots: usize,
}

/// OpenMPI's hostfile format: `name [slots=N]` a line.
pub fn parse_hostfile(text: &str, file: &Path) -> Result<Vec<Host>> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words
            .next()
            .expect("a non-empty line has a word")
            .to_string();
        let mut slots = 1;
        for w in words {
            match w.split_once('=') {
                Some(("slots", n)) => {
                    slots = n
                        .parse()
                        .ok()
                        .filter(|&n| (1..=4096).contains(&n))
                        .with_context(|| {
                            format!(
                                "{}:{}: `slots={n}` must be a count from 1 to 4096",
                                file.display(),
                                i + 1
                            )
                        })?
                }
                Some(("max_slots", _)) => {}
                _ => bail!(
                    "{}:{}: `{w}`: a host line is `NAME slots=N`",
                    file.display(),
                    i + 1
                ),
            }
        }
        if hosts.iter().any(|h| h.name == name) {
            bail!(
                "{}:{}: host `{name}` is listed twice",
                file.display(),
                i + 1
            );
        }
        hosts.push(Host { name, slots });
    }
    if hosts.is_empty() {
        bail!("{}: names no host", file.display());
    }
    Ok(hosts)
}

/// Appends events to `events.jsonl` and says them on the terminal.
struct Events {
    path: PathBuf,
}

impl Events {
    fn record(&self, event: &str, mut details: serde_json::Value) -> Result<()> {
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        details["time"] = time.into();
        details["event"] = event.into();
        let line = serde_json::to_string(&details)?;
        eprintln!("launch: {line}");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        writeln!(f, "{line}").with_context(|| format!("{}: cannot write", self.path.display()))?;
        Ok(())
    }
}

/// A job's output, forwarded to ours as it comes and kept for reading its errors.
fn forward(stream: impl std::io::Read + Send + 'static, to_err: bool, kept: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream)
            .lines()
            .map_while(std::result::Result::ok)
        {
            if to_err {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
            let mut k = kept.lock().expect("no panics");
            k.push_str(&line);
            k.push('\n');
        }
    });
}

/// The words of `s` (whitespace-separated).
fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

/// A rank's report of a peer it lost or waited for in vain (`… waiting for rank 2`, `… lost rank 2`).
fn accused_rank(line: &str) -> Option<usize> {
    ["waiting for rank ", "lost rank "]
        .iter()
        .find_map(|marker| {
            let (_, rest) = line.split_once(marker)?;
            let r: String = rest.chars().take_while(char::is_ascii_digit).collect();
            r.parse().ok()
        })
}

/// Rank `from` (on host `by`) waited in vain for rank `to` (on host `of`), in `words`.
#[derive(Debug, Clone)]
struct Accusation {
    from: usize,
    to: usize,
    by: String,
    of: String,
    words: String,
}

/// What a failed job says of the hosts it lost.
#[derive(Debug, Default)]
struct Findings {
    /// Hosts known to be gone, and how that was found.
    gone: Vec<(String, String)>,
    /// A rank's report of a peer it could not reach.
    accusations: Vec<Accusation>,
    /// Errors of ranks that name no peer: a failure of the run itself, not of a host.
    other_errors: Vec<String>,
}

impl Findings {
    fn add_gone(&mut self, host: &str, how: String) {
        if !self.gone.iter().any(|g| g.0 == host) {
            self.gone.push((host.to_string(), how));
        }
    }

    /// Reads mpirun's output (OpenMPI's reports of a connection or daemon lost on a node, and the
    /// ranks' errors) and the ranks' status files (see `rank_status`).
    fn read(out: &str, statuses: &[Option<String>], rank_host: &[String]) -> Self {
        let mut f = Findings::default();
        let known = |h: &str| {
            let h = h.trim_matches(|c: char| !c.is_alphanumeric() && !"-_.".contains(c));
            rank_host.iter().any(|k| k == h).then(|| h.to_string())
        };
        for line in out.lines().map(str::trim) {
            if let Some(h) = line.strip_prefix("Peer host:").and_then(known) {
                f.add_gone(
                    &h,
                    "a rank's MPI connection to it broke (OpenMPI: `Peer host`)".into(),
                );
            }
            if let Some((_, rest)) = line.split_once(" on node ") {
                if line.contains("exited")
                    || line.contains("Remote daemon")
                    || line.contains("lost")
                {
                    if let Some(h) = rest.split_whitespace().next().and_then(known) {
                        f.add_gone(&h, format!("mpirun: `{line}`"));
                    }
                }
            }
        }
        for (rank, status) in statuses.iter().enumerate() {
            let host = &rank_host[rank];
            let Some(text) = status else { continue };
            let last = text.lines().last().unwrap_or("");
            if last == "running" {
                f.add_gone(
                    host,
                    format!("rank {rank} on it ended without a word (its process was killed)"),
                );
            } else if let Some(err) = last.strip_prefix("error: ") {
                match accused_rank(err).and_then(|r| Some((r, rank_host.get(r)?))) {
                    Some((to, peer)) if peer != host => f.accusations.push(Accusation {
                        from: rank,
                        to,
                        by: host.clone(),
                        of: peer.clone(),
                        words: format!("rank {rank}: {err}"),
                    }),
                    _ => f.other_errors.push(format!("rank {rank}: {err}")),
                }
            }
        }
        f
    }

    /// Settles the accusations: a host already gone explains those that name it (or come from it);
    /// a rank that waited for a peer that was itself waiting for a third rank was held up, not cut
    /// off (its timeout cascades from the peer's, within milliseconds of it), so its report is set
    /// aside while others remain; the rest are a partition between live hosts, cut by dropping as
    /// few hosts as cover them — the most accused first, the later host of a tie (rank 0's host is
    /// kept longest).
    fn settle(&mut self, hosts: &[Host]) {
        let mut open: Vec<Accusation> = std::mem::take(&mut self.accusations);
        let held_up = |a: &Accusation, all: &[Accusation]| {
            all.iter().any(|b| b.from == a.to && b.to != a.from)
        };
        let direct: Vec<Accusation> = open
            .iter()
            .filter(|a| !held_up(a, &open))
            .cloned()
            .collect();
        if !direct.is_empty() {
            open = direct;
        }
        loop {
            open.retain(|a| !self.gone.iter().any(|g| g.0 == a.by || g.0 == a.of));
            if open.is_empty() {
                return;
            }
            let count = |h: &str| open.iter().filter(|a| a.by == h || a.of == h).count();
            let pick = hosts
                .iter()
                .max_by_key(|h| count(&h.name))
                .expect("an accusation names a host");
            let words = open
                .iter()
                .find(|a| a.by == pick.name || a.of == pick.name)
                .map(|a| a.words.clone())
                .unwrap_or_default();
            let how = format!("its ranks and others' could not reach each other while both lived (a partition): `{words}`");
            self.add_gone(&pick.name.clone(), how);
        }
    }
}

/// A rank's status file (see `rank_status`) and when it was last written (unix seconds).
struct RankEnd {
    text: Option<String>,
    time: Option<f64>,
}

/// Reads the status file of every rank (`text` is `None` where it never wrote one).
fn read_statuses(dir: &Path, ranks: usize) -> Vec<RankEnd> {
    (0..ranks)
        .map(|r| {
            let p = dir.join(format!("rank-{r}"));
            let time = std::fs::metadata(&p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| {
                    t.duration_since(std::time::UNIX_EPOCH)
                        .ok()
                        .map(|d| d.as_secs_f64())
                });
            RankEnd {
                text: std::fs::read_to_string(&p).ok(),
                time,
            }
        })
        .collect()
}

/// How each rank ended, for the failure event: its last word (`finished`, `terminated` by mpirun,
/// `error: …`, `running` if it was killed) and when it said it.
fn rank_ends(ends: &[RankEnd], rank_host: &[String]) -> serde_json::Value {
    ends.iter()
        .enumerate()
        .map(|(r, e)| {
            serde_json::json!({
                "rank": r,
                "host": rank_host[r],
                "last_word": e.text.as_deref().and_then(|t| t.lines().last()),
                "time": e.time,
            })
        })
        .collect()
}

impl LaunchArgs {
    fn mpirun_base(&self) -> Vec<String> {
        let mut w = words(&self.mpirun);
        w.extend(words(&self.mpirun_args));
        w
    }

    /// Whether a process can be started on `host` within the probe timeout.
    fn probe(&self, host: &str, exe: &Path) -> bool {
        let mut w = self.mpirun_base();
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

    fn spawn(
        &self,
        hosts: &[Host],
        exe: &Path,
        train: &[String],
        statuses: &Path,
    ) -> Result<Child> {
        let mut w = self.mpirun_base();
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

/// `train`'s arguments with `flag value` set (replaced when given, appended when not).
fn with_flag(train: &[String], flag: &str, value: &str) -> Vec<String> {
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

/// The cluster a job on `hosts` runs on: the run's, with one node per host of its slots (unless the
/// run's cluster names its nodes itself, or the hosts have different slots).
fn cluster_of(cfg: &TrainConfig, hosts: &[Host]) -> Option<String> {
    let names_nodes = cfg.cluster.contains("nodes=") || cfg.cluster.contains("devices_per_node=");
    let slots = hosts[0].slots;
    (!names_nodes && hosts.iter().all(|h| h.slots == slots)).then(|| {
        format!(
            "{},nodes={},devices_per_node={slots}",
            cfg.cluster,
            hosts.len()
        )
    })
}

/// Watches `metrics.jsonl` until a step after `step` is recorded (the first one the relaunched run
/// completes), then records `resumed`. Only what the relaunched run appends counts (the failed run
/// may have recorded steps past its last checkpoint). It looks once more when told to stop.
struct ResumeWatch {
    stop: Arc<Mutex<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ResumeWatch {
    fn start(metrics: PathBuf, step: usize, failed_at: Instant, events: Arc<Events>) -> Self {
        let stop = Arc::new(Mutex::new(false));
        let flag = stop.clone();
        let skip = std::fs::metadata(&metrics).map_or(0, |m| m.len() as usize);
        let thread = std::thread::spawn(move || loop {
            let stopping = *flag.lock().expect("no panics");
            let first_new = std::fs::read(&metrics).ok().and_then(|bytes| {
                let text = String::from_utf8_lossy(bytes.get(skip..).unwrap_or_default());
                text.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .find(|v| v["step"].as_u64().is_some_and(|s| s as usize > step))
            });
            if let Some(v) = first_new {
                let _ = events.record(
                    "resumed",
                    serde_json::json!({
                        "step": v["step"],
                        "from_step": step,
                        "layout": v["layout"],
                        "seconds_since_job_ended": failed_at.elapsed().as_secs_f64(),
                    }),
                );
                return;
            }
            if stopping {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for ResumeWatch {
    fn drop(&mut self) {
        *self.stop.lock().expect("no panics") = true;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn run(a: LaunchArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.hostfile)
        .with_context(|| format!("{}: cannot read", a.hostfile.display()))?;
    let mut hosts = parse_hostfile(&text, &a.hostfile)?;
    if a.command.first().map(String::as_str) != Some("train") {
        bail!("launch runs `train`: `ferrotron launch --hostfile FILE -- train ARGS…`");
    }
    for w in words(&a.mpirun_args) {
        let flag = w.split('=').next().unwrap_or("");
        if [
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
        ]
        .contains(&flag)
        {
            bail!("--mpirun-args `{w}`: launch sets the ranks and their placement itself (one rank per hostfile slot, by slot, which is how it maps a rank to its host); drop it");
        }
    }
    if !(a.probe_timeout.is_finite() && a.probe_timeout > 0.0) {
        bail!(
            "--probe-timeout {}: must be a positive number of seconds",
            a.probe_timeout
        );
    }
    let mut train: Vec<String> = a.command[1..].to_vec();
    let cfg = super::train::settings_of(&train)?;
    if cfg.backend == "threads" && train.iter().any(|w| w.starts_with("--backend")) {
        bail!("launch runs one MPI rank per device: drop `--backend threads` (it implies `--backend mpi`)");
    }
    train = with_flag(&train, "--backend", "mpi");
    let exe = std::env::current_exe().context("cannot find this program")?;
    std::fs::create_dir_all(&cfg.out_dir)
        .with_context(|| format!("{}: cannot create", cfg.out_dir.display()))?;
    let events = Arc::new(Events {
        path: cfg.out_dir.join("events.jsonl"),
    });
    let checkpoints = cfg.checkpoint_root();
    let mut command = match cluster_of(&cfg, &hosts) {
        Some(c) => with_flag(&train, "--cluster", &c),
        None => train.clone(),
    };
    events.record(
        "start",
        serde_json::json!({
            "hosts": hosts.iter().map(|h| &h.name).collect::<Vec<_>>(),
            "devices": hosts.iter().map(|h| h.slots).sum::<usize>(),
            "layout": cfg.layout,
            "out_dir": cfg.out_dir,
        }),
    )?;
    let mut restarts = 0;
    let launched = Instant::now();
    let mut watch: Option<ResumeWatch> = None;
    loop {
        let started = Instant::now();
        let statuses = cfg.out_dir.join(".ranks");
        let _ = std::fs::remove_dir_all(&statuses);
        std::fs::create_dir_all(&statuses)
            .with_context(|| format!("{}: cannot create", statuses.display()))?;
        let mut child = a.spawn(&hosts, &exe, &command, &statuses)?;
        let kept = Arc::new(Mutex::new(String::new()));
        forward(child.stdout.take().expect("piped"), false, kept.clone());
        forward(child.stderr.take().expect("piped"), true, kept.clone());
        let status = child.wait().context("waiting for mpirun")?;
        // Let the forwarding threads finish the job's last words; the watcher its last look.
        std::thread::sleep(Duration::from_millis(200));
        drop(watch.take());
        if status.success() {
            events.record(
                "finished",
                serde_json::json!({
                    "restarts": restarts,
                    "seconds": launched.elapsed().as_secs_f64(),
                    "last_attempt_seconds": started.elapsed().as_secs_f64(),
                }),
            )?;
            return Ok(());
        }
        let failed_at = Instant::now();
        let out = kept.lock().expect("no panics").clone();
        let rank_host: Vec<String> = hosts
            .iter()
            .flat_map(|h| std::iter::repeat_n(h.name.clone(), h.slots))
            .collect();
        let ends = read_statuses(&statuses, rank_host.len());
        let mut found = Findings::read(
            &out,
            &ends.iter().map(|e| e.text.clone()).collect::<Vec<_>>(),
            &rank_host,
        );
        for h in &hosts {
            if !found.gone.iter().any(|g| g.0 == h.name) && !a.probe(&h.name, &exe) {
                found.add_gone(
                    &h.name,
                    format!(
                        "a probe could not start a process on it within {} s",
                        a.probe_timeout
                    ),
                );
            }
        }
        found.settle(&hosts);
        let gone = found.gone;
        let last_lines: Vec<&str> = out.lines().rev().take(6).collect();
        events.record(
            "failure",
            serde_json::json!({
                "exit_code": status.code(),
                "ranks": rank_ends(&ends, &rank_host),
                "gone": gone.iter().map(|(h, how)| serde_json::json!({"host": h, "how": how})).collect::<Vec<_>>(),
                "last_output": last_lines.into_iter().rev().collect::<Vec<_>>(),
            }),
        )?;
        if gone.is_empty() {
            let why = match found.other_errors.first() {
                Some(e) => format!(": {e}"),
                None => " (see its output above)".to_string(),
            };
            bail!(
                "the job failed (exit {:?}) with every host alive: not a host failure, so it is not relaunched{why}",
                status.code()
            );
        }
        if restarts >= a.max_restarts {
            bail!(
                "the job failed again after {restarts} relaunches (--max-restarts {})",
                a.max_restarts
            );
        }
        let dead: BTreeSet<&str> = gone.iter().map(|g| g.0.as_str()).collect();
        hosts.retain(|h| !dead.contains(h.name.as_str()));
        if hosts.is_empty() {
            bail!("no host is left to relaunch on");
        }
        restarts += 1;
        let resume = ferrotron_engine::checkpoint::Checkpoint::open(&checkpoints).ok();
        let mut next = with_flag(&train, "--layout", &a.relayout);
        if let Some(c) = cluster_of(&cfg, &hosts) {
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
                "attempt": restarts,
                "hosts": hosts.iter().map(|h| &h.name).collect::<Vec<_>>(),
                "devices": hosts.iter().map(|h| h.slots).sum::<usize>(),
                "layout": a.relayout,
                "resume_from": resume.as_ref().map(|ck| ck.dir.display().to_string()),
                "resume_step": resume_step,
            }),
        )?;
        // Records `resumed` while the relaunched job runs (replacing, and so ending, the last).
        watch = Some(ResumeWatch::start(
            cfg.out_dir.join("metrics.jsonl"),
            resume_step,
            failed_at,
            events.clone(),
        ));
        command = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles_and_failures_are_read_as_openmpi_writes_them() {
        let p = Path::new("hosts");
        let h = parse_hostfile("# cluster\nh1 slots=2\nh2\n\nh3 slots=1 # spare\n", p).unwrap();
        assert_eq!(
            h.iter()
                .map(|h| (h.name.as_str(), h.slots))
                .collect::<Vec<_>>(),
            [("h1", 2), ("h2", 1), ("h3", 1)]
        );
        for (bad, want) in [
            ("", "names no host"),
            ("h1 slots=0", "slots=0"),
            ("h1 cores=2", "cores=2"),
            ("h1\nh1", "twice"),
        ] {
            let e = parse_hostfile(bad, p).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
        let hosts = parse_hostfile("h1 slots=2\nh2\nh3\nh4\n", p).unwrap();
        let ranks: Vec<String> = ["h1", "h1", "h2", "h3", "h4"].map(String::from).to_vec();
        let st = |s: &str| Some(format!("rank r host x pid 1\n{s}\n"));
        // A killed host: its rank said nothing more; OpenMPI names it too; a survivor accuses it.
        let out = "  Local host: h4\n  Peer host:  h3\n";
        let statuses = [
            st("terminated"),
            st("terminated"),
            st("error: all_reduce on group world: rank 2 timed out after 10s waiting for rank 3"),
            st("running"),
            None,
        ];
        let judge = |out: &str, statuses: &[Option<String>]| {
            let mut f = Findings::read(out, statuses, &ranks);
            f.settle(&hosts);
            let gone: Vec<String> = f.gone.iter().map(|g| g.0.clone()).collect();
            (gone, f)
        };
        let (gone, f) = judge(out, &statuses);
        assert_eq!(gone, ["h3"], "{f:?}");
        // A partition between h2 and h4: both live and accuse each other; one of them goes.
        let statuses = [
            st("terminated"),
            st("terminated"),
            st("error: send: rank 2 timed out after 10s waiting for rank 4"),
            st("terminated"),
            st("error: recv: rank 4 lost rank 2 (it exited or failed)"),
        ];
        let (gone, f) = judge("", &statuses);
        assert_eq!(gone, ["h4"], "{f:?}");
        // The same partition, with the ranks held up behind it timing out within milliseconds of
        // it: rank 3 waited for rank 4 (itself waiting for rank 2), rank 0 for rank 3. Only the
        // mutual wait is the cut.
        let statuses = [
            st("error: send on group p2p[3,0]: rank 0 timed out after 10s waiting for rank 3"),
            st("terminated"),
            st("error: send on group p2p[4,2]: rank 2 timed out after 10s waiting for rank 4"),
            st("error: all_reduce on group dp[3,4]: rank 3 timed out after 10s waiting for rank 4"),
            st("error: send on group p2p[2,4]: rank 4 timed out after 10s waiting for rank 2"),
        ];
        let (gone, f) = judge("", &statuses);
        assert_eq!(gone, ["h4"], "{f:?}");
        // A failure of the run itself names no host.
        let statuses = [
            st("error: data/x.txt: cannot read"),
            st("terminated"),
            st("terminated"),
            st("terminated"),
            st("terminated"),
        ];
        let (gone, f) = judge("", &statuses);
        assert!(gone.is_empty() && f.other_errors.len() == 1, "{f:?}");
        assert_eq!(
            with_flag(
                &[
                    "--layout".into(),
                    "dp=4".into(),
                    "--steps".into(),
                    "9".into()
                ],
                "--layout",
                "auto"
            ),
            ["--layout", "auto", "--steps", "9"]
        );
    }
}

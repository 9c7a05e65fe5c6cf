//! Hosts that die under `ferrotron launch`, on real processes: four network-namespace hosts
//! (`scripts/multihost.sh`, one rank each) run `train --layout dp=2,pp=2` over OpenMPI's TCP
//! transport, and a fault strikes one of them: its processes killed mid-step or mid-checkpoint, its
//! link taken down, or the MPI data traffic between two hosts dropped (the runtime's links stay up,
//! so OpenMPI never notices; only ferrotron's own peer timeout ends the job). Each case checks that
//! every surviving rank ends within the peer timeout + 5 s, that `launch` names the host and how it
//! found it, relaunches on the three that remain from the latest complete checkpoint, and finishes,
//! and that the final parameters equal a run resumed by hand from that checkpoint on that layout.
//!
//! Needs root (namespaces), iproute2, util-linux, nftables and OpenMPI: `.ci/run` installs them. A
//! case that cannot set its hosts up fails; it never skips.
#![cfg(feature = "mpi")]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/multihost.sh");
const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/llama_tiny"
);
const EXE: &str = env!("CARGO_BIN_EXE_ferrotron");
/// The ranks' peer timeout in these runs (seconds).
const PEER_TIMEOUT: f64 = 10.0;
const HOSTS: [&str; 4] = ["h1", "h2", "h3", "h4"];

/// The namespaces are one set for the machine: one case at a time.
static MACHINE: Mutex<()> = Mutex::new(());

fn script(args: &[&str]) {
    let out = Command::new(SCRIPT)
        .args(args)
        .output()
        .expect("scripts/multihost.sh runs");
    assert!(
        out.status.success(),
        "scripts/multihost.sh {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Four hosts for the life of a case (removed however it ends).
struct Hosts;

impl Hosts {
    fn up() -> Self {
        script(&["up", "4"]);
        Hosts
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = Command::new(SCRIPT).arg("down").status();
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    KillMidStep,
    KillMidCheckpoint,
    LinkDown,
    /// MPI data traffic dropped between the host and another (`partition A B`).
    Partition(&'static str),
}

fn train_args(out: &Path, job: &Job) -> Vec<String> {
    let s = |x: &str| x.to_string();
    vec![
        s("train"),
        s("--model"),
        s(job.model),
        s("--steps"),
        job.steps.to_string(),
        s("--batch-size"),
        s("8"),
        s("--seq-len"),
        s("32"),
        s("--checkpoint-every"),
        job.checkpoint_every.to_string(),
        s("--eval-every"),
        s("0"),
        s("--peer-timeout"),
        PEER_TIMEOUT.to_string(),
        s("--out-dir"),
        out.display().to_string(),
    ]
}

fn launch(dir: &Path, job: &Job) -> Child {
    std::fs::write(
        dir.join("hosts"),
        "h1 slots=1\nh2 slots=1\nh3 slots=1\nh4 slots=1\n",
    )
    .unwrap();
    let mut args: Vec<String> = ["launch", "--hostfile"].map(String::from).to_vec();
    args.push(dir.join("hosts").display().to_string());
    args.extend([
        "--mpirun".to_string(),
        format!("{SCRIPT} mpirun"),
        "--".to_string(),
    ]);
    args.extend(train_args(&dir.join("run"), job));
    args.extend(["--layout", "dp=2,pp=2"].map(String::from));
    Command::new(EXE)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("launch.log")).unwrap())
        .spawn()
        .expect("ferrotron launch starts")
}

/// The newest complete checkpoint's step.
fn latest_step(root: &Path) -> Option<usize> {
    let name = std::fs::read_to_string(root.join("latest")).ok()?;
    name.trim().strip_prefix("step-")?.parse().ok()
}

fn saving(root: &Path) -> bool {
    std::fs::read_dir(root).is_ok_and(|d| {
        d.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(".step-") && n.ends_with(".partial"))
        })
    })
}

fn events(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("events.jsonl holds one JSON object a line"))
        .collect()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The run a trial strikes.
pub struct Job {
    pub model: &'static str,
    pub steps: usize,
    pub checkpoint_every: usize,
}

/// The fault cases' run: llama_tiny, about 4 s on four hosts of a 2-core machine.
const TINY: Job = Job {
    model: MODEL,
    steps: 400,
    checkpoint_every: 25,
};

/// What one fault trial measured.
#[derive(Debug)]
pub struct Trial {
    pub fault: Fault,
    pub host: &'static str,
    /// The job's end after the fault (seconds): detection.
    pub detected_s: f64,
    /// The fault → the first optimizer step on the new layout (seconds).
    pub recovered_s: f64,
    pub resume_step: usize,
    pub layout: String,
    pub max_param_diff: f32,
}

fn f32s(file: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Largest relative difference between two models' parameters (relative to max(1, |b|)).
fn param_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (f32s(a), f32s(b));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}");
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs() / y.abs().max(1.0));
        }
    }
    worst
}

/// Runs a `steps`-step job, strikes `host` with `fault` `delay` after its first checkpoint (a kill
/// mid-checkpoint: at the first save seen after that), and checks what the module says.
pub fn trial(job: &Job, fault: Fault, host: &'static str, delay: Duration) -> Trial {
    let _machine = MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile_dir(&format!("{fault:?}-{host}"));
    let _hosts = Hosts::up();
    let run = dir.join("run");
    let ckpts = run.join("checkpoints");
    let mut launched = launch(&dir, job);
    let log = || std::fs::read_to_string(dir.join("launch.log")).unwrap_or_default();

    // Strike once the run has a checkpoint (a relaunch then has something to resume).
    let deadline = Instant::now() + Duration::from_secs(120);
    while latest_step(&ckpts).is_none() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint within 120 s:\n{}",
            log()
        );
        assert!(
            launched.try_wait().unwrap().is_none(),
            "launch ended before its first checkpoint:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(delay);
    if fault == Fault::KillMidCheckpoint {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !saving(&ckpts) {
            assert!(
                Instant::now() < deadline,
                "no checkpoint save seen within 60 s:\n{}",
                log()
            );
        }
    }
    let struck_at = unix_now();
    let step_at_fault = latest_step(&ckpts).unwrap();
    match fault {
        Fault::KillMidStep | Fault::KillMidCheckpoint => script(&["kill", host]),
        Fault::LinkDown => script(&["cut", host]),
        Fault::Partition(other) => script(&["partition", host, other]),
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        if let Some(status) = launched.try_wait().unwrap() {
            assert!(
                status.success(),
                "launch failed after {fault:?} on {host}:\n{}",
                log()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "launch did not finish within 240 s of {fault:?} on {host}:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let ev = events(&run);
    let kinds: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["start", "failure", "relaunch", "resumed", "finished"],
        "{}",
        log()
    );
    let failure = &ev[1];
    let gone: Vec<&str> = failure["gone"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["host"].as_str().unwrap())
        .collect();
    match fault {
        Fault::Partition(other) => assert!(
            gone == [host] || gone == [other],
            "a partition between {host} and {other} drops one of them, not {gone:?}: {failure}"
        ),
        _ => assert_eq!(gone, [host], "{failure}"),
    }
    let dropped = gone[0];
    for g in failure["gone"].as_array().unwrap() {
        assert!(!g["how"].as_str().unwrap().is_empty(), "{failure}");
    }
    // Every surviving rank of the first job ended within the peer timeout + 5 s of the fault,
    // and (a partition) the one that gave up named its peer.
    let detected_s = failure["time"].as_f64().unwrap() - struck_at;
    let partition = matches!(fault, Fault::Partition(_));
    let ranks = failure["ranks"]
        .as_array()
        .expect("the failure says how each rank ended");
    for r in ranks {
        let (rank_host, last) = (
            r["host"].as_str().unwrap(),
            r["last_word"].as_str().unwrap_or(""),
        );
        if rank_host == dropped && !partition {
            continue; // killed, or cut off with its host
        }
        assert!(
            last == "terminated" || last.starts_with("error: "),
            "rank {r} did not end after {fault:?} on {host}: {failure}"
        );
        let ended = r["time"].as_f64().unwrap() - struck_at;
        assert!(
            ended <= PEER_TIMEOUT + 5.0,
            "rank {r} ended {ended:.1} s after {fault:?} on {host}: {failure}"
        );
    }
    if partition {
        assert!(
            ranks.iter().any(|r| r["last_word"]
                .as_str()
                .is_some_and(|t| t.contains("waiting for rank") || t.contains("lost rank"))),
            "no rank named the peer it lost: {failure}"
        );
    }
    let relaunch = &ev[2];
    let survivors: Vec<&str> = HOSTS.iter().copied().filter(|h| *h != dropped).collect();
    assert_eq!(relaunch["hosts"], serde_json::json!(survivors));
    let resume_step = relaunch["resume_step"].as_u64().unwrap() as usize;
    assert!(
        resume_step >= step_at_fault,
        "resumed from {resume_step}, {step_at_fault} was complete"
    );
    let resumed = &ev[3];
    let recovered_s = resumed["time"].as_f64().unwrap() - struck_at;
    let layout = resumed["layout"].as_str().unwrap().to_string();
    assert_eq!(resumed["step"].as_u64(), Some(resume_step as u64 + 1));

    // Every checkpoint left behind is whole (its checksums hold), and no save is left half-done.
    for e in std::fs::read_dir(&ckpts).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        assert!(!name.starts_with('.'), "{name} left in {}", ckpts.display());
        if name.starts_with("step-") {
            let out = Command::new(EXE)
                .args(["checkpoint", "inspect"])
                .arg(e.path())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    // The same checkpoint resumed by hand on the same hosts and layout ends at the same parameters.
    let hand = dir.join("hand");
    let resume_from = relaunch["resume_from"].as_str().unwrap().to_string();
    let mut mpirun: Vec<String> = vec![
        "mpirun".into(),
        "-np".into(),
        "3".into(),
        "--host".into(),
        survivors.join(","),
    ];
    mpirun.extend(["--map-by", "slot", EXE].map(String::from));
    mpirun.extend(train_args(&hand, job));
    mpirun.extend(
        [
            "--backend",
            "mpi",
            "--layout",
            &layout,
            "--resume",
            &resume_from,
        ]
        .map(String::from),
    );
    let out = Command::new(SCRIPT).args(&mpirun).output().unwrap();
    assert!(
        out.status.success(),
        "the hand-resumed run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let max_param_diff = param_diff(
        &run.join("model/model.safetensors"),
        &hand.join("model/model.safetensors"),
    );
    assert!(
        max_param_diff <= 1e-5,
        "{fault:?} on {host}: the relaunched run's parameters differ from the hand-resumed run's by {max_param_diff:e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Trial {
        fault,
        host,
        detected_s,
        recovered_s,
        resume_step,
        layout,
        max_param_diff,
    }
}

fn tempfile_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrotron-multihost-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_host_killed_mid_step_is_dropped_and_the_run_finishes_on_the_rest() {
    let t = trial(&TINY, Fault::KillMidStep, "h3", Duration::from_millis(300));
    eprintln!("{t:?}");
}

#[test]
fn a_host_killed_mid_checkpoint_leaves_the_last_complete_checkpoint_to_resume() {
    let t = trial(&TINY, Fault::KillMidCheckpoint, "h2", Duration::ZERO);
    eprintln!("{t:?}");
}

#[test]
fn a_host_whose_link_goes_down_is_dropped() {
    let t = trial(&TINY, Fault::LinkDown, "h4", Duration::from_millis(300));
    eprintln!("{t:?}");
}

#[test]
fn a_data_plane_partition_that_openmpi_never_notices_ends_in_a_peer_timeout_and_a_relaunch() {
    // h2 holds rank 1 and h4 rank 3: the two pipeline stages of data-parallel replica 1.
    let t = trial(
        &TINY,
        Fault::Partition("h4"),
        "h2",
        Duration::from_millis(300),
    );
    eprintln!("{t:?}");
}

/// The pairs of hosts whose ranks exchange data under `dp=2,pp=2` (rank r on host r+1): the
/// data-parallel pairs of each stage and the stage pairs of each replica.
const TALKING: [(&str, &str); 4] = [("h1", "h2"), ("h3", "h4"), ("h1", "h3"), ("h2", "h4")];

fn trials_table(trials: &[Trial]) -> String {
    let mut t = String::from(
        "| # | fault | host | detected (s) | kill → first step on new layout (s) | resumed from | new layout | max param diff |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (i, x) in trials.iter().enumerate() {
        let layout = x.layout.split(",vpp").next().unwrap_or(&x.layout);
        t.push_str(&format!(
            "| {} | {:?} | {} | {:.1} | {:.1} | {} | {layout} | {:.0e} |\n",
            i + 1,
            x.fault,
            x.host,
            x.detected_s,
            x.recovered_s,
            x.resume_step,
            x.max_param_diff
        ));
    }
    t
}

/// Twenty faults of a random kind on a random host at a random moment (`FERROTRON_FAULT_TRIALS`,
/// `FERROTRON_FAULT_SEED` to change them), each bounded in time: the table goes in docs/checkpoints.md.
/// `cargo test --release -p ferrotron --features mpi --test multihost -- --ignored randomized`
#[test]
#[ignore = "about 10 minutes; run by hand for docs/checkpoints.md's table"]
fn randomized_fault_trials() {
    use rand::{Rng, SeedableRng};
    let n: usize = std::env::var("FERROTRON_FAULT_TRIALS").map_or(20, |v| v.parse().unwrap());
    let seed: u64 = std::env::var("FERROTRON_FAULT_SEED").map_or(1, |v| v.parse().unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let job = Job { steps: 600, ..TINY };
    let mut trials = Vec::new();
    for _ in 0..n {
        let host = HOSTS[rng.gen_range(0..4)];
        let fault = match rng.gen_range(0..4) {
            0 => Fault::KillMidStep,
            1 => Fault::KillMidCheckpoint,
            2 => Fault::LinkDown,
            _ => {
                let pairs: Vec<&(&str, &str)> = TALKING
                    .iter()
                    .filter(|p| p.0 == host || p.1 == host)
                    .collect();
                let (a, b) = *pairs[rng.gen_range(0..pairs.len())];
                Fault::Partition(if a == host { b } else { a })
            }
        };
        let delay = Duration::from_millis(rng.gen_range(0..2500));
        trials.push(trial(&job, fault, host, delay));
        eprintln!("{:?}", trials.last().unwrap());
    }
    eprintln!("{}", trials_table(&trials));
}

/// Kill → first optimizer step on the new layout for the embedded default run's model.
#[test]
#[ignore = "about 2 minutes; run by hand for docs/checkpoints.md's figure"]
fn llama_small_recovers_from_a_killed_host() {
    let job = Job {
        model: "llama-small",
        steps: 80,
        checkpoint_every: 10,
    };
    let t = trial(&job, Fault::KillMidStep, "h3", Duration::from_millis(500));
    eprintln!("{}", trials_table(&[t]));
}

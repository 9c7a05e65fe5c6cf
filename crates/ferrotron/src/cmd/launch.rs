//! `ferrotron launch`: runs a training job through `mpirun` on a hostfile's hosts and survives
//! hosts that die (the supervisor is `crate::supervisor`).

use crate::supervisor::{parse_hostfile, Mpirun, Supervisor};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

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

pub fn run(a: LaunchArgs) -> Result<()> {
    let text =
        ferrotron_core::bounded::read_to_string(&a.hostfile, ferrotron_core::bounded::SETTINGS)
            .with_context(|| format!("{}: cannot read", a.hostfile.display()))?;
    let hosts = parse_hostfile(&text, &a.hostfile)?;
    if a.command.first().map(String::as_str) != Some("train") {
        bail!("launch runs `train`: `ferrotron launch --hostfile FILE -- train ARGS…`");
    }
    let mpirun = Mpirun::new(&a.mpirun, &a.mpirun_args, a.probe_timeout)?;
    let train: Vec<String> = a.command[1..].to_vec();
    let cfg = super::train::settings_of(&train)?;
    if cfg.parallelism.backend == ferrotron_engine::comm::CommBackend::Threads
        && train.iter().any(|w| w.starts_with("--backend"))
    {
        bail!("launch runs one MPI rank per device: drop `--backend threads` (it implies `--backend mpi`)");
    }
    Supervisor {
        hosts,
        mpirun,
        train: crate::supervisor::with_flag(&train, "--backend", "mpi"),
        cfg,
        relayout: a.relayout,
        max_restarts: a.max_restarts,
    }
    .run()
}

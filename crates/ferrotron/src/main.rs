//! `ferrotron`: plan, train, verify and profile transformer training runs that do not fit on one device.

mod cmd;
mod machine;
mod profiling;
mod report;
mod supervisor;

use clap::{CommandFactory, FromArgMatches, Subcommand};

#[derive(clap::Parser)]
#[command(
    name = "ferrotron",
    version,
    about = "Train transformers that do not fit on one device"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no arguments: the embedded default run on the bundled corpus).
    Train(Box<cmd::train::TrainArgs>),
    /// One forward/backward of a fixed batch; writes the loss and every gradient by Hugging Face name.
    Grads(cmd::grads::GradsArgs),
    /// Prove a layout computes the unsplit model's loss and gradients (non-zero exit above tolerance).
    Verify(cmd::verify::VerifyArgs),
    /// Do the memory arithmetic first: evaluate a layout, or search for the best that fits.
    Plan(Box<cmd::plan::PlanArgs>),
    /// Fit the cluster's time constants to measured runs (a TOML file of published runs, or
    /// `profile` directories), or measure this machine; writes a cluster file for `--cluster`.
    Calibrate(Box<cmd::calibrate::CalibrateArgs>),
    /// Run a few steps of a layout and put every measurement beside the planner's prediction, with
    /// verdicts; writes a Perfetto trace, SVG pictures and an HTML report.
    Profile(Box<cmd::profile::ProfileArgs>),
    /// Write the HTML report of a training run from its directory's metrics.jsonl (what
    /// `train --report` writes at the end of a run).
    Report(cmd::report::ReportArgs),
    /// Print a pipeline schedule's per-stage action lists and its bubble.
    Schedule(cmd::schedule::ScheduleArgs),
    /// Sharded checkpoints: inspect, reshard to another layout, export to / import from Hugging Face.
    #[command(subcommand)]
    Checkpoint(cmd::checkpoint::CheckpointCommand),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Run `train` through mpirun on a hostfile's hosts, and when hosts die relaunch on the ones
    /// that remain from the latest checkpoint (events in <out_dir>/events.jsonl).
    Launch(cmd::launch::LaunchArgs),
}

/// `--lr -1` is a value to refuse with a reason, not an unknown flag `-1`: every option that takes
/// a value accepts a negative number, in every subcommand.
pub(crate) fn accept_negative_numbers(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    })
    .mut_subcommands(accept_negative_numbers)
}

/// The error and its causes joined by `: `, each cause once: many errors already quote their
/// source in their own message (`path: cannot read: No such file…`).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

/// `ferrotron plan | head` closes stdout early; like other Unix tools, end quietly then instead of
/// panicking on the failed write. Not under a launcher: there the MPI library owns its sockets'
/// signal handling, and a rank must report a lost peer rather than vanish.
fn end_quietly_when_stdout_closes() {
    #[cfg(unix)]
    if ferrotron_engine::runtime::launcher_rank().is_none() {
        // SAFETY: restores the default action of one signal before any other thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
}

fn main() {
    ferrotron_engine::keep_freed_memory_in_process();
    end_quietly_when_stdout_closes();
    // The matches are kept: `train` asks them which settings were given as flags.
    let matches = accept_negative_numbers(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = ferrotron_engine::memory::check_huge_pages_setting() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let result = match cli.command {
        Command::Train(a) => cmd::train::run(
            *a,
            matches
                .subcommand_matches("train")
                .expect("the train subcommand was parsed"),
        ),
        Command::Grads(a) => cmd::grads::run(a),
        Command::Plan(a) => cmd::plan::run(*a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Report(a) => cmd::report::run(a),
        Command::Schedule(a) => cmd::schedule::run(a),
        Command::Profile(a) => cmd::profile::run(*a),
        Command::Calibrate(a) => cmd::calibrate::run(*a),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Checkpoint(c) => cmd::checkpoint::run(c),
        Command::Launch(a) => cmd::launch::run(a),
    };
    // A rank of a launched job says how it ended (nothing happens outside `launch`).
    use ferrotron_engine::runtime::rank_status;
    match result {
        Ok(()) => rank_status::note("finished"),
        Err(e) => {
            let chain = error_chain(&e);
            rank_status::note(&format!("error: {chain}"));
            eprintln!("error: {chain}");
            // A preempted run exits as the signal asks (143 for SIGTERM, 130 for SIGINT).
            let code = e
                .downcast_ref::<ferrotron_engine::error::EngineError>()
                .map_or(1, |e| e.exit_code());
            std::process::exit(code);
        }
    }
}

//! `ferrotron`: plan, train, verify and profile transformer training runs that do not fit on one device.

mod cmd;
mod report;

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
    /// Run a few steps of a layout and put every measurement beside the planner's prediction, with
    /// verdicts; writes a Perfetto trace, SVG pictures and an HTML report.
    Profile(Box<cmd::profile::ProfileArgs>),
    /// Print a pipeline schedule's per-stage action lists and its bubble.
    Schedule(cmd::schedule::ScheduleArgs),
    /// Sharded checkpoints: inspect, reshard to another layout, export to / import from Hugging Face.
    #[command(subcommand)]
    Checkpoint(cmd::checkpoint::CheckpointCommand),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
}

fn main() {
    ferrotron_engine::keep_freed_memory_in_process();
    // The matches are kept: `train` asks them which settings were given as flags.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
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
        Command::Schedule(a) => cmd::schedule::run(a),
        Command::Profile(a) => cmd::profile::run(*a),
        Command::Bench(b) => cmd::bench::run(b),
        Command::Checkpoint(c) => cmd::checkpoint::run(c),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

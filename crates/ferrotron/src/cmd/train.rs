use crate::report::facts::count;
use crate::report::run::{device_table, DeviceRow};
use anyhow::{Context, Result};
use clap::Args;
use ferrotron_engine::comm::CommBackend;
use ferrotron_engine::runtime::{launcher_rank, train, TrainConfig, TrainSummary};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// `ferrotron train`: a TOML file and the settings' flags (one struct, [`TrainConfig`], is both).
#[derive(Args)]
pub struct TrainArgs {
    /// A TOML file with any of the settings below as keys (`batch_size` for `--batch-size`), at the
    /// top level or in its group's table (`[optimizer]`, `[parallelism]`, …); flags win over it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: TrainConfig,
}

/// Defaults, then the TOML file, then the flags given on the command line (`matches`: the train
/// subcommand's).
fn resolve(args: &TrainArgs, matches: &clap::ArgMatches) -> Result<TrainConfig> {
    let toml = match &args.config {
        Some(path) => {
            let text =
                ferrotron_core::bounded::read_to_string(path, ferrotron_core::bounded::SETTINGS)
                    .with_context(|| format!("{}: cannot read", path.display()))?;
            let table: toml::Table = toml::from_str(&text)
                .with_context(|| format!("{}: not valid TOML", path.display()))?;
            match serde_json::to_value(table)? {
                serde_json::Value::Object(m) => Some(m),
                _ => None,
            }
        }
        None => None,
    };
    let source = args
        .config
        .as_ref()
        .map_or("flags".to_string(), |p| p.display().to_string());
    let given = |key: &str| {
        matches!(
            matches.value_source(key),
            Some(clap::parser::ValueSource::CommandLine)
        )
    };
    Ok(TrainConfig::layered(toml, &args.settings, &given, &source)?)
}

/// The settings `ferrotron train WORDS…` would run with (what `launch` reads of the run it starts:
/// its directories, backend and layout).
pub fn settings_of(words: &[String]) -> Result<TrainConfig> {
    use clap::{CommandFactory, FromArgMatches, Parser};
    #[derive(Parser)]
    #[command(name = "train")]
    struct Train {
        #[command(flatten)]
        args: TrainArgs,
    }
    let matches = crate::accept_negative_numbers(Train::command())
        .try_get_matches_from(std::iter::once("train".to_string()).chain(words.iter().cloned()))?;
    let parsed = Train::from_arg_matches(&matches)?;
    let cfg = resolve(&parsed.args, &matches)?;
    cfg.check()?;
    Ok(cfg)
}

pub fn run(args: TrainArgs, matches: &clap::ArgMatches) -> Result<()> {
    let cfg = resolve(&args, matches)?;
    cfg.check()?;
    // Under mpirun only rank 0 speaks; the others' output would repeat it.
    if cfg.parallelism.backend != CommBackend::Mpi || launcher_rank().is_none_or(|r| r == 0) {
        announce(&cfg)?;
    }
    let summary = train_with_progress(&cfg)?;
    if !summary.reporter {
        return Ok(()); // an MPI rank other than 0: rank 0 reports
    }
    print_summary(&cfg, &summary)
}

/// What the run will do, said before it starts.
fn announce(cfg: &TrainConfig) -> Result<()> {
    eprintln!(
        "ferrotron train: model {}, data {}, {} steps x {} sequences x {} tokens -> {}",
        cfg.input.model,
        cfg.input.data,
        cfg.optimizer.steps,
        cfg.optimizer.batch_size,
        cfg.input.seq_len,
        cfg.checkpointing.out_dir.display()
    );
    if let Some(from) = &cfg.checkpointing.resume {
        let dir = ferrotron_engine::checkpoint::Checkpoint::locate(from)?;
        eprintln!(
            "resuming from {dir} on layout `{}`",
            if cfg.parallelism.layout.text.is_empty() {
                "dp=1,tp=1,pp=1"
            } else {
                &cfg.parallelism.layout.text
            }
        );
    }
    Ok(())
}

/// Trains, with a progress bar and the evaluations and warnings as they come.
fn train_with_progress(cfg: &TrainConfig) -> Result<TrainSummary> {
    let pb = ProgressBar::new(cfg.optimizer.steps as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut last_val = None;
    let summary = train(cfg, &mut |r| {
        for w in &r.warnings {
            // Printed whether or not the bar is shown (a hidden bar drops its log lines).
            pb.suspend(|| eprintln!("warning at step {}: {w}", r.step));
        }
        if let Some(v) = r.val_loss {
            last_val = Some(v);
            pb.suspend(|| {
                eprintln!(
                    "step {:>5}  train loss {:.4}  val loss {:.4}  lr {:.2e}  {:.0} tok/s  MFU {:.1}%",
                    r.step,
                    r.loss,
                    v,
                    r.lr,
                    r.tokens_per_s,
                    100.0 * r.mfu
                )
            });
        }
        let val = last_val.map_or(String::new(), |v| format!(" val {v:.3}"));
        pb.set_message(format!(
            "loss {:.3}{val} | {:.0} tok/s | MFU {:.1}%",
            r.loss,
            r.tokens_per_s,
            100.0 * r.mfu
        ));
        pb.set_position(r.step as u64);
    })?;
    pb.finish_and_clear();
    Ok(summary)
}

/// The run's summary: parameters, tokens, losses, per device memory measured beside predicted,
/// and where everything went.
fn print_summary(cfg: &TrainConfig, summary: &TrainSummary) -> Result<()> {
    let trained = if summary.trained_params == summary.num_params {
        String::new()
    } else {
        format!(
            " ({} of them trained: LoRA adapters, written to {} as PEFT writes them; the \
             model below has them merged)",
            count(summary.trained_params as f64),
            cfg.checkpointing.out_dir.join("adapter").display()
        )
    };
    println!(
        "done: {} parameters{trained}, {} train / {} validation tokens, {:.0} tokens/s",
        count(summary.num_params as f64),
        summary.train_tokens,
        summary.val_tokens,
        summary.tokens_per_s
    );
    let validation = match (summary.initial_val_loss, summary.final_val_loss) {
        (Some(a), Some(b)) => format!("validation loss {a:.4} -> {b:.4}"),
        _ => "no validation loss (nothing held out: val_fraction or eval_batches is 0)".into(),
    };
    println!(
        "{validation} (train loss {:.4}); model saved to {} (tokenizer {})",
        summary.final_train_loss,
        summary.model_dir.display(),
        summary.tokenizer.display()
    );
    print_devices(summary);
    println!(
        "metrics: {}",
        cfg.checkpointing.out_dir.join("metrics.jsonl").display()
    );
    if cfg.logging.report {
        let path = cfg.checkpointing.out_dir.join("report.html");
        std::fs::write(
            &path,
            crate::report::run::run_page(&cfg.checkpointing.out_dir)?,
        )
        .with_context(|| format!("{}: cannot write", path.display()))?;
        println!("report: {}", path.display());
    }
    println!(
        "checkpoints: {} (`ferrotron checkpoint inspect` it; `--resume` it on any layout)",
        cfg.checkpointing
            .checkpoint_dir
            .clone()
            .unwrap_or_else(|| cfg.checkpointing.out_dir.join("checkpoints"))
            .display()
    );
    Ok(())
}

/// Per device, measured peak memory beside the planner's prediction, idle, bytes, step time and
/// the bytes of the model it read.
fn print_devices(summary: &TrainSummary) {
    if summary.devices.is_empty() {
        return;
    }
    // A mixture of experts: the routed experts' part of the weights, apart.
    let experts = summary
        .devices
        .iter()
        .any(|d| d.predicted_expert_weight_bytes > 0);
    let mb = |b: u64| format!("{:.2}", b as f64 / 1e6);
    let rows: Vec<DeviceRow> = summary
        .devices
        .iter()
        .map(|d| DeviceRow {
            device: d.device,
            stage: d.stage,
            dp_rank: d.dp_rank,
            cp_rank: d.cp_rank,
            tp_rank: d.tp_rank,
            measured: d.peak_memory_bytes,
            predicted: d.predicted_memory_bytes,
            idle_fraction: d.idle_fraction,
            extra: experts
                .then(|| {
                    format!(
                        "{} / {}",
                        mb(d.expert_weight_bytes),
                        mb(d.predicted_expert_weight_bytes)
                    )
                })
                .into_iter()
                .chain([
                    ferrotron_engine::memory::format_bytes(d.bytes_sent_per_step),
                    format!("{:.4}", d.step_time_s),
                    format!("{:.4}", d.wall_step_time_s),
                    ferrotron_engine::memory::format_bytes(d.model_bytes_read),
                ])
                .collect(),
        })
        .collect();
    let caption = format!(
        "layout {}: per device, measured peak memory / the planner's prediction",
        summary.layout
    );
    print!(
        "{}",
        device_table(
            &caption,
            &rows,
            "idle, mean over the run (%)",
            &experts
                .then_some("of the weights, the routed experts' (MB), measured / predicted")
                .into_iter()
                .chain([
                    "sent per step",
                    "step, device time (s)",
                    "step, wall time (s)",
                    "model read at start",
                ])
                .collect::<Vec<_>>()
        )
        .markdown()
    );
}

//! `ferrotron report DIR`: the HTML report of a training run, from what its directory recorded.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct ReportArgs {
    /// The run directory (`train --out-dir`), holding metrics.jsonl and train_config.json.
    #[arg(default_value = "runs/default")]
    run: PathBuf,
    /// Where the page goes (default: `report.html` in the run directory).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let html = crate::report::run::run_page(&a.run)?;
    let path = a.out.unwrap_or_else(|| a.run.join("report.html"));
    std::fs::write(&path, html).with_context(|| format!("{}: cannot write", path.display()))?;
    println!("report: {}", path.display());
    Ok(())
}

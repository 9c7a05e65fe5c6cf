//! `bench predict`: does the planner's time model describe this machine? Calibrates it
//! (`calibrate --this-machine`), then profiles a set of layouts that cover every dimension and prints
//! each one's measured and predicted step time side by side. A benchmark, not a test: device time on
//! a shared machine moves by tens of percent from one minute to the next, so the table is read, not
//! asserted.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// dp, tp, pp with both synchronous schedule families, ZeRO-3, recompute, sequence parallelism, 3D.
pub const LAYOUTS: [&str; 8] = [
    "dp=2,mbs=2",
    "tp=2,mbs=2",
    "pp=2,mbs=1,schedule=1f1b",
    "pp=2,mbs=1,schedule=zbh1",
    "dp=2,zero=3,mbs=2",
    "dp=2,pp=2,recompute=full,mbs=1",
    "tp=4,sp=true,mbs=2",
    "dp=2,tp=2,pp=2,zero=1,mbs=2",
];

/// Runs this binary with `args`; its stdout, or an error with its stderr.
fn ferrotron(args: &[&str]) -> Result<String> {
    let exe = std::env::current_exe().context("cannot find the ferrotron executable")?;
    let out = Command::new(exe).args(args).output()?;
    if !out.status.success() {
        bail!(
            "ferrotron {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(
    model: &str,
    layouts: &[String],
    steps: usize,
    tolerance: f64,
    dir: &Path,
) -> Result<()> {
    if !(tolerance.is_finite() && tolerance >= 0.0) {
        bail!("--tolerance {tolerance}: must be a non-negative fraction (0.15 is 15%)");
    }
    if layouts.iter().any(|l| l.trim().is_empty()) {
        bail!("--layouts: an empty layout (separate layouts with `;`)");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let cluster = dir.join("this-machine.toml");
    let cluster_arg = cluster.to_string_lossy().into_owned();
    ferrotron(&["calibrate", "--this-machine", "--out", &cluster_arg])?;
    println!(
        "bench predict: {model}, profile --steps {steps} (median step, device time) against the \
         planner on `calibrate --this-machine` ({})\n",
        cluster.display()
    );
    println!(
        "| layout | measured (ms) | predicted (ms) | measured / predicted | within {:.0}% |",
        tolerance * 100.0
    );
    println!("|---|---|---|---|---|");
    let steps = steps.to_string();
    let mut within = 0;
    for layout in layouts {
        let out = dir.join(layout.replace([',', '='], "_"));
        let text = ferrotron(&[
            "profile",
            "--model",
            model,
            "--layout",
            layout,
            "--steps",
            &steps,
            "--cluster",
            &cluster_arg,
            "--json",
            "--out",
            &out.to_string_lossy(),
        ])?;
        let record: serde_json::Value = serde_json::from_str(&text)?;
        let step = &record["step_time_s"];
        let (measured, predicted) = (
            step["measured"].as_f64().unwrap_or(f64::NAN),
            step["predicted"].as_f64().unwrap_or(f64::NAN),
        );
        let ratio = measured / predicted;
        let ok = (ratio - 1.0).abs() <= tolerance;
        within += usize::from(ok);
        println!(
            "| {layout} | {:.1} | {:.1} | {ratio:.2} | {} |",
            measured * 1e3,
            predicted * 1e3,
            if ok { "yes" } else { "no" }
        );
    }
    println!(
        "\n{within} of {} layouts within {:.0}% of the prediction",
        layouts.len(),
        tolerance * 100.0
    );
    Ok(())
}

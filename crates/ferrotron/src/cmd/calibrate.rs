//! `ferrotron calibrate`: fit the cluster's time constants to measured runs (published ones in a
//! TOML file, or ferrotron's own profiles), or measure this machine, and write a cluster file that
//! `--cluster FILE` takes wherever a cluster is asked for.

use crate::machine::{this_machine, write_cluster};
use crate::report::Table;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::plan::calibrate::{
    fit_with_errors, FitParam, Measured, MeasuredRun, RunErrors, DEFAULT_FIT,
};
use ferrotron_core::plan::{AttentionKernel, PlanModel, StateDtypes};
use ferrotron_core::topology::Cluster;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct CalibrateArgs {
    /// Measured runs: a TOML file with one `[[run]]` table per run (model, layout, seq,
    /// global_batch, nodes, optional precision, attention and name, and step_time_s or
    /// tflops_per_device).
    #[arg(long)]
    runs: Option<PathBuf>,
    /// Directories written by `ferrotron profile --out` (their profile.json): runs measured here.
    #[arg(long, num_args = 1..)]
    profile: Vec<PathBuf>,
    /// Measure this machine (GEMM shapes, attention, memory bandwidth, the FMA peak) and cache the
    /// result as the `this-machine` cluster for this CPU.
    #[arg(long)]
    this_machine: bool,
    /// The cluster whose constants are the starting point (default: dgx-a100-80g for --runs, the
    /// profiles' own cluster for --profile, this-machine for --this-machine, whose links are
    /// measured against the threads backend's fixed interconnect whatever this names).
    #[arg(long)]
    cluster: Option<String>,
    /// The constants to fit, comma-separated (default: every one, in the order gemm_efficiency_max,
    /// gemm_half_width, attention_efficiency, link_efficiency, dp_overlap,
    /// memory_bandwidth_bytes_per_s, intra_node.latency_s, inter_node.latency_s; n runs move the
    /// first n − 1).
    #[arg(long, value_delimiter = ',')]
    fit: Vec<String>,
    /// Where the cluster file goes.
    #[arg(long, default_value = "cluster.toml")]
    out: PathBuf,
    /// Also report each run predicted by constants fitted to the others (one fit per run).
    #[arg(long)]
    leave_one_out: bool,
    /// Fit to these runs only (their names, comma-separated) and report how the constants predict
    /// every other run: whether a fit on a few runs carries to the rest of its table.
    #[arg(long, value_delimiter = ',', conflicts_with = "leave_one_out")]
    fit_on: Vec<String>,
}

/// One `[[run]]` of a runs file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunEntry {
    name: Option<String>,
    model: String,
    layout: String,
    seq: usize,
    global_batch: usize,
    nodes: usize,
    precision: Option<String>,
    /// `flash` (default) or `materialized`: what the run's attention kept for backward.
    attention: Option<String>,
    step_time_s: Option<f64>,
    tflops_per_device: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunsFile {
    run: Vec<RunEntry>,
}

/// What `profile --out` records for calibration (`profile.json`).
#[derive(Deserialize)]
struct ProfileRecord {
    model: String,
    layout: String,
    seq: usize,
    global_batch: usize,
    cluster: String,
    precision: String,
    step_time_s: MeasuredPredicted,
}

#[derive(Deserialize)]
struct MeasuredPredicted {
    measured: f64,
}

fn run_entry(i: usize, e: RunEntry, file: &Path) -> Result<MeasuredRun> {
    let name = e.name.clone().unwrap_or_else(|| format!("run {}", i + 1));
    let at = || format!("{}: [[run]] `{name}`", file.display());
    let layout = LayoutSpec::parse(&e.layout).with_context(at)?;
    if !layout.auto_keys.is_empty() {
        bail!("{}: the layout must give values, not auto", at());
    }
    let measured = match (e.step_time_s, e.tflops_per_device) {
        (Some(t), None) if t.is_finite() && t > 0.0 => Measured::StepTime(t),
        (None, Some(f)) if f.is_finite() && f > 0.0 => Measured::TflopsPerDevice(f),
        _ => bail!(
            "{}: give exactly one of step_time_s or tflops_per_device, a positive number",
            at()
        ),
    };
    if e.seq == 0 || e.global_batch == 0 || e.nodes == 0 {
        bail!("{}: seq, global_batch and nodes must be positive", at());
    }
    Ok(MeasuredRun {
        name: name.clone(),
        model: PlanModel::parse(&e.model).with_context(at)?,
        layout: layout.layout,
        seq: e.seq,
        global_batch: e.global_batch,
        nodes: e.nodes,
        precision: StateDtypes::parse(e.precision.as_deref().unwrap_or("")).with_context(at)?,
        attention: AttentionKernel::parse(e.attention.as_deref().unwrap_or("flash"))
            .with_context(at)?,
        measured,
    })
}

fn read_runs(path: &Path) -> Result<Vec<MeasuredRun>> {
    let text = ferrotron_core::bounded::read_to_string(path, ferrotron_core::bounded::RECORDS)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let file: RunsFile =
        toml::from_str(&text).with_context(|| format!("{}: not a runs file", path.display()))?;
    file.run
        .into_iter()
        .enumerate()
        .map(|(i, e)| run_entry(i, e, path))
        .collect()
}

/// A profile directory's run, and the cluster it was measured on.
fn read_profile(dir: &Path) -> Result<(MeasuredRun, String)> {
    let path = dir.join("profile.json");
    let text = ferrotron_core::bounded::read_to_string(&path, ferrotron_core::bounded::RECORDS)
        .with_context(|| {
            format!(
                "{}: cannot read (write it with `ferrotron profile --out {}`)",
                path.display(),
                dir.display()
            )
        })?;
    let r: ProfileRecord =
        serde_json::from_str(&text).with_context(|| format!("{}: malformed", path.display()))?;
    let cluster = Cluster::parse(&r.cluster)?;
    Ok((
        MeasuredRun {
            name: dir.display().to_string(),
            model: PlanModel::parse(&r.model)?,
            layout: LayoutSpec::parse(&r.layout)?.layout,
            seq: r.seq,
            global_batch: r.global_batch,
            nodes: cluster.nodes,
            precision: StateDtypes::parse(&r.precision)?,
            attention: AttentionKernel::Flash,
            measured: Measured::StepTime(r.step_time_s.measured),
        },
        r.cluster,
    ))
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    let params: Vec<FitParam> = if a.fit.is_empty() {
        DEFAULT_FIT.to_vec()
    } else {
        a.fit
            .iter()
            .map(|s| FitParam::parse(s.trim()))
            .collect::<Result<_, _>>()?
    };
    if a.this_machine {
        if a.runs.is_some() || !a.profile.is_empty() {
            bail!(
                "--this-machine measures this machine; give --runs or --profile in a second call"
            );
        }
        let base = Cluster::parse(a.cluster.as_deref().unwrap_or("this-machine"))?;
        return this_machine::run(base, &a.out);
    }
    let (runs, base_spec) = measured_runs(&a)?;
    let start = Cluster::parse(&base_spec)?;
    // n runs pin down at most n − 1 constants and still say something about the fit: the first of
    // `--fit` move, the rest stay at the starting cluster's.
    let fitted_runs = if a.fit_on.is_empty() {
        runs.len()
    } else {
        a.fit_on.len()
    };
    let mut params = params;
    if fitted_runs <= params.len() && params.len() > 1 {
        let kept = fitted_runs.saturating_sub(1).max(1);
        println!(
            "{fitted_runs} run{} pin down at most {kept} constant{}: fitting {}, keeping {} at `{base_spec}`'s",
            if fitted_runs == 1 { "" } else { "s" },
            if kept == 1 { "" } else { "s" },
            params[..kept].iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
            params[kept..].iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
        );
        params.truncate(kept);
    }
    let (mut fitted, errors) = if a.leave_one_out {
        fit_with_errors(&runs, &start, &params)?
    } else if !a.fit_on.is_empty() {
        fit_on(&runs, &a.fit_on, &start, &params)?
    } else {
        fit_all(&runs, &start, &params)?
    };
    // The error the fitted cluster carries, by which `plan` tells close candidates apart: that of
    // the runs left out when measured, else that of the fit.
    let mean_abs = |v: Vec<f64>| v.iter().map(|e| e.abs()).sum::<f64>() / v.len().max(1) as f64;
    let left_out: Vec<f64> = errors.iter().filter_map(|e| e.left_out).collect();
    fitted.calibration.step_time_error = Some(if left_out.is_empty() {
        mean_abs(errors.iter().map(|e| e.after).collect())
    } else {
        mean_abs(left_out)
    });
    println!(
        "ferrotron calibrate: {} runs, fitting {} from `{base_spec}`",
        runs.len(),
        params
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    print!("{}", error_table(&runs, &errors).markdown());
    print_error_summary(&errors, a.leave_one_out, runs.len());
    for p in &params {
        println!(
            "  {} {:.6e} -> {:.6e}",
            p.name(),
            p.get(&start),
            p.get(&fitted)
        );
    }
    let header = format!(
        "ferrotron calibrate: {} fitted to {} measured runs (from `{base_spec}`)",
        params
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", "),
        runs.len()
    );
    write_cluster(&a.out, &fitted, &header)
}

/// The runs to fit (the `--runs` file's and the `--profile` directories') and the cluster to start
/// the fit from: `--cluster`, or the profiles' own (all the same), or a DGX A100.
fn measured_runs(a: &CalibrateArgs) -> Result<(Vec<MeasuredRun>, String)> {
    let mut runs = Vec::new();
    let mut profile_clusters = Vec::new();
    if let Some(path) = &a.runs {
        runs.extend(read_runs(path)?);
    }
    for dir in &a.profile {
        let (run, cluster) = read_profile(dir)?;
        runs.push(run);
        profile_clusters.push(cluster);
    }
    if runs.is_empty() {
        bail!("nothing to fit: give --runs FILE.toml, --profile DIR… or --this-machine");
    }
    let base_spec = match (&a.cluster, a.runs.is_some(), profile_clusters.first()) {
        (Some(c), _, _) => c.clone(),
        (None, false, Some(first)) => {
            if profile_clusters.iter().any(|c| c != first) {
                bail!("the profiles were measured on different clusters ({}); name the one to fit with --cluster", profile_clusters.join(", "));
            }
            first.clone()
        }
        _ => "dgx-a100-80g".to_string(),
    };
    Ok((runs, base_spec))
}

fn error_table(runs: &[MeasuredRun], errors: &[RunErrors]) -> Table {
    let mut t = Table::new(
        "each run: measured, and the prediction's error before and after the fit",
        &[
            "run",
            "layout",
            "measured",
            "error before (%)",
            "error after (%)",
            "left out (%)",
        ],
    );
    for (r, e) in runs.iter().zip(errors) {
        let measured = match r.measured {
            Measured::StepTime(s) => format!("{s:.4} s/step"),
            Measured::TflopsPerDevice(f) => format!("{f:.1} TFLOP/s"),
        };
        t.row(vec![
            e.name.clone(),
            r.layout.to_string(),
            measured,
            format!("{:+.2}", 100.0 * e.before),
            format!("{:+.2}", 100.0 * e.after),
            e.left_out
                .map_or("-".into(), |v| format!("{:+.2}", 100.0 * v)),
        ]);
    }
    t
}

/// Fits the parameters to every run at once; each run's error before and after.
fn fit_all(
    runs: &[MeasuredRun],
    start: &Cluster,
    params: &[FitParam],
) -> Result<(Cluster, Vec<RunErrors>)> {
    let fitted = ferrotron_core::plan::calibrate::fit(runs, start, params)?;
    let errors = runs
        .iter()
        .map(|r| {
            Ok(RunErrors {
                name: r.name.clone(),
                measured: r.value(),
                before: r.error(start)?,
                after: r.error(&fitted)?,
                left_out: None,
            })
        })
        .collect::<Result<Vec<_>, ferrotron_core::ConfigError>>()?;
    Ok((fitted, errors))
}

/// Fits the parameters to the runs named `names` only; each other run's error under that fit is its
/// "left out" figure (held out of the fit).
fn fit_on(
    runs: &[MeasuredRun],
    names: &[String],
    start: &Cluster,
    params: &[FitParam],
) -> Result<(Cluster, Vec<RunErrors>)> {
    // `--fit-on "a, b"` names `a` and `b`.
    let names: Vec<String> = names.iter().map(|n| n.trim().to_string()).collect();
    if let Some(missing) = names.iter().find(|n| !runs.iter().any(|r| &r.name == *n)) {
        bail!(
            "--fit-on: no run is named `{missing}` (runs: {})",
            runs.iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let chosen: Vec<MeasuredRun> = runs
        .iter()
        .filter(|r| names.contains(&r.name))
        .cloned()
        .collect();
    let fitted = ferrotron_core::plan::calibrate::fit(&chosen, start, params)?;
    let errors = runs
        .iter()
        .map(|r| {
            let held_out = !names.contains(&r.name);
            Ok(RunErrors {
                name: r.name.clone(),
                measured: r.value(),
                before: r.error(start)?,
                after: r.error(&fitted)?,
                left_out: if held_out {
                    Some(r.error(&fitted)?)
                } else {
                    None
                },
            })
        })
        .collect::<Result<Vec<_>, ferrotron_core::ConfigError>>()?;
    Ok((fitted, errors))
}

/// Mean and worst |error| before and after the fit (and left out, when asked).
fn print_error_summary(errors: &[RunErrors], leave_one_out: bool, runs: usize) {
    let summary = |pick: &dyn Fn(&RunErrors) -> Option<f64>| {
        let v: Vec<f64> = errors.iter().filter_map(pick).map(f64::abs).collect();
        (
            100.0 * v.iter().sum::<f64>() / v.len().max(1) as f64,
            100.0 * v.iter().copied().fold(0.0, f64::max),
        )
    };
    let (mb, xb) = summary(&|e| Some(e.before));
    let (ma, xa) = summary(&|e| Some(e.after));
    println!("mean |error| before {mb:.2}% (max {xb:.2}%), after {ma:.2}% (max {xa:.2}%)");
    if leave_one_out {
        if runs < 2 {
            println!("leave-one-out: needs two runs or more (one run cannot be left out)");
        } else {
            let (ml, xl) = summary(&|e| e.left_out);
            println!("leave-one-out: mean |error| {ml:.2}% (max {xl:.2}%)");
        }
    } else if errors.iter().any(|e| e.left_out.is_some()) {
        let held = errors.iter().filter(|e| e.left_out.is_some()).count();
        let (mh, xh) = summary(&|e| e.left_out);
        println!(
            "held out of the fit ({held} of {runs} runs): mean |error| {mh:.2}% (max {xh:.2}%)"
        );
    }
}

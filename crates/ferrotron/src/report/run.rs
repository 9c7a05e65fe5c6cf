//! The page of a training run (`train --report`, or `ferrotron report DIR` afterwards), made from
//! what the run recorded: `metrics.jsonl` (one line per step) and `train_config.json`.

use super::lines::{line_chart, Series, PALETTE};
use super::memory::{bars_svg, Limit};
use super::svg::Unit;
use super::{page, show_bytes, Section, Table};
use anyhow::{bail, Context, Result};
use ferrotron_core::plan::MemoryTerms;
use ferrotron_core::topology::Cluster;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// One line of `metrics.jsonl`, the fields the page uses.
#[derive(Deserialize)]
struct StepLine {
    step: usize,
    loss: f64,
    tokens_per_s: f64,
    val_loss: Option<f64>,
    #[serde(default)]
    warnings: Vec<String>,
    #[serde(default)]
    layout: String,
    #[serde(default)]
    devices: Vec<DeviceLine>,
}

#[derive(Deserialize)]
struct DeviceLine {
    device: usize,
    stage: usize,
    dp_rank: usize,
    /// Runs recorded before context parallelism: 0.
    #[serde(default)]
    cp_rank: usize,
    tp_rank: usize,
    idle_fraction: f64,
    peak_memory_bytes: MemoryTerms,
    predicted_memory_bytes: MemoryTerms,
    /// What the peak was made of (runs recorded before this field: each term's own peak).
    #[serde(default)]
    memory_at_peak_bytes: Option<MemoryTerms>,
}

/// One device's row in a measured-against-predicted memory table.
pub struct DeviceRow {
    pub device: usize,
    pub stage: usize,
    pub dp_rank: usize,
    pub cp_rank: usize,
    pub tp_rank: usize,
    pub measured: MemoryTerms,
    pub predicted: MemoryTerms,
    /// Idle fraction in the last step.
    pub idle_fraction: f64,
    /// Cells under the caller's `extra_headers`.
    pub extra: Vec<String>,
}

/// Per device and per term, the measured peak against the planner's prediction: the table the
/// terminal prints at the end of `train` and the run page shows.
pub fn device_table(caption: &str, rows: &[DeviceRow], extra_headers: &[&str]) -> Table {
    // A cp column only where sequences were split.
    let split = rows.iter().any(|d| d.cp_rank > 0);
    let mut headers = vec!["device", "stage", "dp"];
    if split {
        headers.push("cp");
    }
    headers.push("tp");
    headers.extend_from_slice(&super::TERM_COLUMNS);
    headers.push("idle (%)");
    headers.extend_from_slice(extra_headers);
    let mut table = Table::new(caption, &headers);
    for d in rows {
        let (m, p) = (&d.measured, &d.predicted);
        let pair = |a: u64, b: u64| format!("{} / {}", show_bytes(a), show_bytes(b));
        let mut cells = vec![
            d.device.to_string(),
            d.stage.to_string(),
            d.dp_rank.to_string(),
        ];
        if split {
            cells.push(d.cp_rank.to_string());
        }
        cells.extend([
            d.tp_rank.to_string(),
            pair(m.weights, p.weights),
            pair(m.gradients, p.gradients),
            pair(m.master_weights, p.master_weights),
            pair(m.optimizer_states, p.optimizer_states),
            pair(m.activations, p.activations),
            pair(m.comm_buffers, p.comm_buffers),
            pair(m.total, p.total),
            format!("{:.1}", 100.0 * d.idle_fraction),
        ]);
        cells.extend(d.extra.iter().cloned());
        table.row(cells);
    }
    table
}

/// The steps of the run in order; a step recorded twice (a resumed run) keeps its last record.
fn read_steps(dir: &Path) -> Result<Vec<StepLine>> {
    let path = dir.join("metrics.jsonl");
    let text = ferrotron_core::bounded::read_to_string(&path, ferrotron_core::bounded::RECORDS)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let mut steps = BTreeMap::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let s: StepLine = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a step record", path.display(), i + 1))?;
        steps.insert(s.step, s);
    }
    if steps.is_empty() {
        bail!("{}: no steps recorded", path.display());
    }
    Ok(steps.into_values().collect())
}

/// Each device's memory capacity, from the run's settings (its `device_memory`, else its cluster).
fn capacity(dir: &Path) -> Result<u64> {
    let path = dir.join("train_config.json");
    let text = ferrotron_core::bounded::read_to_string(&path, ferrotron_core::bounded::RECORDS)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if let Some(spec) = cfg["device_memory"].as_str() {
        return Ok(ferrotron_engine::runtime::parse_bytes(spec)?);
    }
    let cluster = cfg["cluster"].as_str().unwrap_or("this-machine");
    Ok(Cluster::parse(cluster)?.device_memory_bytes)
}

/// The page of the run in `dir`.
pub fn run_page(dir: &Path) -> Result<String> {
    let steps = read_steps(dir)?;
    let capacity = capacity(dir)?;
    let last = steps.last().expect("at least one step");
    let [loss, speed, idle] = charts(&steps);
    let (memory, table) = memory_section(&steps, capacity);
    let warnings: Vec<String> = steps
        .iter()
        .flat_map(|s| {
            s.warnings
                .iter()
                .map(move |w| format!("step {}: {w}", s.step))
        })
        .collect();
    let speeds: Vec<f64> = steps.iter().skip(1).map(|s| s.tokens_per_s).collect();
    let mean_speed = if speeds.is_empty() {
        last.tokens_per_s
    } else {
        speeds.iter().sum::<f64>() / speeds.len() as f64
    };
    let val = steps.iter().rev().find_map(|s| s.val_loss);
    let devices = last.devices.len();
    let summary = format!(
        "{} steps on layout `{}` ({} device{}): training loss {:.4} → {:.4}{}; {:.0} tokens/s (mean after the first step)",
        steps.len(),
        last.layout,
        devices,
        if devices == 1 { "" } else { "s" },
        steps[0].loss,
        last.loss,
        val.map_or(String::new(), |v| format!(", last validation loss {v:.4}")),
        mean_speed
    );
    let straggler_section = if warnings.is_empty() {
        Section::new("straggler warnings").note("none: no device fell behind its stage")
    } else {
        Section::new("straggler warnings").list(&warnings)
    };
    Ok(page(
        &format!("ferrotron train: {}", dir.display()),
        &[
            Section::new("run").note(summary),
            Section::new("loss and speed").pictures(&[&loss, &speed]),
            Section::new("memory per device")
                .note(super::memory::AT_PEAK_NOTE)
                .pictures(&[&memory])
                .table(&table),
            Section::new("idle per device over the steps").pictures(&[&idle]),
            straggler_section,
        ],
    ))
}

/// The run's line charts: loss (training and validation), tokens per second, idle per device.
fn charts(steps: &[StepLine]) -> [String; 3] {
    let devices = steps.last().map_or(0, |l| l.devices.len());
    let step_of = |s: &StepLine| s.step as f64;
    let loss = line_chart(
        "loss",
        Unit::plain(""),
        false,
        &[
            Series {
                name: "training".into(),
                colour: PALETTE[0],
                points: steps.iter().map(|s| (step_of(s), s.loss)).collect(),
                dots: false,
            },
            Series {
                name: "validation".into(),
                colour: PALETTE[1],
                points: steps
                    .iter()
                    .filter_map(|s| s.val_loss.map(|v| (step_of(s), v)))
                    .collect(),
                dots: true,
            },
        ],
    );
    let speed = line_chart(
        "tokens per second",
        Unit::plain(""),
        true,
        &[Series {
            name: "tokens/s".into(),
            colour: PALETTE[2],
            points: steps.iter().map(|s| (step_of(s), s.tokens_per_s)).collect(),
            dots: false,
        }],
    );
    let idle = line_chart(
        "idle per device (bubble + blocked)",
        Unit::plain("%"),
        true,
        &(0..devices)
            .map(|d| Series {
                name: format!("device {d}"),
                colour: PALETTE[d % PALETTE.len()],
                points: steps
                    .iter()
                    .filter_map(|s| {
                        s.devices
                            .get(d)
                            .map(|x| (step_of(s), 100.0 * x.idle_fraction))
                    })
                    .collect(),
                dots: false,
            })
            .collect::<Vec<_>>(),
    );
    [loss, speed, idle]
}

/// Memory per device: each at its highest total over the run, by what it held then (the bars),
/// and each term's highest figure beside the planner's prediction (the table).
fn memory_section(steps: &[StepLine], capacity: u64) -> (String, Table) {
    let last = steps.last().expect("at least one step");
    let devices = last.devices.len();
    let peaks: Vec<MemoryTerms> = (0..devices)
        .map(|d| {
            steps
                .iter()
                .filter_map(|s| s.devices.get(d))
                .fold(MemoryTerms::default(), |m, x| {
                    m.max_each(&x.peak_memory_bytes)
                })
        })
        .collect();
    let bars: Vec<(String, MemoryTerms)> = (0..devices)
        .map(|d| {
            let at_peak = steps
                .iter()
                .filter_map(|s| s.devices.get(d))
                .map(|x| x.memory_at_peak_bytes.unwrap_or(x.peak_memory_bytes))
                .max_by_key(|m| m.total)
                .unwrap_or_default();
            (d.to_string(), at_peak)
        })
        .collect();
    let memory = bars_svg(
        "memory per device at its peak over the run, by term",
        &bars,
        &[Limit {
            name: "capacity",
            bytes: capacity,
            colour: "#c0392b",
        }],
    );
    let rows: Vec<DeviceRow> = last
        .devices
        .iter()
        .zip(&peaks)
        .map(|(d, m)| DeviceRow {
            device: d.device,
            stage: d.stage,
            dp_rank: d.dp_rank,
            cp_rank: d.cp_rank,
            tp_rank: d.tp_rank,
            measured: *m,
            predicted: d.predicted_memory_bytes,
            idle_fraction: d.idle_fraction,
            extra: Vec::new(),
        })
        .collect();
    let table = device_table(
        "per device: peak over the run, measured / the planner's prediction",
        &rows,
        &[],
    );
    (memory, table)
}

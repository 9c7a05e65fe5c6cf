//! The page of a training run (`train --report`, or `ferrotron report DIR` afterwards), made from
//! what the run recorded: `metrics.jsonl` (one line per step) and `train_config.json`.

use super::colours;
use super::lines::{line_chart, Series};
use super::memory::{bars_svg, Limit};
use super::svg::Unit;
use super::{page, RunFacts, Section, Table};
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
    /// On the run's first line: what was run (runs recorded before this field: none).
    #[serde(default)]
    run: Option<RunLine>,
}

/// The run's first line's record of what was run.
#[derive(Deserialize)]
struct RunLine {
    started_unix_s: u64,
    parameters: u64,
    trained_parameters: u64,
    initial_val_loss: Option<f64>,
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
    /// The idle fraction under `idle_header` (the last step's, or the mean over the run).
    pub idle_fraction: f64,
    /// Cells under the caller's `extra_headers`.
    pub extra: Vec<String>,
}

/// Per device and per term, the measured peak against the planner's prediction, in one unit for
/// the whole table (chosen from its largest figure, named in every header): the table the
/// terminal prints at the end of `train` and the run page shows. `other` is what the measured
/// total holds beyond the planner's terms (kernels' workspaces; not predicted).
pub fn device_table(
    caption: &str,
    rows: &[DeviceRow],
    idle_header: &str,
    extra_headers: &[&str],
) -> Table {
    // A cp column only where sequences were split.
    let split = rows.iter().any(|d| d.cp_rank > 0);
    let largest = rows
        .iter()
        .map(|d| d.measured.total.max(d.predicted.total))
        .max()
        .unwrap_or(0);
    let unit = Unit::bytes(largest as f64);
    let mut headers: Vec<String> = ["device", "stage", "dp"].map(String::from).to_vec();
    if split {
        headers.push("cp".into());
    }
    headers.push("tp".into());
    let (terms, total) = super::TERM_COLUMNS.split_at(6);
    for t in terms.iter().chain(["other"].iter()).chain(total) {
        headers.push(format!("{t} ({}), measured / predicted", unit.name));
    }
    headers.push(idle_header.into());
    headers.extend(extra_headers.iter().map(|h| h.to_string()));
    let header_refs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut table = Table::new(caption, &header_refs);
    // Figures in the table's unit, named in the headers.
    let decimals = if unit.divisor == 1.0 { 0 } else { 2 };
    let number = |b: u64| format!("{:.decimals$}", b as f64 / unit.divisor);
    for d in rows {
        let (m, p) = (&d.measured, &d.predicted);
        let pair = |a: u64, b: u64| format!("{} / {}", number(a), number(b));
        let mut cells = vec![
            d.device.to_string(),
            d.stage.to_string(),
            d.dp_rank.to_string(),
        ];
        if split {
            cells.push(d.cp_rank.to_string());
        }
        cells.push(d.tp_rank.to_string());
        cells.extend(m.terms().iter().zip(p.terms()).map(|(a, b)| pair(a.1, b.1)));
        let six: u64 = m.terms().iter().map(|t| t.1).sum();
        cells.push(format!("{} / —", number(m.total.saturating_sub(six))));
        cells.push(pair(m.total, p.total));
        cells.push(format!("{:.1}", 100.0 * d.idle_fraction));
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
fn capacity(cfg: &serde_json::Value) -> Result<u64> {
    if let Some(spec) = cfg["device_memory"].as_str() {
        return Ok(ferrotron_engine::runtime::parse_bytes(spec)?);
    }
    let cluster = cfg["cluster"].as_str().unwrap_or("this-machine");
    Ok(Cluster::parse(cluster)?.device_memory_bytes)
}

/// The run's settings as recorded in `train_config.json`.
fn settings(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("train_config.json");
    let text = ferrotron_core::bounded::read_to_string(&path, ferrotron_core::bounded::RECORDS)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))
}

/// What the run was, from its settings and its first line.
fn run_facts(cfg: &serde_json::Value, steps: &[StepLine], capacity: u64) -> Result<RunFacts> {
    let text = |k: &str, default: &str| cfg[k].as_str().unwrap_or(default).to_string();
    let number = |k: &str| cfg[k].as_u64().unwrap_or(0);
    let first = steps.first().expect("at least one step");
    let last = steps.last().expect("at least one step");
    let model = text("model", "?");
    let model = match first.run.as_ref() {
        Some(r) if r.trained_parameters < r.parameters => format!(
            "{model}, {} parameters ({} trained)",
            super::facts::count(r.parameters as f64),
            super::facts::count(r.trained_parameters as f64)
        ),
        Some(r) => format!(
            "{model}, {} parameters",
            super::facts::count(r.parameters as f64)
        ),
        None => model,
    };
    let cluster = Cluster::parse(&text("cluster", "this-machine"))?;
    let mut cluster_words = super::facts::cluster(&cluster);
    if cfg["device_memory"].is_string() {
        cluster_words.push_str(&format!(
            "; each device held to {}",
            super::show_bytes(capacity)
        ));
    }
    Ok(RunFacts {
        model,
        cluster: cluster_words,
        layout: format!("{} ({} devices)", last.layout, last.devices.len()),
        batch: format!("{} × {} tokens", number("batch_size"), number("seq_len")),
        precision: text("precision", "f32"),
        step: format!("steps {}–{} of {}", first.step, last.step, number("steps")),
        date: first.run.as_ref().map_or("not recorded".into(), |r| {
            format!("started {}", super::facts::date_of(r.started_unix_s))
        }),
    })
}

/// The page of the run in `dir`.
pub fn run_page(dir: &Path) -> Result<String> {
    let steps = read_steps(dir)?;
    let cfg = settings(dir)?;
    let capacity = capacity(&cfg)?;
    let facts = run_facts(&cfg, &steps, capacity)?;
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
    let initial_val = steps[0].run.as_ref().and_then(|r| r.initial_val_loss);
    let summary = format!(
        "{} steps: training loss {:.4} → {:.4}{}{}; {:.0} tokens/s (mean after the first step)",
        steps.len(),
        steps[0].loss,
        last.loss,
        initial_val.map_or(String::new(), |v| format!(
            ", validation loss {v:.4} before the first step"
        )),
        val.map_or(String::new(), |v| format!(
            ", {v:.4} at the last evaluation"
        )),
        mean_speed
    );
    let straggler_section = if warnings.is_empty() {
        Section::new("straggler warnings").note("none: no device fell behind its stage")
    } else {
        Section::new("straggler warnings").list(&warnings)
    };
    let model = cfg["model"].as_str().unwrap_or("?");
    Ok(page(
        &format!("ferrotron train: {model} — {}", last.layout),
        &facts,
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

/// The run's line charts: loss (training, and validation from before the first step), tokens
/// per second, idle per device.
fn charts(steps: &[StepLine]) -> [String; 3] {
    let devices = steps.last().map_or(0, |l| l.devices.len());
    let step_of = |s: &StepLine| s.step as f64;
    // The validation loss before the first step is drawn at step 0.
    let initial = steps
        .first()
        .and_then(|s| s.run.as_ref())
        .and_then(|r| r.initial_val_loss)
        .map(|v| (0.0, v));
    let loss = line_chart(
        "loss",
        Unit::plain(""),
        false,
        &[
            Series {
                name: "training".into(),
                colour: colours::TRAINING_LOSS.into(),
                points: steps.iter().map(|s| (step_of(s), s.loss)).collect(),
                dots: false,
            },
            Series {
                name: "validation".into(),
                colour: colours::VALIDATION_LOSS.into(),
                points: initial
                    .into_iter()
                    .chain(
                        steps
                            .iter()
                            .filter_map(|s| s.val_loss.map(|v| (step_of(s), v))),
                    )
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
            colour: colours::TOKENS_PER_S.into(),
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
                colour: colours::device(d, devices),
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
            colour: colours::CAPACITY,
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
        "idle, last step (%)",
        &[],
    );
    (memory, table)
}

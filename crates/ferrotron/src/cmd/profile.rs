//! `ferrotron profile`: run a few steps of a layout and put every measured figure beside the planner's
//! prediction for the same layout, with a verdict where they disagree; write the trace, the pictures
//! and an HTML report.

use crate::profiling::{profile, trace, Profile, ProfileSettings};
use crate::report::profile::ProfileFacts;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct ProfileArgs {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// The layout to profile (every key given, or `auto` for the planner's choice).
    #[arg(long)]
    layout: ferrotron_core::layout::LayoutSpec,
    /// Sequences per step (the global batch).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Steps to run; of those after the first (which warms up), the one of median step time is
    /// reported.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The cluster the devices stand for (placement and predictions).
    #[arg(long, default_value = "this-machine")]
    cluster: String,
    /// Each device's memory (default: the cluster's).
    #[arg(long)]
    device_memory: Option<String>,
    /// Where the trace, the pictures and the report go.
    #[arg(long, default_value = "runs/profile")]
    out: PathBuf,
    /// A measured figure further than this from the prediction gets a verdict (idle: absolute; bytes
    /// and memory: relative).
    #[arg(long, default_value_t = 0.15)]
    threshold: f64,
    /// A device computing this fraction above its stage's median is a straggler.
    #[arg(long, default_value_t = 0.5)]
    straggler_threshold: f64,
    /// Drills: make this device compute --slow-device-ms longer per action.
    #[arg(long)]
    slow_device: Option<usize>,
    #[arg(long, default_value_t = 10.0)]
    slow_device_ms: f64,
    /// Print one JSON object (layout, step time measured and predicted, its parts, the verdicts)
    /// instead of the tables.
    #[arg(long)]
    json: bool,
}

pub fn run(a: ProfileArgs) -> Result<()> {
    let p = profile(&ProfileSettings {
        model: a.model.clone(),
        layout: a.layout.clone(),
        batch: a.batch,
        seq: a.seq,
        steps: a.steps,
        cluster: a.cluster.clone(),
        device_memory: a.device_memory.clone(),
        threshold: a.threshold,
        straggler_threshold: a.straggler_threshold,
        slow_device: a.slow_device,
        slow_device_ms: a.slow_device_ms,
    })?;
    let record = record_of(&a, &p);
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("{}: cannot create", a.out.display()))?;
    let record_path = a.out.join("profile.json");
    std::fs::write(&record_path, serde_json::to_string_pretty(&record)?)
        .with_context(|| format!("{}: cannot write", record_path.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        println!(
            "ferrotron profile: {} on {} devices, layout {}, batch {} x {} tokens, step {} of {} \
             (the median step by time; device time; the planner's prediction for the same layout \
             beside each figure)\n",
            a.model,
            p.layout.world_size(),
            p.layout,
            a.batch,
            a.seq,
            p.devices[0].report.step + 1,
            a.steps
        );
        for t in [
            &p.times.table(a.threshold),
            &p.tables.devices,
            &p.tables.links,
            &p.tables.memory,
        ] {
            println!("{}", t.markdown());
        }
        println!(
            "MFU {:.1}% measured, {:.1}% predicted (the planner's model FLOPs over the step time \
             and the cluster's peak)\n",
            100.0 * p.plan.mfu_at(p.times.step.measured),
            100.0 * p.plan.mfu
        );
        println!("verdicts:");
        for v in &p.verdicts {
            println!("- {v}");
        }
    }
    let written = write_report(&a, p)?;
    if !a.json {
        println!(
            "\nwritten to {}: {} (trace.json opens in Perfetto)",
            a.out.display(),
            written.join(", ")
        );
    }
    Ok(())
}

/// `profile.json`: the step's times measured and predicted, and the verdicts.
fn record_of(a: &ProfileArgs, p: &Profile) -> serde_json::Value {
    let t = &p.times;
    serde_json::json!({
        "model": a.model,
        "layout": p.layout.to_string(),
        "seq": a.seq,
        "global_batch": a.batch,
        "cluster": a.cluster,
        "precision": p.input.precision.spec(),
        // The reported step (1-based): the median by time of those after the first.
        "step": p.devices[0].report.step + 1,
        "steps": a.steps,
        "step_time_s": t.step.json(),
        "forward_s": t.forward.json(),
        "backward_s": t.backward.json(),
        "forward_comm_s": t.forward_comm.json(),
        "backward_comm_s": t.backward_comm.json(),
        "reduce_s": t.reduce.json(),
        "optimizer_s": t.optimizer.json(),
        // The planner's model FLOPs and peak over the measured step, and over its own.
        "mfu": {"measured": p.plan.mfu_at(t.step.measured), "predicted": p.plan.mfu},
        "verdicts": p.verdicts,
    })
}

/// The trace, the pictures and the report, written into `--out`; their names.
fn write_report(a: &ProfileArgs, p: Profile) -> Result<Vec<&'static str>> {
    let names: Vec<String> = p
        .coords
        .iter()
        .enumerate()
        .map(|(d, at)| match p.layout.cp {
            1 => format!("dev {d} s{} d{} t{}", at.pp, at.dp, at.tp),
            _ => format!("dev {d} s{} d{} c{} t{}", at.pp, at.dp, at.cp, at.tp),
        })
        .collect();
    let links = ferrotron_core::plan::links(&p.input.cluster, &p.layout);
    let trace = serde_json::to_string(&trace(&p.devices, &names))?;
    let l = &p.layout;
    // Only the groups this layout has (a group of one device moves nothing).
    let groups = [
        ("tp", l.tp, links.tp.bandwidth_bytes_per_s, vec!["tp"]),
        ("cp", l.cp, links.cp.bandwidth_bytes_per_s, vec!["cp"]),
        (
            "dp",
            l.dp * l.cp,
            links.dp.bandwidth_bytes_per_s,
            vec!["dp"],
        ),
        (
            "pp",
            l.pp,
            links.pp.bandwidth_bytes_per_s,
            vec!["p2p", "pp"],
        ),
    ];
    let step = p.devices[0].report.step + 1;
    let run = crate::report::plan::plan_facts(
        &p.input,
        &a.model,
        &p.plan,
        &format!(
            "step {step} of {}, the median by time (device time)",
            a.steps
        ),
    );
    let mut files = crate::report::profile::profile_files(ProfileFacts {
        run,
        layout: p.layout.to_string(),
        layout_map: crate::report::cluster::layout_map_svg(
            &p.layout,
            &p.input.cluster,
            &p.plan.comm_bytes_per_step,
        ),
        devices: names
            .iter()
            .cloned()
            .zip(p.devices.iter().map(|m| &m.report))
            .collect(),
        plan: &p.plan,
        predicted: crate::report::plan::predicted_panel(&p.input, &p.plan)?,
        capacity: p.input.cluster.device_memory_bytes,
        links: groups
            .into_iter()
            .filter(|g| g.1 > 1)
            .map(|(name, _, bandwidth, kinds)| (name, bandwidth, kinds))
            .collect(),
        time_table: p.times.table(a.threshold),
        device_table: p.tables.devices,
        link_table: p.tables.links,
        memory_table: p.tables.memory,
        verdicts: p.verdicts,
    });
    files.push(("trace.json", trace));
    for (name, body) in &files {
        let path = a.out.join(name);
        std::fs::write(&path, body).with_context(|| format!("{}: cannot write", path.display()))?;
    }
    Ok(files.iter().map(|f| f.0).collect())
}

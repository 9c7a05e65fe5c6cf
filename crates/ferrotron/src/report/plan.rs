//! The planner's page (`plan --out`) and the pictures of a predicted layout that `profile` reuses:
//! memory per stage by term, the simulated timeline, and the candidates the search compared.

use super::memory::{bars_svg, Limit};
use super::timeline::{Panel, Span, SpanKind};
use super::{page, show_bytes, Section, Table};
use ferrotron_core::plan::{simulated_timeline, Plan, PlanInput};

/// The capacity and the usable limit of a plan's devices, as lines on a memory chart.
pub fn limits(p: &Plan) -> Vec<Limit> {
    vec![
        Limit {
            name: "capacity",
            bytes: p.capacity_bytes,
            colour: "#c0392b",
        },
        Limit {
            name: "usable",
            bytes: p.usable_bytes,
            colour: "#e67e22",
        },
    ]
}

/// One bar per stage (a stage stands for each of its devices).
pub fn memory_picture(p: &Plan, title: &str) -> String {
    let bars: Vec<_> = p
        .memory_bytes_per_stage
        .iter()
        .enumerate()
        .map(|(s, m)| (format!("stage {s}"), *m))
        .collect();
    bars_svg(title, &bars, &limits(p))
}

/// The simulated schedule of one step, stages × time (none for a single stage).
pub fn predicted_panel(input: &PlanInput, p: &Plan) -> anyhow::Result<Option<Panel>> {
    let l = p.layout;
    Ok(simulated_timeline(input, &l)?.map(|tl| {
        let mut tracks: Vec<Vec<Span>> = (0..l.pp).map(|_| Vec::new()).collect();
        for e in &tl.events {
            tracks[e.stage].push(Span {
                kind: SpanKind::Action(e.action),
                start: e.start,
                end: e.end,
            });
        }
        Panel {
            title: "predicted (planner)".into(),
            names: (0..l.pp).map(|s| format!("stage {s}")).collect(),
            tracks,
        }
    }))
}

/// Memory per stage by term, in one unit chosen from the largest stage.
pub fn stage_table(p: &Plan, stages: &[usize]) -> Table {
    let largest = p.memory_bytes_per_stage.iter().map(|m| m.total).max();
    let unit = super::svg::Unit::bytes(largest.unwrap_or(0) as f64);
    let head = |t: &str| format!("{t} ({})", unit.name);
    let timed = !p.compute_time_per_stage_s.is_empty();
    let mut headers: Vec<String> = vec!["stage".to_string()];
    if !p.layers_per_stage.is_empty() {
        headers.push("layers".into());
    }
    headers.extend(super::TERM_COLUMNS.map(head));
    if timed {
        headers.extend(["compute (s)".to_string(), "idle (%)".to_string()]);
    }
    let mut t = Table {
        caption: format!(
            "per stage: layers, memory per device, compute and idle (capacity {}, usable {})",
            show_bytes(p.capacity_bytes),
            show_bytes(p.usable_bytes)
        ),
        headers,
        rows: Vec::new(),
    };
    let v = |b: u64| format!("{:.2}", b as f64 / unit.divisor);
    for &s in stages {
        let m = &p.memory_bytes_per_stage[s];
        let mut row = vec![s.to_string()];
        if let Some(n) = p.layers_per_stage.get(s) {
            row.push(n.to_string());
        }
        row.extend(m.terms().iter().map(|t| v(t.1)));
        row.push(v(m.total));
        if timed {
            row.push(format!("{:.4}", p.compute_time_per_stage_s[s]));
            row.push(format!("{:.1}", 100.0 * p.bubble_fraction_per_stage[s]));
        }
        t.row(row);
    }
    t
}

/// The layouts a search compared (or the one evaluated), best first.
pub fn candidate_table(plans: &[Plan]) -> Table {
    let mut t = Table::new(
        "candidates, best first",
        &[
            "#",
            "layout",
            "micro-batches",
            "fits",
            "peak per device",
            "bubble (%)",
            "step (s)",
            "tokens/s",
            "TFLOP/s per device",
            "MFU (%)",
        ],
    );
    for (i, p) in plans.iter().enumerate() {
        t.row(vec![
            (i + 1).to_string(),
            p.layout.to_string(),
            p.num_micro_batches.to_string(),
            if p.fits { "yes" } else { "no" }.into(),
            show_bytes(p.memory_bytes.total),
            format!("{:.1}", 100.0 * p.bubble_fraction),
            format!("{:.4}", p.step_time_s),
            format!("{:.0}", p.tokens_per_s),
            format!("{:.2}", p.tflops_per_device),
            format!("{:.1}", 100.0 * p.mfu),
        ]);
    }
    t
}

/// The files `plan --out` writes: the page and its pictures on their own.
pub fn plan_files(
    input: &PlanInput,
    chosen: &Plan,
    candidates: &[Plan],
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let l = chosen.layout;
    let memory = memory_picture(chosen, "predicted memory per device, by stage and term");
    let mut files = Vec::new();
    let summary = format!(
        "{} on {} devices — {}: {} micro-batches, bubble {:.1}%, step {:.4} s, {:.0} tokens/s, MFU {:.1}%",
        l,
        l.world_size(),
        if chosen.fits { "fits" } else { "does not fit" },
        chosen.num_micro_batches,
        100.0 * chosen.bubble_fraction,
        chosen.step_time_s,
        chosen.tokens_per_s,
        100.0 * chosen.mfu
    );
    let all: Vec<usize> = (0..l.pp).collect();
    let mut sections = vec![
        Section::new("layout").note(summary).list(&chosen.explain),
        Section::new("memory per stage")
            .pictures(&[&memory])
            .table(&stage_table(chosen, &all)),
    ];
    if let Some(panel) = predicted_panel(input, chosen)? {
        let tl = super::timeline::timeline_svg("predicted timeline of one step", None, &[panel]);
        sections.push(Section::new("predicted timeline").pictures(&[&tl]));
        files.push(("timeline_predicted.svg", tl));
    }
    sections.push(Section::new("candidates").table(&candidate_table(candidates)));
    files.push(("memory_predicted.svg", memory));
    files.push((
        "report.html",
        page(&format!("ferrotron plan: {l}"), &sections),
    ));
    Ok(files)
}

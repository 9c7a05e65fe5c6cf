//! The planner's page (`plan --out`) and the pictures of a predicted layout that `profile` reuses:
//! the layout on the cluster, memory per stage by term, the simulated timeline of the whole step,
//! the search's reasoning, and the candidates it compared (one row per distinct shape).

use super::colours;
use super::memory::{bars_svg, Limit};
use super::timeline::{Panel, Span, SpanKind};
use super::{page, show_bytes, RunFacts, Section, Table};
use ferrotron_core::plan::{simulated_timeline, Plan, PlanInput};

/// The capacity and the usable limit of a plan's devices, as lines on a memory chart.
pub fn limits(p: &Plan) -> Vec<Limit> {
    vec![
        Limit {
            name: "capacity",
            bytes: p.capacity_bytes,
            colour: colours::CAPACITY,
        },
        Limit {
            name: "usable",
            bytes: p.usable_bytes,
            colour: colours::USABLE,
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

/// The simulated schedule of one whole step, stages × time: every action, then (where the schedule
/// does not hold them in its lists) each stage's gradient reduction and optimizer step, as the
/// planner prices them after the last action. The actions start once the gradients are zeroed,
/// as the measured step's do.
pub fn predicted_panel(input: &PlanInput, p: &Plan) -> anyhow::Result<Option<Panel>> {
    let l = p.layout;
    Ok(simulated_timeline(input, &l)?.map(|tl| {
        let zeroed = if l.schedule.is_async() {
            0.0 // the lists hold it with each update
        } else {
            p.grad_zeroing_time_s
        };
        let mut tracks: Vec<Vec<Span>> = (0..l.pp).map(|_| Vec::new()).collect();
        for e in &tl.events {
            tracks[e.stage].push(Span {
                kind: SpanKind::Action(e.action),
                start: zeroed + e.start,
                end: zeroed + e.end,
            });
        }
        if !l.schedule.is_async() {
            // The norm's read beside the reduction, as the measured timeline's "gradient
            // reductions + global norm" holds it.
            let last = zeroed + tl.makespan;
            let reduced = last + p.dp_comm_time_s + p.grad_norm_time_s;
            for track in &mut tracks {
                for (kind, start, end) in [
                    (SpanKind::Reduce, last, reduced),
                    (SpanKind::Update, reduced, reduced + p.optimizer_time_s),
                ] {
                    if end > start {
                        track.push(Span { kind, start, end });
                    }
                }
            }
        }
        Panel {
            title: "predicted (planner)".into(),
            row: "predicted",
            names: (0..l.pp).map(|s| format!("stage {s}")).collect(),
            devices: (0..l.pp).map(|s| format!("stage {s}")).collect(),
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

/// The shape a reader chooses between: how the devices are cut (dp, tp, pp, cp) and how far the
/// optimizer state is sharded. Layouts of one shape differ only in how they run it (interleaving,
/// micro-batch size, schedule).
fn shape(p: &Plan) -> (usize, usize, usize, usize, u8) {
    let l = &p.layout;
    (l.dp, l.tp, l.pp, l.cp, l.zero)
}

/// The layouts a search compared (or the one evaluated), best first: the best of each distinct
/// shape (up to `shown` shapes), the variants of its shape folded into its row (their vpp,
/// micro-batch size, schedule and step).
pub fn candidate_table(input: &PlanInput, plans: &[Plan], shown: usize) -> Table {
    let mut t = Table::new(
        "candidates, best first: the best layout of each shape (dp, tp, pp, cp, ZeRO), its variants folded in",
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
            "step vs #1",
            "variants of this shape",
        ],
    );
    let mut shapes: Vec<(&Plan, Vec<&Plan>)> = Vec::new();
    for p in plans {
        match shapes.iter_mut().find(|(best, _)| shape(best) == shape(p)) {
            Some((_, variants)) => variants.push(p),
            None => shapes.push((p, Vec::new())),
        }
    }
    for (i, (p, variants)) in shapes.iter().take(shown.max(1)).enumerate() {
        let folded = fold_variants(variants);
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
            match (i, shapes.first()) {
                (0, _) | (_, None) => "—".into(),
                (_, Some((best, _))) => {
                    let slower = 100.0 * (p.step_time_s / best.step_time_s - 1.0);
                    match ferrotron_core::plan::within_error_of_best(input, best, p) {
                        Some(_) => format!("{slower:+.1}%, within error of #1"),
                        None => format!("{slower:+.1}%"),
                    }
                }
            },
            folded,
        ]);
    }
    t
}

/// A shape's other layouts in one cell: how many, the values they try, and their step times.
fn fold_variants(variants: &[&Plan]) -> String {
    if variants.is_empty() {
        return "none compared".into();
    }
    let values = |f: &dyn Fn(&Plan) -> String| {
        let mut v: Vec<String> = variants.iter().map(|p| f(p)).collect();
        v.sort();
        v.dedup();
        v.join("/")
    };
    let steps = variants.iter().map(|p| p.step_time_s);
    let (lo, hi) = steps.fold((f64::INFINITY, 0.0f64), |(a, b), t| (a.min(t), b.max(t)));
    format!(
        "vpp {}, mbs {}, {}: {} more, step {:.4}–{:.4} s",
        values(&|p| p.layout.vpp.to_string()),
        values(&|p| p.layout.micro_batch_size.to_string()),
        values(&|p| p.layout.schedule.name().to_string()),
        variants.len(),
        lo,
        hi
    )
}

/// What `plan --out` draws: the input, the layout chosen, the candidates compared, the model's name
/// as the user gave it, and the search's reasoning (the terminal's "why").
pub struct PlanPage<'a> {
    pub input: &'a PlanInput,
    pub model: &'a str,
    pub chosen: &'a Plan,
    pub candidates: &'a [Plan],
    /// Shapes the candidate table shows.
    pub shapes: usize,
    pub why: &'a [String],
}

/// What a plan was made for, as the page's opening says it.
pub fn plan_facts(input: &PlanInput, model: &str, p: &Plan, step: &str) -> RunFacts {
    RunFacts {
        model: super::facts::model(model, &input.model),
        cluster: super::facts::cluster(&input.cluster),
        layout: format!("{} ({} micro-batches)", p.layout, p.num_micro_batches),
        batch: format!("{} × {} tokens", input.global_batch, input.seq),
        precision: input.precision.spec(),
        step: step.into(),
        date: super::facts::today(),
    }
}

/// The files `plan --out` writes: the page and its pictures on their own.
pub fn plan_files(pg: &PlanPage) -> anyhow::Result<Vec<(&'static str, String)>> {
    let (input, chosen) = (pg.input, pg.chosen);
    let l = chosen.layout;
    let memory = memory_picture(chosen, "predicted memory per device, by stage and term");
    let map = super::cluster::layout_map_svg(&l, &input.cluster, &chosen.comm_bytes_per_step);
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
    let mut sections = Vec::new();
    if !pg.why.is_empty() {
        sections.push(
            Section::new("why this layout")
                .note("the planner's reasoning, as `plan` prints it: the arithmetic first, then reduce, shard, split, and the choice")
                .ordered(pg.why),
        );
    }
    sections.push(Section::new("layout").note(summary).list(&chosen.explain));
    sections.push(Section::new("the layout on the cluster").pictures(&[&map]));
    sections.push(
        Section::new("memory per stage")
            .pictures(&[&memory])
            .table(&stage_table(chosen, &all)),
    );
    if let Some(panel) = predicted_panel(input, chosen)? {
        let tl = super::timeline::timeline_svg("predicted timeline of one step", None, &[panel]);
        sections.push(Section::new("predicted timeline").pictures(&[&tl]));
        files.push(("timeline_predicted.svg", tl));
    }
    sections.push(
        Section::new("candidates")
            .note(ferrotron_core::plan::ranking_note(input))
            .table(&candidate_table(input, pg.candidates, pg.shapes)),
    );
    files.push(("memory_predicted.svg", memory));
    files.push(("layout_map.svg", map));
    let facts = plan_facts(input, pg.model, chosen, "one step, predicted");
    files.push((
        "report.html",
        page(
            &format!("ferrotron plan: {} — {l}", pg.model),
            &facts,
            &sections,
        ),
    ));
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::layout::LayoutSpec;
    use ferrotron_core::plan::{evaluate, PlanModel};
    use ferrotron_core::topology::Cluster;

    /// The predicted timeline is the whole step the planner prices: its actions (after the
    /// gradients are zeroed), the reduction and the optimizer step, ending at the predicted step
    /// time.
    #[test]
    fn the_predicted_timeline_ends_where_the_predicted_step_does() {
        for (cluster, layout) in [
            ("this-machine", "dp=1"),
            ("dgx-a100-80g,nodes=2", "dp=4,tp=2,pp=2,mbs=1"),
        ] {
            let input = PlanInput::new(
                PlanModel::parse("llama2-7b").unwrap(),
                Cluster::parse(cluster).unwrap(),
                1024,
                16,
            );
            let l = LayoutSpec::parse(layout).unwrap().layout;
            let p = evaluate(&input, &l).unwrap();
            let panel = predicted_panel(&input, &p).unwrap().expect("a timeline");
            let spans = || panel.tracks.iter().flatten();
            let end = spans().map(|s| s.end).fold(0.0, f64::max);
            let start = spans().map(|s| s.start).fold(f64::INFINITY, f64::min);
            let rel = (end - p.step_time_s).abs() / p.step_time_s;
            assert!(rel < 1e-9, "{layout}: {end} vs {}", p.step_time_s);
            assert!(p.grad_zeroing_time_s > 0.0, "{layout}");
            assert!(
                (start - p.grad_zeroing_time_s).abs() < 1e-12,
                "{layout}: the first action at {start}, the gradients zeroed at {}",
                p.grad_zeroing_time_s
            );
            let kinds: Vec<SpanKind> = panel.tracks[0].iter().map(|s| s.kind).collect();
            assert!(kinds.contains(&SpanKind::Update), "{layout}");
            // Every step reads its gradients for the global norm, replicas or not.
            assert!(kinds.contains(&SpanKind::Reduce), "{layout}");
        }
    }
}

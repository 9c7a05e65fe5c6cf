//! The profiler's page: the measured step beside the planner's prediction — both timelines on one
//! time axis, memory per device by term and over the step, bytes per group against the links.

use super::bytes::{bytes_svg, LinkBudget};
use super::colours;
use super::memory::{bars_svg, over_step_svg, Limit, MemoryTrace};
use super::timeline::{timeline_svg, Panel, Span, SpanKind};
use super::{page, RunFacts, Section, Table};
use ferrotron_core::plan::Plan;
use ferrotron_engine::parallel::StepReport;

/// What the profiler measured and predicted, ready to draw.
pub struct ProfileFacts<'a> {
    /// What was run, for the page's opening.
    pub run: RunFacts,
    pub layout: String,
    /// The layout drawn on the cluster.
    pub layout_map: String,
    /// Per device: its label (`dev 3 s1 d0 t1`) and its reported step.
    pub devices: Vec<(String, &'a StepReport)>,
    pub plan: &'a Plan,
    pub predicted: Option<Panel>,
    pub capacity: u64,
    /// Per group (tp, dp, pp): the link bandwidth and the kinds of traffic that travel on it.
    pub links: Vec<(&'static str, f64, Vec<&'static str>)>,
    /// The terminal's tables (the step's time by part, with a verdict each; time, idle and bytes
    /// per device; bytes on the links; memory), and the verdicts.
    pub time_table: Table,
    pub device_table: Table,
    pub link_table: Table,
    pub memory_table: Table,
    pub verdicts: Vec<String>,
}

/// Each device's actions, then its wait for the last device to finish its actions, its reductions
/// and its optimizer step. The reductions and the global norm need every device, so none of them
/// can start before the last device's actions end: what comes before that is waiting.
pub fn measured_panel(devices: &[(String, &StepReport)]) -> Panel {
    let last_arrival = devices
        .iter()
        .map(|(_, r)| r.reduce_s.0)
        .fold(f64::NEG_INFINITY, f64::max);
    Panel {
        title: "measured (device time)".into(),
        row: "measured",
        names: devices.iter().map(|d| d.0.clone()).collect(),
        devices: (0..devices.len()).map(|d| d.to_string()).collect(),
        tracks: devices
            .iter()
            .map(|(_, r)| {
                let mut t: Vec<Span> = r
                    .timeline
                    .iter()
                    .map(|&(a, start, end)| Span {
                        kind: SpanKind::Action(a),
                        start,
                        end,
                    })
                    .collect();
                let (arrived, reduced) = r.reduce_s;
                let waited = last_arrival.clamp(arrived, reduced);
                for (kind, (start, end)) in [
                    (SpanKind::Waiting, (arrived, waited)),
                    (SpanKind::Reduce, (waited, reduced)),
                    (SpanKind::Update, r.update_s),
                ] {
                    if end > start {
                        t.push(Span { kind, start, end });
                    }
                }
                t
            })
            .collect(),
    }
}

/// How the measured and predicted schedules compare, in words; every ratio is measured over
/// predicted.
fn timeline_note(measured: &Panel, predicted: Option<&Panel>, f: &ProfileFacts) -> String {
    let step_measured = f.devices.iter().map(|d| d.1.span_s).fold(0.0, f64::max);
    let ms = |s: f64| format!("{:.2} ms", s * 1e3);
    let mut note = format!(
        "whole step: measured {}, predicted {} (measured / predicted {:.2}×)",
        ms(step_measured),
        ms(f.plan.step_time_s),
        step_measured / f.plan.step_time_s.max(1e-12)
    );
    if let Some(p) = predicted {
        let actions_only = |panel: &Panel| Panel {
            title: String::new(),
            row: panel.row,
            names: Vec::new(),
            devices: Vec::new(),
            tracks: panel
                .tracks
                .iter()
                .map(|t| {
                    t.iter()
                        .filter(|s| matches!(s.kind, SpanKind::Action(_)))
                        .cloned()
                        .collect()
                })
                .collect(),
        };
        let (m, p) = (actions_only(measured).length(), actions_only(p).length());
        note = format!(
            "pipeline schedule: measured {}, predicted {} (measured / predicted {:.2}×); {note}",
            ms(m),
            ms(p),
            m / p.max(1e-12)
        );
    }
    note
}

/// The files `profile` writes besides the trace: the page and each picture on its own.
pub fn profile_files(f: ProfileFacts) -> Vec<(&'static str, String)> {
    let measured = measured_panel(&f.devices);
    let note = timeline_note(&measured, f.predicted.as_ref(), &f);
    let over_step = over_step_svg(&memory_traces(&f));
    let bytes = bytes_pictures(&f);
    let alone = timeline_svg(
        "measured timeline (device time)",
        None,
        std::slice::from_ref(&measured),
    );
    let mut files = vec![("timeline.svg", alone)];
    if let Some(p) = &f.predicted {
        files.push((
            "timeline_predicted.svg",
            timeline_svg(
                "predicted timeline (planner)",
                None,
                std::slice::from_ref(p),
            ),
        ));
    }
    let predicted_title = f.predicted.as_ref().map(|p| p.title.clone());
    let mut panels = vec![measured];
    panels.extend(f.predicted);
    let both = timeline_svg(
        "one step, measured and predicted, on one time axis",
        None,
        &panels,
    );
    let bars: Vec<_> = f
        .devices
        .iter()
        .enumerate()
        .map(|(d, r)| (d.to_string(), r.1.memory.terms_at_peak()))
        .collect();
    let memory = bars_svg(
        "measured memory per device at its peak, by term",
        &bars,
        &[Limit {
            name: "capacity",
            bytes: f.capacity,
            colour: colours::CAPACITY,
        }],
    );
    let predicted_memory =
        super::plan::memory_picture(f.plan, "predicted memory per device, by stage");
    files.push(("memory.svg", memory.clone()));
    files.push(("memory_predicted.svg", predicted_memory.clone()));
    let mut sections = vec![
        Section::new("verdicts").list(&f.verdicts),
        Section::new("time by part").table(&f.time_table),
        Section::new("the layout on the cluster").pictures(&[&f.layout_map]),
        Section::new("per device: time, idle and bytes").table(&f.device_table),
    ];
    let timeline_section = Section::new("timeline").note(note.clone());
    let timeline_section = match predicted_title {
        Some(_) => timeline_section,
        None => timeline_section
            .note("the planner simulates no schedule for this model: nothing to compare"),
    };
    sections.push(timeline_section.pictures(&[&both]));
    sections.push(
        Section::new("memory")
            .note(super::memory::AT_PEAK_NOTE)
            .pictures(&[&memory, &predicted_memory])
            .table(&f.memory_table),
    );
    let refs: Vec<&str> = over_step.iter().map(String::as_str).collect();
    sections.push(
        Section::new("memory over the step")
            .note("live bytes after each action, the reductions and the update; the dot marks the allocator's peak, in the interval where it happened")
            .pictures(&refs),
    );
    let refs: Vec<&str> = bytes.iter().map(String::as_str).collect();
    let links_section = Section::new("bytes per group against the links");
    let links_section = if refs.is_empty() {
        links_section
            .note("no group of this layout sent anything: one device, or nothing to exchange")
    } else {
        links_section.pictures(&refs)
    };
    sections.push(links_section.table(&f.link_table));
    files.push(("layout_map.svg", f.layout_map.clone()));
    files.push((
        "report.html",
        page(
            &format!("ferrotron profile: {}", f.layout),
            &f.run,
            &sections,
        ),
    ));
    files
}

/// Each device's live memory over the step, from its first sample.
fn memory_traces(f: &ProfileFacts) -> Vec<MemoryTrace> {
    f.devices
        .iter()
        .map(|(name, r)| {
            let t0 = r.memory_over_step.first().map_or(0.0, |s| s.time_s);
            MemoryTrace {
                name: format!("{name}: live memory over the step"),
                samples: r
                    .memory_over_step
                    .iter()
                    .map(|s| (s.time_s - t0, s.live_bytes, s.peak_bytes))
                    .collect(),
            }
        })
        .collect()
}

/// Per link group that carried something: the bytes each device sent, against what the link
/// carries in the step (a group that sent nothing gets no chart).
fn bytes_pictures(f: &ProfileFacts) -> Vec<String> {
    let span = f.devices.iter().map(|d| d.1.span_s).fold(0.0, f64::max);
    f.links
        .iter()
        .filter_map(|(group, bandwidth, kinds)| {
            let rows: Vec<(String, u64)> = f
                .devices
                .iter()
                .enumerate()
                .map(|(d, (_, r))| {
                    let sent = kinds.iter().map(|k| r.stats.bytes_sent_by_group(k)).sum();
                    (format!("device {d}"), sent)
                })
                .collect();
            rows.iter().any(|r| r.1 > 0).then(|| {
                bytes_svg(
                    &rows,
                    &LinkBudget {
                        group,
                        bandwidth_bytes_per_s: *bandwidth,
                        seconds: span,
                    },
                )
            })
        })
        .collect()
}

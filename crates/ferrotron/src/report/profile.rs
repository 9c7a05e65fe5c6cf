//! The profiler's page: the measured step beside the planner's prediction — both timelines on one
//! time axis, memory per device by term and over the step, bytes per group against the links.

use super::bytes::{bytes_svg, LinkBudget};
use super::memory::{bars_svg, over_step_svg, Limit, MemoryTrace};
use super::timeline::{timeline_svg, Panel, Span, SpanKind};
use super::{page, Section, Table};
use ferrotron_core::plan::Plan;
use ferrotron_engine::parallel::StepReport;

/// What the profiler measured and predicted, ready to draw.
pub struct ProfileFacts<'a> {
    pub layout: String,
    /// Per device: its label (`dev 3 s1 d0 t1`) and its reported step.
    pub devices: Vec<(String, &'a StepReport)>,
    pub plan: &'a Plan,
    pub predicted: Option<Panel>,
    pub capacity: u64,
    /// Per group (tp, dp, pp): the link bandwidth and the kinds of traffic that travel on it.
    pub links: Vec<(&'static str, f64, Vec<&'static str>)>,
    /// The terminal's tables (time, idle and bytes; bytes on the links; memory), and the verdicts.
    pub device_table: Table,
    pub link_table: Table,
    pub memory_table: Table,
    pub verdicts: Vec<String>,
}

/// Each device's actions, then its reductions and optimizer step.
pub fn measured_panel(devices: &[(String, &StepReport)]) -> Panel {
    Panel {
        title: "measured (device time)".into(),
        names: devices.iter().map(|d| d.0.clone()).collect(),
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
                for (kind, (start, end)) in [
                    (SpanKind::Reduce, r.reduce_s),
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

/// How the measured and predicted schedules compare, in words.
fn timeline_note(measured: &Panel, predicted: Option<&Panel>, f: &ProfileFacts) -> String {
    let step_measured = f.devices.iter().map(|d| d.1.span_s).fold(0.0, f64::max);
    let ms = |s: f64| format!("{:.2} ms", s * 1e3);
    let mut note = format!(
        "whole step: measured {}, predicted {} (the prediction is {:.2}× the measurement)",
        ms(step_measured),
        ms(f.plan.step_time_s),
        f.plan.step_time_s / step_measured.max(1e-12)
    );
    if let Some(p) = predicted {
        let actions_measured = Panel {
            title: String::new(),
            names: Vec::new(),
            tracks: measured
                .tracks
                .iter()
                .map(|t| {
                    t.iter()
                        .filter(|s| matches!(s.kind, SpanKind::Action(_)))
                        .cloned()
                        .collect()
                })
                .collect(),
        }
        .length();
        note = format!(
            "pipeline schedule: measured {}, predicted {} ({:.2}×); {note}",
            ms(actions_measured),
            ms(p.length()),
            p.length() / actions_measured.max(1e-12)
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
            colour: "#c0392b",
        }],
    );
    let predicted_memory =
        super::plan::memory_picture(f.plan, "predicted memory per device, by stage");
    files.push(("memory.svg", memory.clone()));
    files.push(("memory_predicted.svg", predicted_memory.clone()));
    let mut sections = vec![
        Section::new("verdicts").list(&f.verdicts),
        Section::new("per device: time, idle and bytes").table(&f.device_table),
    ];
    let timeline_section = Section::new("timeline").note(note.clone());
    let timeline_section = match predicted_title {
        Some(_) => timeline_section,
        None => timeline_section.note("one stage: the planner simulates no schedule to compare"),
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
    sections.push(
        Section::new("bytes per group against the links")
            .pictures(&refs)
            .table(&f.link_table),
    );
    files.push((
        "report.html",
        page(&format!("ferrotron profile: {}", f.layout), &sections),
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

/// Per link group: the bytes each device sent, against what the link carries in the step.
fn bytes_pictures(f: &ProfileFacts) -> Vec<String> {
    let span = f.devices.iter().map(|d| d.1.span_s).fold(0.0, f64::max);
    f.links
        .iter()
        .map(|(group, bandwidth, kinds)| {
            let rows: Vec<(String, u64)> = f
                .devices
                .iter()
                .enumerate()
                .map(|(d, (_, r))| {
                    let sent = kinds.iter().map(|k| r.stats.bytes_sent_by_group(k)).sum();
                    (format!("device {d}"), sent)
                })
                .collect();
            bytes_svg(
                &rows,
                &LinkBudget {
                    group,
                    bandwidth_bytes_per_s: *bandwidth,
                    seconds: span,
                },
            )
        })
        .collect()
}

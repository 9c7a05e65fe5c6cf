//! Pictures of a run, measured (`profile`) or predicted (`plan`): the pipeline timeline as an SVG
//! (tracks × time, one box per action coloured by kind with its micro-batch, bubbles as gaps), memory
//! per device stacked by term against the capacity as an SVG, and a self-contained HTML report that
//! shows them beside the tables.

use ferrotron_core::plan::MemoryTerms;
use ferrotron_core::schedule::Action;
use std::fmt::Write;

/// One action on one track, in seconds.
pub struct Box_ {
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn colour(a: &Action) -> &'static str {
    match a {
        Action::Forward { .. } => "#4c9be8",
        Action::Backward { .. } => "#e8794c",
        Action::BackwardInput { .. } => "#e8a34c",
        Action::BackwardWeight { .. } => "#9b6fd1",
    }
}

/// A timeline: one row per track (`names`), one `<rect class="action">` per action.
pub fn timeline_svg(title: &str, names: &[String], tracks: &[Vec<Box_>]) -> String {
    let t0 = tracks
        .iter()
        .flatten()
        .map(|b| b.start)
        .fold(f64::INFINITY, f64::min);
    let t1 = tracks.iter().flatten().map(|b| b.end).fold(0.0, f64::max);
    let span = (t1 - t0).max(1e-12);
    let (left, width, row, top) = (110.0, 900.0, 26.0, 30.0);
    let height = top + row * tracks.len() as f64 + 30.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="16" font-size="13">{}</text>"#,
        escape(title)
    );
    for (i, (name, track)) in names.iter().zip(tracks).enumerate() {
        let y = top + row * i as f64;
        let _ = writeln!(
            s,
            r##"<text x="4" y="{}">{}</text><rect x="{left}" y="{y}" width="{width}" height="{}" fill="#f2f2f2"/>"##,
            y + row * 0.65,
            escape(name),
            row - 4.0
        );
        for b in track {
            let x = left + (b.start - t0) / span * width;
            let w = ((b.end - b.start) / span * width).max(0.5);
            let _ = writeln!(
                s,
                r#"<rect class="action" x="{x:.2}" y="{y}" width="{w:.2}" height="{}" fill="{}" stroke="white" stroke-width="0.5"><title>{} {:.3}–{:.3} ms</title></rect>"#,
                row - 4.0,
                colour(&b.action),
                b.action,
                (b.start - t0) * 1e3,
                (b.end - t0) * 1e3
            );
            if w > 12.0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.2}" y="{}" fill="white" text-anchor="middle">{}</text>"#,
                    x + w / 2.0,
                    y + row * 0.6,
                    b.action.mb()
                );
            }
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{}">0</text><text x="{}" y="{}" text-anchor="end">{:.2} ms</text>"#,
        height - 8.0,
        left + width,
        height - 8.0,
        span * 1e3
    );
    s.push_str("</svg>\n");
    s
}

const TERMS: [(&str, &str); 6] = [
    ("weights", "#4c9be8"),
    ("gradients", "#e8794c"),
    ("master_weights", "#8bc34a"),
    ("optimizer_states", "#9b6fd1"),
    ("activations", "#f2c14e"),
    ("comm_buffers", "#7f8c8d"),
];

fn term_values(m: &MemoryTerms) -> [u64; 6] {
    [
        m.weights,
        m.gradients,
        m.master_weights,
        m.optimizer_states,
        m.activations,
        m.comm_buffers,
    ]
}

/// Memory per device, one stacked bar each (one `<rect class="term">` per term), and the capacity.
pub fn memory_svg(title: &str, names: &[String], memory: &[MemoryTerms], capacity: u64) -> String {
    let most = memory
        .iter()
        .map(|m| m.total)
        .chain(std::iter::once(capacity))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (left, height, bar, gap, top) = (60.0, 260.0, 36.0, 14.0, 30.0);
    let width = left + (bar + gap) * memory.len() as f64 + 180.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{}" font-family="sans-serif" font-size="11">"#,
        height + top + 40.0
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="16" font-size="13">{}</text>"#,
        escape(title)
    );
    for (i, (name, m)) in names.iter().zip(memory).enumerate() {
        let x = left + (bar + gap) * i as f64;
        let mut y = top + height;
        for ((term, fill), v) in TERMS.iter().zip(term_values(m)) {
            let h = v as f64 / most * height;
            y -= h;
            let _ = writeln!(
                s,
                r#"<rect class="term" x="{x}" y="{y:.2}" width="{bar}" height="{h:.2}" fill="{fill}"><title>{} {term}: {:.2} MB</title></rect>"#,
                escape(name),
                v as f64 / 1e6
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            x + bar / 2.0,
            top + height + 14.0,
            escape(name)
        );
    }
    if capacity > 0 {
        let y = top + height - capacity as f64 / most * height;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{y:.2}" y2="{y:.2}" stroke="#c0392b" stroke-dasharray="4 3"/><text x="4" y="{:.2}" fill="#c0392b">capacity</text>"##,
            width - 180.0,
            y + 4.0
        );
    }
    for (i, (term, fill)) in TERMS.iter().enumerate() {
        let y = top + 14.0 * i as f64;
        let x = width - 170.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{y}" width="10" height="10" fill="{fill}"/><text x="{}" y="{}">{term}</text>"#,
            x + 14.0,
            y + 9.0
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A self-contained HTML page: the pictures (inline SVG) beside the tables (preformatted text).
pub fn html_report(title: &str, sections: &[(&str, String)]) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{0}</title>\
         <style>body{{font-family:sans-serif;margin:20px}} pre{{background:#f6f6f6;padding:8px;\
         overflow-x:auto}} .pair{{display:flex;flex-wrap:wrap;gap:24px}}</style></head><body>\n<h1>{0}</h1>\n",
        escape(title)
    );
    for (heading, body) in sections {
        let _ = writeln!(s, "<h2>{}</h2>", escape(heading));
        if body.trim_start().starts_with("<svg") || body.trim_start().starts_with("<div") {
            s.push_str(body);
        } else {
            let _ = writeln!(s, "<pre>{}</pre>", escape(body));
        }
    }
    s.push_str("</body></html>\n");
    s
}

/// The planner's pictures of a layout: its simulated timeline (stages × time) and its memory per
/// stage by term against the device capacity.
pub fn predicted_pictures(
    input: &ferrotron_core::plan::PlanInput,
    plan: &ferrotron_core::plan::Plan,
) -> anyhow::Result<(Option<String>, String)> {
    let l = plan.layout;
    let names: Vec<String> = (0..l.pp).map(|s| format!("stage {s}")).collect();
    let timeline = ferrotron_core::plan::simulated_timeline(input, &l)?.map(|tl| {
        let mut tracks: Vec<Vec<Box_>> = (0..l.pp).map(|_| Vec::new()).collect();
        for e in &tl.events {
            tracks[e.stage].push(Box_ {
                action: e.action,
                start: e.start,
                end: e.end,
            });
        }
        timeline_svg("predicted timeline (planner)", &names, &tracks)
    });
    let memory = memory_svg(
        "predicted memory per stage, by term",
        &names,
        &plan.memory_bytes_per_stage,
        input.cluster.device_memory_bytes,
    );
    Ok((timeline, memory))
}

//! Timelines: tracks × time, one box per action coloured by kind, with the micro-batch inside when
//! it fits. Several panels (measured, predicted) share one time axis, so their lengths compare.

use super::svg::{self, escape, legend, legend_width, Axis, Unit, FONT};
use ferrotron_core::schedule::Action;
use std::fmt::Write;

/// One interval on one track: an action, or what the step does after the last one.
#[derive(Debug, Clone)]
pub struct Span {
    pub kind: SpanKind,
    pub start: f64,
    pub end: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpanKind {
    Action(Action),
    /// The gradient reductions and the global norm after the last action.
    Reduce,
    /// The optimizer step.
    Update,
}

impl SpanKind {
    fn colour(&self) -> &'static str {
        match self {
            SpanKind::Action(Action::Forward { .. }) => "#4c9be8",
            SpanKind::Action(Action::Backward { .. }) => "#e8794c",
            SpanKind::Action(Action::BackwardInput { .. }) => "#e8a34c",
            SpanKind::Action(Action::BackwardWeight { .. }) => "#9b6fd1",
            SpanKind::Reduce => "#7f8c8d",
            SpanKind::Update | SpanKind::Action(Action::Update { .. }) => "#27ae60",
        }
    }
    fn kind_name(&self) -> &'static str {
        match self {
            SpanKind::Action(Action::Forward { .. }) => "forward",
            SpanKind::Action(Action::Backward { .. }) => "backward",
            SpanKind::Action(Action::BackwardInput { .. }) => "backward (input)",
            SpanKind::Action(Action::BackwardWeight { .. }) => "backward (weights)",
            SpanKind::Reduce => "reductions + norm",
            SpanKind::Update | SpanKind::Action(Action::Update { .. }) => "optimizer step",
        }
    }
    fn describe(&self) -> String {
        match self {
            SpanKind::Action(a) => a.to_string(),
            SpanKind::Reduce => "gradient reductions + global norm".into(),
            SpanKind::Update => "optimizer step".into(),
        }
    }
}

/// A titled set of tracks.
pub struct Panel {
    pub title: String,
    pub names: Vec<String>,
    pub tracks: Vec<Vec<Span>>,
}

impl Panel {
    /// From the first start to the last end.
    pub fn length(&self) -> f64 {
        let (t0, t1) = self.bounds();
        (t1 - t0).max(0.0)
    }
    fn bounds(&self) -> (f64, f64) {
        let all = self.tracks.iter().flatten();
        let t0 = all.clone().map(|b| b.start).fold(f64::INFINITY, f64::min);
        let t1 = all.map(|b| b.end).fold(f64::NEG_INFINITY, f64::max);
        if t0.is_finite() {
            (t0, t1)
        } else {
            (0.0, 0.0)
        }
    }
}

const ROW: f64 = 22.0;
const PLOT_W: f64 = 860.0;

/// The panels one under another on one time axis (each from its own start), with a legend of
/// the kinds drawn. Actions are `<rect class="action">`.
pub fn timeline_svg(title: &str, note: Option<&str>, panels: &[Panel]) -> String {
    let span = panels
        .iter()
        .map(Panel::length)
        .fold(0.0, f64::max)
        .max(1e-9);
    let axis = Axis::new(0.0, span, 8, Unit::seconds(span));
    let left = panels
        .iter()
        .flat_map(|p| p.names.iter())
        .map(|n| svg::text_width(n, FONT))
        .fold(60.0, f64::max)
        + 12.0;
    let mut entries: Vec<(&str, String)> = Vec::new();
    for b in panels.iter().flat_map(|p| p.tracks.iter().flatten()) {
        let entry = (b.kind.colour(), b.kind.kind_name().to_string());
        if !entries.contains(&entry) {
            entries.push(entry);
        }
    }
    let header = if note.is_some() { 46.0 } else { 30.0 };
    let panel_h = |p: &Panel| 22.0 + ROW * p.tracks.len() as f64 + 22.0;
    let height = header + panels.iter().map(panel_h).sum::<f64>() + 8.0;
    let legend_h = 16.0 * entries.len() as f64 + header;
    let width = (left + PLOT_W + 16.0 + legend_width(&entries)).max(svg::title_width(title, note));
    let mut s = svg::open(width, height.max(legend_h));
    svg::title(&mut s, title, note);
    let mut y = header;
    for p in panels {
        let (t0, _) = p.bounds();
        let _ = writeln!(
            s,
            r#"<text class="title" x="{left:.1}" y="{:.1}" font-weight="bold">{} ({})</text>"#,
            y + 14.0,
            escape(&p.title),
            axis.unit.show(p.length(), 2)
        );
        let rows_top = y + 22.0;
        let base = rows_top + ROW * p.tracks.len() as f64;
        axis.draw_x(&mut s, left, left + PLOT_W, base, rows_top);
        for (i, (name, track)) in p.names.iter().zip(&p.tracks).enumerate() {
            let ry = rows_top + ROW * i as f64;
            let _ = writeln!(
                s,
                r##"<text class="label" x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect x="{left:.1}" y="{ry:.1}" width="{PLOT_W}" height="{:.1}" fill="#f4f4f4"/>"##,
                left - 6.0,
                ry + ROW * 0.65,
                escape(name),
                ROW - 4.0
            );
            for b in track {
                span_box(&mut s, b, &axis, (left, ry), t0);
            }
        }
        y += panel_h(p);
    }
    legend(&mut s, left + PLOT_W + 16.0, header, &entries);
    s.push_str("</svg>\n");
    s
}

/// One box of a track at row top `ry`: the span's rectangle (with its description), and an action's
/// micro-batch number where the box is wide enough.
fn span_box(s: &mut String, b: &Span, axis: &Axis, (left, ry): (f64, f64), t0: f64) {
    let x = left + axis.fraction(b.start - t0) * PLOT_W;
    let w = (axis.fraction(b.end - b.start) * PLOT_W).max(0.5);
    let class = if matches!(b.kind, SpanKind::Action(_)) {
        "action"
    } else {
        "step-tail"
    };
    // A thin edge between neighbours, where the box is wide enough to keep its colour.
    let edge = if w > 3.0 { 0.5 } else { 0.0 };
    let _ = writeln!(
        s,
        r#"<rect class="{class}" x="{x:.2}" y="{ry:.1}" width="{w:.2}" height="{:.1}" fill="{}" stroke="white" stroke-width="{edge}"><title>{} {}–{}</title></rect>"#,
        ROW - 4.0,
        b.kind.colour(),
        escape(&b.kind.describe()),
        axis.unit.show(b.start - t0, 3),
        axis.unit.show(b.end - t0, 3),
    );
    if let SpanKind::Action(a) = b.kind {
        let text = a.mb().to_string();
        if w >= svg::text_width(&text, FONT) + 4.0 {
            let _ = writeln!(
                s,
                r#"<text class="mb" x="{:.2}" y="{:.1}" fill="white" text-anchor="middle">{text}</text>"#,
                x + w / 2.0,
                ry + ROW * 0.6
            );
        }
    }
}

//! Timelines: tracks × time, one box per action coloured by kind, with the micro-batch inside when
//! it fits. Several panels (measured, predicted) share one time axis, so their lengths compare.

use super::colours;
use super::svg::{self, escape, legend_rows, legend_rows_height, Axis, Unit, FONT};
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
    /// After its last action, a device waiting for the last device to finish its own (the
    /// reductions and the global norm need every device).
    Waiting,
    /// The gradient reductions and the global norm after the last action.
    Reduce,
    /// The optimizer step.
    Update,
}

impl SpanKind {
    fn colour(&self) -> &'static str {
        match self {
            SpanKind::Action(Action::Forward { .. }) => colours::FORWARD,
            SpanKind::Action(Action::Backward { .. }) => colours::BACKWARD,
            SpanKind::Action(Action::BackwardInput { .. }) => colours::BACKWARD_INPUT,
            SpanKind::Action(Action::BackwardWeight { .. }) => colours::BACKWARD_WEIGHTS,
            SpanKind::Waiting => colours::WAITING,
            SpanKind::Reduce => colours::REDUCTION,
            SpanKind::Update | SpanKind::Action(Action::Update { .. }) => colours::OPTIMIZER,
        }
    }
    /// The kind's name in `data-kind`.
    pub fn data_kind(&self) -> &'static str {
        match self {
            SpanKind::Action(Action::Forward { .. }) => "forward",
            SpanKind::Action(Action::Backward { .. }) => "backward",
            SpanKind::Action(Action::BackwardInput { .. }) => "backward-input",
            SpanKind::Action(Action::BackwardWeight { .. }) => "backward-weights",
            SpanKind::Waiting => "waiting",
            SpanKind::Reduce => "reduction",
            SpanKind::Update | SpanKind::Action(Action::Update { .. }) => "optimizer",
        }
    }
    /// The kind's name in the legend.
    fn kind_name(&self) -> &'static str {
        match self {
            SpanKind::Action(Action::Forward { .. }) => "forward",
            SpanKind::Action(Action::Backward { .. }) => "backward",
            SpanKind::Action(Action::BackwardInput { .. }) => "backward (input)",
            SpanKind::Action(Action::BackwardWeight { .. }) => "backward (weights)",
            SpanKind::Waiting => "waiting for the last device",
            SpanKind::Reduce => "gradient reduction + norm",
            SpanKind::Update | SpanKind::Action(Action::Update { .. }) => "optimizer step",
        }
    }
    fn describe(&self) -> String {
        match self {
            SpanKind::Action(a) => a.to_string(),
            SpanKind::Waiting => "waiting for the last device's actions".into(),
            SpanKind::Reduce => "gradient reductions + global norm".into(),
            SpanKind::Update => "optimizer step".into(),
        }
    }
}

/// A titled set of tracks: `row` is `measured` or `predicted`; `devices` names each track in
/// `data-device` (a device's number, or `stage N` for a predicted stage).
pub struct Panel {
    pub title: String,
    pub row: &'static str,
    pub names: Vec<String>,
    pub devices: Vec<String>,
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
/// A box narrower than this (px) joins its neighbours in a block; a block grows to at least
/// [`MIN_BLOCK_PX`] unless an idle gap wider than [`GAP_PX`] ends it.
const MIN_BOX_PX: f64 = 3.0;
const MIN_BLOCK_PX: f64 = 6.0;
const GAP_PX: f64 = 2.0;

/// The panels one under another on one time axis (each from its own start), with a legend of
/// the kinds drawn. Every box is a `<rect class="action" data-row data-kind data-device>`; where
/// boxes would be thinner than a few pixels, runs of them draw as one block (its kind the one
/// that takes most of its time, the detail in its tooltip).
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
    let mut entries: Vec<svg::Swatch> = Vec::new();
    for b in panels.iter().flat_map(|p| p.tracks.iter().flatten()) {
        let entry = (b.kind.colour().to_string(), b.kind.kind_name().to_string());
        if !entries.contains(&entry) {
            entries.push(entry);
        }
    }
    let header = if note.is_some() { 46.0 } else { 30.0 };
    let panel_h = |p: &Panel| 22.0 + ROW * p.tracks.len() as f64 + 22.0;
    // The legend goes under the panels, so the plot keeps the page's width.
    let legend_h = legend_rows_height(PLOT_W, &entries);
    let height = header + panels.iter().map(panel_h).sum::<f64>() + legend_h + 8.0;
    let width = (left + PLOT_W + 12.0).max(svg::title_width(title, note));
    let mut s = svg::open(width, height);
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
            let at = |t: f64| left + axis.fraction(t - t0) * PLOT_W;
            let device = p.devices.get(i).map_or("", String::as_str);
            for block in blocks(track, &at) {
                block_box(&mut s, &block, (p.row, device), &axis, (&at, ry), t0);
            }
        }
        y += panel_h(p);
    }
    legend_rows(&mut s, left, y + 2.0, PLOT_W, &entries);
    s.push_str("</svg>\n");
    s
}

/// Consecutive spans of a track drawn as one box: a single span, or a run of thin ones.
struct Block<'a> {
    spans: Vec<&'a Span>,
}

impl Block<'_> {
    fn start(&self) -> f64 {
        self.spans[0].start
    }
    fn end(&self) -> f64 {
        self.spans.iter().map(|s| s.end).fold(f64::MIN, f64::max)
    }
    /// The kind that takes most of the block's time.
    fn kind(&self) -> SpanKind {
        let mut time: Vec<(SpanKind, f64)> = Vec::new();
        for s in &self.spans {
            match time.iter_mut().find(|t| t.0 == s.kind) {
                Some(t) => t.1 += s.end - s.start,
                None => time.push((s.kind, s.end - s.start)),
            }
        }
        time.iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(self.spans[0].kind, |t| t.0)
    }
}

/// The track's spans in time order, thin ones gathered into blocks (`at` places a time in px).
fn blocks<'a>(track: &'a [Span], at: &dyn Fn(f64) -> f64) -> Vec<Block<'a>> {
    let mut spans: Vec<&Span> = track.iter().collect();
    spans.sort_by(|a, b| a.start.total_cmp(&b.start));
    let px = |a: f64, b: f64| at(b) - at(a);
    let mut out: Vec<Block> = Vec::new();
    let mut open: Option<Block> = None;
    for s in spans {
        let thin = px(s.start, s.end) < MIN_BOX_PX && matches!(s.kind, SpanKind::Action(_));
        if let Some(b) = open.take() {
            let joins =
                thin && px(b.end(), s.start) <= GAP_PX && px(b.start(), b.end()) < MIN_BLOCK_PX;
            if joins {
                let mut b = b;
                b.spans.push(s);
                open = Some(b);
                continue;
            }
            out.push(b);
        }
        if thin {
            open = Some(Block { spans: vec![s] });
        } else {
            out.push(Block { spans: vec![s] });
        }
    }
    out.extend(open);
    out
}

/// One box at row top `ry`: the block's rectangle with its description (a block of several lists
/// its kinds and micro-batches), and a single action's micro-batch where the box is wide enough.
fn block_box(
    s: &mut String,
    b: &Block,
    (row, device): (&str, &str),
    axis: &Axis,
    (at, ry): (&dyn Fn(f64) -> f64, f64),
    t0: f64,
) {
    let kind = b.kind();
    let x = at(b.start());
    let w = (at(b.end()) - x).max(1.0);
    let what = match b.spans.as_slice() {
        [one] => one.kind.describe(),
        many => {
            let mbs: Vec<usize> = many
                .iter()
                .filter_map(|s| match s.kind {
                    SpanKind::Action(a) => Some(a.mb()),
                    _ => None,
                })
                .collect();
            let (lo, hi) = (
                mbs.iter().copied().min().unwrap_or(0),
                mbs.iter().copied().max().unwrap_or(0),
            );
            format!("{} actions, micro-batches {lo}–{hi}", many.len())
        }
    };
    // A thin edge between neighbours, where the box is wide enough to keep its colour.
    let edge = if w > 3.0 { 0.5 } else { 0.0 };
    let _ = writeln!(
        s,
        r#"<rect class="action" data-row="{row}" data-kind="{}" data-device="{}" data-actions="{}" x="{x:.2}" y="{ry:.1}" width="{w:.2}" height="{:.1}" fill="{}" stroke="white" stroke-width="{edge}"><title>{} {}–{}</title></rect>"#,
        kind.data_kind(),
        escape(device),
        b.spans.len(),
        ROW - 4.0,
        kind.colour(),
        escape(&what),
        axis.unit.show(b.start() - t0, 3),
        axis.unit.show(b.end() - t0, 3),
    );
    if let (SpanKind::Action(a), [_]) = (kind, b.spans.as_slice()) {
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

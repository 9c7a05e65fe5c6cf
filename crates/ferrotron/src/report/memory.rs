//! Memory pictures: each device's bytes stacked by term (the planner's six terms), on a scale
//! chosen from the bars, with the capacity drawn when it is in range and stated when it is not.

use super::colours;
use super::svg::{self, escape, legend, legend_width, Axis, LabelFit, Unit};
use ferrotron_core::plan::MemoryTerms;
use std::fmt::Write;

/// The terms in stacking order: the name checks rely on (`data-term`), the name a reader sees (the
/// tables' column), and the colour; `other` is what a measured total holds beyond the planner's
/// six terms (kernel workspaces, the host's bookkeeping).
pub const TERMS: [(&str, &str, &str); 7] = [
    ("weights", "weights", colours::WEIGHTS),
    ("gradients", "gradients", colours::GRADIENTS),
    ("master_weights", "master", colours::MASTER),
    ("optimizer_states", "optimizer", colours::OPTIMIZER_STATE),
    ("activations", "activations", colours::ACTIVATIONS),
    ("comm_buffers", "comm", colours::COMM),
    ("other", "other", colours::OTHER),
];

/// The bytes of each of [`TERMS`] in `m`.
fn stacked(m: &MemoryTerms) -> [u64; 7] {
    let t = m.terms();
    let six: u64 = t.iter().map(|x| x.1).sum();
    [
        t[0].1,
        t[1].1,
        t[2].1,
        t[3].1,
        t[4].1,
        t[5].1,
        m.total.saturating_sub(six),
    ]
}

/// What a measured memory chart's bars show, beside its table of each term's own peak.
pub const AT_PEAK_NOTE: &str = "the bars show what each device held, by term, at the moment of its peak; the table gives each term's own peak";

/// A limit drawn across the bars (capacity, usable memory).
pub struct Limit {
    pub name: &'static str,
    pub bytes: u64,
    pub colour: &'static str,
}

/// A limit at most this many times the tallest bar is drawn across the bars (the scale reaches it);
/// one further up gets a headroom gauge above the chart instead.
const LIMIT_IN_RANGE: f64 = 4.0;
/// No bar is drawn shorter (a bar this short is stated as drawn at the minimum).
pub const MIN_BAR_PX: f64 = 4.0;
/// The headroom gauge's height, px.
const GAUGE_H: f64 = 10.0;

/// One stacked bar per entry of `bars` (`<rect class="term" data-device data-term>` per term), a
/// value axis in the data's unit, and the limits: a line across the bars
/// (`<line class="limit" data-limit>`) when the scale reaches them, else a gauge of the limit with
/// the tallest bar's share of it (`<rect class="headroom" data-limit>`), so headroom reads at any
/// fill.
pub fn bars_svg(title: &str, bars: &[(String, MemoryTerms)], limits: &[Limit]) -> String {
    let largest = bars.iter().map(|(_, m)| m.total).max().unwrap_or(0).max(1) as f64;
    let (in_range, far): (Vec<&Limit>, Vec<&Limit>) = limits
        .iter()
        .filter(|l| l.bytes > 0)
        .partition(|l| (l.bytes as f64) <= largest * LIMIT_IN_RANGE);
    let gauges: Vec<String> = far
        .iter()
        .map(|l| {
            let used = largest / l.bytes as f64;
            format!(
                "{} {}: the tallest bar uses {:.1}% of it, {:.1}% headroom",
                l.name,
                crate::report::show_bytes(l.bytes),
                100.0 * used,
                100.0 * (1.0 - used)
            )
        })
        .collect();
    let top_value = in_range
        .iter()
        .map(|l| l.bytes as f64)
        .fold(largest, f64::max);
    let axis = Axis::new(0.0, top_value, 5, Unit::bytes(top_value));
    let names: Vec<String> = bars.iter().map(|(n, _)| n.clone()).collect();
    let slot = (640.0 / bars.len().max(1) as f64).clamp(10.0, 64.0);
    let fit = LabelFit::choose(&names, slot);
    let mut entries: Vec<svg::Swatch> = TERMS
        .iter()
        .map(|(_, shown, c)| (c.to_string(), shown.to_string()))
        .collect();
    for l in &in_range {
        entries.push((
            l.colour.to_string(),
            format!("{} {}", l.name, crate::report::show_bytes(l.bytes)),
        ));
    }
    if !far.is_empty() {
        entries.push((colours::USED.to_string(), "used (tallest bar)".into()));
    }
    let left = axis.label_width() + 10.0;
    // Each gauge takes a line of text and the gauge under it.
    let gauge_h = FONT_LINE + GAUGE_H + 6.0;
    let top = 30.0 + gauge_h * far.len() as f64;
    let plot_h = 240.0;
    let plot_w = slot * bars.len().max(1) as f64;
    let gauge_w = plot_w.max(200.0);
    let width = (left + plot_w + 16.0 + legend_width(&entries))
        .max(left + gauge_w + 8.0)
        .max(gauges.iter().fold(svg::title_width(title, None), |w, g| {
            w.max(svg::text_width(g, svg::FONT) + 8.0)
        }));
    let height = (top + plot_h + fit.height(&names) + 8.0).max(top + 16.0 * entries.len() as f64);
    let mut s = svg::open(width, height);
    svg::title(&mut s, title, None);
    for (i, (l, text)) in far.iter().zip(&gauges).enumerate() {
        let y = 30.0 + gauge_h * i as f64;
        let used = (largest / l.bytes as f64 * gauge_w).max(1.0);
        let _ = writeln!(
            s,
            r##"<text class="label" x="{left:.1}" y="{:.1}" fill="#555">{}</text><rect x="{left:.1}" y="{:.1}" width="{gauge_w:.1}" height="{GAUGE_H}" fill="white" stroke="{}" stroke-width="1.5"/><rect class="headroom" data-limit="{}" x="{left:.1}" y="{:.1}" width="{used:.2}" height="{GAUGE_H}" fill="{}"><title>{}</title></rect>"##,
            y + FONT_LINE - 3.0,
            escape(text),
            y + FONT_LINE,
            l.colour,
            l.name,
            y + FONT_LINE,
            colours::USED,
            escape(text)
        );
    }
    let base = top + plot_h;
    axis.draw_y(&mut s, left, base, top, left + plot_w);
    let px = |v: f64| axis.fraction(v) * plot_h;
    for (i, (name, m)) in bars.iter().enumerate() {
        let x = left + slot * i as f64 + slot * 0.15;
        stacked_bar(&mut s, name, m, (x, slot * 0.7, base), &px);
    }
    for l in &in_range {
        let y = base - px(l.bytes as f64);
        let _ = writeln!(
            s,
            r#"<line class="limit" data-limit="{}" x1="{left:.1}" x2="{:.1}" y1="{y:.2}" y2="{y:.2}" stroke="{}" stroke-dasharray="5 3" stroke-width="1.5"/>"#,
            l.name,
            left + plot_w,
            l.colour
        );
    }
    fit.draw(&mut s, &names, |i| left + slot * (i as f64 + 0.5), base);
    legend(&mut s, left + plot_w + 16.0, top, &entries);
    s.push_str("</svg>\n");
    s
}

/// A line of label text, px.
const FONT_LINE: f64 = svg::FONT + 4.0;

/// One device's bar, its terms stacked from `base` up, `x` and `w` wide; `px` turns bytes into
/// pixels. A bar too short to see is drawn at the minimum, its terms in proportion.
fn stacked_bar(
    s: &mut String,
    name: &str,
    m: &MemoryTerms,
    (x, w, base): (f64, f64, f64),
    px: &dyn Fn(f64) -> f64,
) {
    let full = px(stacked(m).iter().sum::<u64>() as f64);
    let stretch = if m.total > 0 && full < MIN_BAR_PX {
        MIN_BAR_PX / full.max(f64::MIN_POSITIVE)
    } else {
        1.0
    };
    let mut y = base;
    for ((term, shown, fill), v) in TERMS.iter().zip(stacked(m)) {
        let h = px(v as f64) * stretch;
        y -= h;
        let _ = writeln!(
            s,
            r#"<rect class="term" data-device="{}" data-term="{term}" x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{fill}"><title>{} {shown}: {}</title></rect>"#,
            escape(name),
            escape(name),
            crate::report::show_bytes(v)
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{x:.2}" y="{:.2}" width="{w:.2}" height="{:.2}" fill="none" stroke="#fff" stroke-width="0"><title>{} total: {}</title></rect>"##,
        base - full * stretch,
        full * stretch,
        escape(name),
        crate::report::show_bytes(m.total)
    );
}

/// One device's memory over a step, as the tracking allocator saw it.
pub struct MemoryTrace {
    pub name: String,
    /// (seconds since the step began, live bytes, peak so far).
    pub samples: Vec<(f64, u64, u64)>,
}

/// Small multiples on one scale: per device, its live bytes over the step, and its peak marked
/// where it happened (the interval in which the allocator's peak last rose).
pub fn over_step_svg(traces: &[MemoryTrace]) -> Vec<String> {
    let top_value = traces
        .iter()
        .flat_map(|t| t.samples.iter().map(|s| s.2.max(s.1)))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let span = traces
        .iter()
        .flat_map(|t| t.samples.iter().map(|s| s.0))
        .fold(0.0, f64::max)
        .max(1e-9);
    let y_axis = Axis::new(0.0, top_value, 3, Unit::bytes(top_value));
    let x_axis = Axis::new(0.0, span, 3, Unit::seconds(span));
    let (left, top, plot_w, plot_h) = (y_axis.label_width() + 10.0, 40.0, 230.0, 110.0);
    traces
        .iter()
        .map(|t| {
            let width = (left + plot_w + 14.0).max(svg::title_width(&t.name, None));
            let mut s = svg::open(width, top + plot_h + 24.0);
            let peak = t.samples.iter().map(|s| s.2).max().unwrap_or(0);
            svg::title(&mut s, &t.name, None);
            let base = top + plot_h;
            y_axis.draw_y(&mut s, left, base, top, left + plot_w);
            x_axis.draw_x(&mut s, left, left + plot_w, base, top);
            let at = |(time, bytes): (f64, f64)| {
                (
                    left + x_axis.fraction(time) * plot_w,
                    base - y_axis.fraction(bytes) * plot_h,
                )
            };
            let points: Vec<String> = t
                .samples
                .iter()
                .map(|&(time, live, _)| {
                    let (x, y) = at((time, live as f64));
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            let _ = writeln!(
                s,
                r##"<polyline class="live" points="{}" fill="none" stroke="{}" stroke-width="1.5"/>"##,
                points.join(" "),
                colours::LIVE
            );
            // The peak fell in the interval ending at the first sample that saw it.
            if let Some(i) = t.samples.iter().position(|s| s.2 == peak) {
                let from = if i == 0 { 0.0 } else { t.samples[i - 1].0 };
                let (x, y) = at(((from + t.samples[i].0) / 2.0, peak as f64));
                let text = format!("peak {}", crate::report::show_bytes(peak));
                let w = svg::text_width(&text, svg::FONT);
                let tx = (x - w / 2.0).clamp(left + 2.0, left + plot_w - w - 2.0);
                let peak_colour = colours::PEAK;
                let _ = writeln!(
                    s,
                    r##"<circle class="peak" cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{peak_colour}"><title>peak {} between {} and {}</title></circle><text class="label" x="{tx:.1}" y="{:.1}" fill="{peak_colour}">{text}</text>"##,
                    crate::report::show_bytes(peak),
                    x_axis.unit.show(from, 3),
                    x_axis.unit.show(t.samples[i].0, 3),
                    (y + 16.0).min(base - 4.0).max(top + 12.0),
                );
            }
            s.push_str("</svg>\n");
            s
        })
        .collect()
}

//! Memory pictures: each device's bytes stacked by term (the planner's six terms), on a scale
//! chosen from the bars, with the capacity drawn when it is in range and stated when it is not.

use super::svg::{self, escape, legend, legend_width, Axis, LabelFit, Unit};
use ferrotron_core::plan::MemoryTerms;
use std::fmt::Write;

/// The terms in stacking order, with their colours; `other` is what a measured total holds beyond
/// the planner's six terms (kernel workspaces, the host's bookkeeping).
pub const TERMS: [(&str, &str); 7] = [
    ("weights", "#4c9be8"),
    ("gradients", "#e8794c"),
    ("master_weights", "#8bc34a"),
    ("optimizer_states", "#9b6fd1"),
    ("activations", "#f2c14e"),
    ("comm_buffers", "#7f8c8d"),
    ("other", "#d5d5d5"),
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

/// Bars at most this many times their largest are drawn to scale: a limit further up is stated.
const LIMIT_IN_RANGE: f64 = 1.6;
/// No bar is drawn shorter (a bar this short is stated as drawn at the minimum).
pub const MIN_BAR_PX: f64 = 4.0;

/// One stacked bar per entry of `bars` (`<rect class="term" data-device data-term>` per term), a
/// value axis in the data's unit, and the limits.
pub fn bars_svg(title: &str, bars: &[(String, MemoryTerms)], limits: &[Limit]) -> String {
    let largest = bars.iter().map(|(_, m)| m.total).max().unwrap_or(0).max(1) as f64;
    let in_range: Vec<&Limit> = limits
        .iter()
        .filter(|l| l.bytes > 0 && (l.bytes as f64) <= largest * LIMIT_IN_RANGE)
        .collect();
    let off: Vec<String> = limits
        .iter()
        .filter(|l| l.bytes > 0 && (l.bytes as f64) > largest * LIMIT_IN_RANGE)
        .map(|l| {
            format!(
                "{} {} is off this scale: the tallest bar is {:.2}% of it",
                l.name,
                crate::report::show_bytes(l.bytes),
                100.0 * largest / l.bytes as f64
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
    let note = (!off.is_empty()).then(|| off.join("; "));
    let mut entries: Vec<(&str, String)> = TERMS.iter().map(|(t, c)| (*c, t.to_string())).collect();
    for l in &in_range {
        entries.push((
            l.colour,
            format!("{} {}", l.name, crate::report::show_bytes(l.bytes)),
        ));
    }
    let (left, top, plot_h) = (
        axis.label_width() + 10.0,
        if note.is_some() { 46.0 } else { 30.0 },
        240.0,
    );
    let plot_w = slot * bars.len().max(1) as f64;
    let width = (left + plot_w + 16.0 + legend_width(&entries))
        .max(svg::title_width(title, note.as_deref()));
    let height = top + plot_h + fit.height(&names) + 8.0;
    let mut s = svg::open(width, height);
    svg::title(&mut s, title, note.as_deref());
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
    for ((term, fill), v) in TERMS.iter().zip(stacked(m)) {
        let h = px(v as f64) * stretch;
        y -= h;
        let _ = writeln!(
            s,
            r#"<rect class="term" data-device="{}" data-term="{term}" x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{fill}"><title>{} {term}: {}</title></rect>"#,
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
                r##"<polyline class="live" points="{}" fill="none" stroke="#4c9be8" stroke-width="1.5"/>"##,
                points.join(" ")
            );
            // The peak fell in the interval ending at the first sample that saw it.
            if let Some(i) = t.samples.iter().position(|s| s.2 == peak) {
                let from = if i == 0 { 0.0 } else { t.samples[i - 1].0 };
                let (x, y) = at(((from + t.samples[i].0) / 2.0, peak as f64));
                let text = format!("peak {}", crate::report::show_bytes(peak));
                let w = svg::text_width(&text, svg::FONT);
                let tx = (x - w / 2.0).clamp(left + 2.0, left + plot_w - w - 2.0);
                let _ = writeln!(
                    s,
                    r##"<circle class="peak" cx="{x:.1}" cy="{y:.1}" r="3.5" fill="#c0392b"><title>peak {} between {} and {}</title></circle><text class="label" x="{tx:.1}" y="{:.1}" fill="#c0392b">{text}</text>"##,
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

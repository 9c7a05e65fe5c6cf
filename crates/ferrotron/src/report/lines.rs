//! Line charts of figures over a run's steps (loss, tokens/s, idle fraction): axes from the data,
//! one colour per series, a legend beside the plot.

use super::svg::{self, escape, legend, legend_width, Axis, Unit};
use std::fmt::Write;

pub struct Series {
    pub name: String,
    pub colour: String,
    pub points: Vec<(f64, f64)>,
    /// Draw a dot on each point (sparse series such as validation loss).
    pub dots: bool,
}

/// A chart of `series` against the step; `unit` for the values; `from_zero` keeps 0 on the axis.
/// Points that are not finite (a skipped fp16 step's loss) are left out.
pub fn line_chart(title: &str, unit: Unit, from_zero: bool, series: &[Series]) -> String {
    let finite: Vec<Series> = series
        .iter()
        .map(|s| Series {
            name: s.name.clone(),
            colour: s.colour.clone(),
            points: s
                .points
                .iter()
                .copied()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .collect(),
            dots: s.dots,
        })
        .collect();
    let series = &finite[..];
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
        (a.min(y), b.max(y))
    });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let y_axis = Axis::new(if from_zero { lo.min(0.0) } else { lo }, hi, 5, unit);
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_lo, x_hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let (x_lo, x_hi) = if x_lo.is_finite() {
        (x_lo, x_hi)
    } else {
        (0.0, 1.0)
    };
    let x_axis = Axis::new(x_lo, x_hi, 6, Unit::plain(""));
    let entries: Vec<svg::Swatch> = series
        .iter()
        .map(|s| (s.colour.clone(), s.name.clone()))
        .collect();
    let (left, top, plot_w, plot_h): (f64, f64, f64, f64) =
        (y_axis.label_width() + 10.0, 30.0, 520.0, 200.0);
    let width = (left + plot_w + 16.0 + legend_width(&entries)).max(svg::title_width(title, None));
    let height = (top + plot_h + 40.0).max(top + 16.0 * entries.len() as f64);
    let mut s = svg::open(width, height);
    svg::title(&mut s, title, None);
    let base = top + plot_h;
    y_axis.draw_y(&mut s, left, base, top, left + plot_w);
    x_axis.draw_x(&mut s, left, left + plot_w, base, top);
    let _ = writeln!(
        s,
        r#"<text class="label" x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        left + plot_w / 2.0,
        base + 30.0
    );
    let at = |(x, y): (f64, f64)| {
        (
            left + x_axis.fraction(x) * plot_w,
            base - y_axis.fraction(y) * plot_h,
        )
    };
    for line in series {
        let points: Vec<(f64, f64)> = line.points.iter().map(|&p| at(p)).collect();
        let text: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline class="series" data-series="{}" points="{}" fill="none" stroke="{}" stroke-width="1.5"/>"#,
            escape(&line.name),
            text.join(" "),
            line.colour
        );
        if line.dots {
            for (&(px, py), &(x, y)) in points.iter().zip(&line.points) {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{px:.1}" cy="{py:.1}" r="3" fill="{}"><title>{} at step {x}: {}</title></circle>"#,
                    line.colour,
                    escape(&line.name),
                    unit.show(y, y_axis.decimals + 2)
                );
            }
        }
    }
    legend(&mut s, left + plot_w + 16.0, top, &entries);
    s.push_str("</svg>\n");
    s
}

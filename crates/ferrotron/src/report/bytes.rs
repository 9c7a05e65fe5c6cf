//! Bytes each device sent on one group (tp, dp or pp) in a step, against what the group's link
//! could have carried in the same time.

use super::colours;
use super::svg::{self, escape, Axis, Unit, FONT};
use std::fmt::Write;

/// The link a group's bytes travel on, and the time they had.
pub struct LinkBudget {
    pub group: &'static str,
    pub bandwidth_bytes_per_s: f64,
    pub seconds: f64,
}

/// Drawn to scale only while the link's budget is at most this many times the largest bar.
const BUDGET_IN_RANGE: f64 = 1.6;

/// One horizontal bar per device (`<rect class="sent" data-device data-group>`), and the link's
/// budget as a line when it is in range, or stated above the chart when it is not.
pub fn bytes_svg(rows: &[(String, u64)], link: &LinkBudget) -> String {
    let budget = link.bandwidth_bytes_per_s * link.seconds;
    let largest = rows.iter().map(|r| r.1).max().unwrap_or(0).max(1) as f64;
    let in_range = budget <= largest * BUDGET_IN_RANGE;
    let top_value = if in_range {
        budget.max(largest)
    } else {
        largest
    };
    let axis = Axis::new(0.0, top_value, 4, Unit::bytes(top_value));
    let title = format!("{} bytes sent per device", link.group);
    let note = format!(
        "the link ({}/s) carries {} in the {} step: the busiest device used {:.2}% of it",
        crate::report::show_bytes(link.bandwidth_bytes_per_s as u64),
        crate::report::show_bytes(budget as u64),
        Unit::seconds(link.seconds).show(link.seconds, 1),
        100.0 * largest / budget.max(1.0),
    );
    let left = rows
        .iter()
        .map(|r| svg::text_width(&r.0, FONT))
        .fold(40.0, f64::max)
        + 10.0;
    let (top, row, plot_w) = (46.0, 18.0, 320.0);
    let height = top + row * rows.len() as f64 + 24.0;
    let width = (left + plot_w + 30.0).max(svg::title_width(&title, Some(&note)));
    let mut s = svg::open(width, height);
    svg::title(&mut s, &title, Some(&note));
    let base = top + row * rows.len() as f64;
    axis.draw_x(&mut s, left, left + plot_w, base, top);
    for (i, (name, bytes)) in rows.iter().enumerate() {
        let y = top + row * i as f64;
        let w = axis.fraction(*bytes as f64) * plot_w;
        let _ = writeln!(
            s,
            r##"<text class="label" x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect class="sent" data-device="{}" data-group="{}" x="{left:.1}" y="{:.1}" width="{w:.2}" height="{:.1}" fill="{}"><title>{}: {} ({:.3}% of the link's budget)</title></rect>"##,
            left - 6.0,
            y + row * 0.7,
            escape(name),
            escape(name),
            link.group,
            y + 2.0,
            row - 4.0,
            colours::SENT,
            escape(name),
            crate::report::show_bytes(*bytes),
            100.0 * *bytes as f64 / budget.max(1.0)
        );
    }
    if in_range {
        let x = left + axis.fraction(budget) * plot_w;
        let _ = writeln!(
            s,
            r##"<line class="limit" data-limit="link budget" x1="{x:.1}" x2="{x:.1}" y1="{top:.1}" y2="{base:.1}" stroke="{}" stroke-dasharray="5 3" stroke-width="1.5"/>"##,
            colours::LINK_BUDGET
        );
    }
    s.push_str("</svg>\n");
    s
}

//! The drawing vocabulary every chart shares: escaping, how wide a label is, axes whose range and
//! unit come from the data, and category labels that never collide (kept level, turned upright, or
//! thinned, whichever fits).

use std::fmt::Write;

/// Font size of labels and tick values, px.
pub const FONT: f64 = 11.0;
/// Font size of chart titles, px.
pub const TITLE_FONT: f64 = 13.0;

pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An upper bound on the width of `text` at `size` px in the sans-serif fonts browsers fall back to
/// (DejaVu Sans, the widest common one, averages under 0.62 em per character of these labels).
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.62
}

/// Opens an SVG of the given size; every chart uses the same font.
pub fn open(width: f64, height: f64) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         viewBox=\"0 0 {width:.0} {height:.0}\" font-family=\"sans-serif\" font-size=\"{FONT}\">\n"
    )
}

/// A chart title (and an optional second line) at the top left.
pub fn title(s: &mut String, text: &str, note: Option<&str>) {
    let _ = writeln!(
        s,
        r#"<text class="title" x="4" y="16" font-size="{TITLE_FONT}" font-weight="bold">{}</text>"#,
        escape(text)
    );
    if let Some(n) = note {
        let _ = writeln!(
            s,
            r##"<text class="title" x="4" y="32" fill="#555">{}</text>"##,
            escape(n)
        );
    }
}

/// The width a title (and its note) needs.
pub fn title_width(text: &str, note: Option<&str>) -> f64 {
    let w = text_width(text, TITLE_FONT) + 8.0;
    note.map_or(w, |n| w.max(text_width(n, FONT) + 8.0))
}

/// A unit for one chart's values, chosen from the largest of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unit {
    pub name: &'static str,
    pub divisor: f64,
}

impl Unit {
    /// Decimal bytes: B, KB, MB, GB, TB.
    pub fn bytes(largest: f64) -> Unit {
        let (name, divisor) = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)]
            .into_iter()
            .find(|&(_, d)| largest >= d)
            .unwrap_or(("B", 1.0));
        Unit { name, divisor }
    }

    /// Seconds: s, ms or µs.
    pub fn seconds(largest: f64) -> Unit {
        let (name, divisor) = [("s", 1.0), ("ms", 1e-3)]
            .into_iter()
            .find(|&(_, d)| largest >= d)
            .unwrap_or(("µs", 1e-6));
        Unit { name, divisor }
    }

    /// Plain numbers (a loss, a fraction already in %), shown as they are.
    pub fn plain(name: &'static str) -> Unit {
        Unit { name, divisor: 1.0 }
    }

    /// `v` in this unit with `decimals` places and the unit's name.
    pub fn show(&self, v: f64, decimals: usize) -> String {
        let x = v / self.divisor;
        if self.name.is_empty() {
            format!("{x:.decimals$}")
        } else if self.name == "%" {
            format!("{x:.decimals$}%")
        } else {
            format!("{x:.decimals$} {}", self.name)
        }
    }
}

/// A linear axis from `lo` to `hi` (both on round numbers) with its tick values.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
    /// Decimal places that tell the ticks apart in `unit`.
    pub decimals: usize,
    pub unit: Unit,
}

impl Axis {
    /// An axis covering `[lo, hi]` with about `n` ticks on round values of `unit`.
    pub fn new(lo: f64, hi: f64, n: usize, unit: Unit) -> Axis {
        let lo_u = if lo.is_finite() {
            lo / unit.divisor
        } else {
            0.0
        };
        let mut hi_u = hi / unit.divisor;
        // An empty, inverted or undefined range still gets a unit-wide axis.
        if !hi_u.is_finite() || hi_u.partial_cmp(&lo_u) != Some(std::cmp::Ordering::Greater) {
            hi_u = lo_u + 1.0;
        }
        let raw = (hi_u - lo_u) / n.max(1) as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 2.5, 5.0, 10.0]
            .into_iter()
            .map(|f| f * mag)
            .find(|&s| s >= raw)
            .unwrap_or(10.0 * mag);
        // Whole bytes only: there is no fraction of one.
        let step = if unit.name == "B" {
            step.max(1.0)
        } else {
            step
        };
        let first = (lo_u / step).floor() * step;
        let last = (hi_u / step).ceil() * step;
        let count = ((last - first) / step).round() as usize;
        let ticks = (0..=count)
            .map(|i| (first + step * i as f64) * unit.divisor)
            .collect();
        // The fewest decimal places that show the step exactly (2.5 needs one, 25 none).
        let decimals = (0..6)
            .find(|&d| {
                let scaled = step * 10f64.powi(d);
                (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
            })
            .unwrap_or(6) as usize;
        Axis {
            lo: first * unit.divisor,
            hi: last * unit.divisor,
            ticks,
            decimals,
            unit,
        }
    }

    /// Where `v` falls, from 0 (at `lo`) to 1 (at `hi`).
    pub fn fraction(&self, v: f64) -> f64 {
        (v - self.lo) / (self.hi - self.lo).max(f64::MIN_POSITIVE)
    }

    pub fn label(&self, v: f64) -> String {
        self.unit.show(v, self.decimals)
    }

    /// The widest tick label.
    pub fn label_width(&self) -> f64 {
        self.ticks
            .iter()
            .map(|&t| text_width(&self.label(t), FONT))
            .fold(0.0, f64::max)
    }

    /// Tick values and grid lines along a horizontal axis at `y`, from `x0` (lo) to `x1` (hi); the
    /// grid runs up to `grid_top`. Ticks whose labels would touch their neighbour's are left out.
    pub fn draw_x(&self, s: &mut String, x0: f64, x1: f64, y: f64, grid_top: f64) {
        let mut right_of_last = f64::NEG_INFINITY;
        for (i, &t) in self.ticks.iter().enumerate() {
            let x = x0 + self.fraction(t) * (x1 - x0);
            let text = self.label(t);
            let w = text_width(&text, FONT);
            let (anchor, left) = match i {
                0 => ("start", x),
                _ if i + 1 == self.ticks.len() => ("end", x - w),
                _ => ("middle", x - w / 2.0),
            };
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{grid_top:.1}" y2="{y:.1}" stroke="#ddd"/>"##
            );
            if left > right_of_last + 4.0 {
                let _ = writeln!(
                    s,
                    r#"<text class="label" x="{x:.1}" y="{:.1}" text-anchor="{anchor}">{text}</text>"#,
                    y + 14.0
                );
                right_of_last = left + w;
            }
        }
    }

    /// Tick values and grid lines along a vertical axis at `x` (labels to its left), from `y0`
    /// (lo) up to `y1` (hi); the grid runs across to `grid_right`.
    pub fn draw_y(&self, s: &mut String, x: f64, y0: f64, y1: f64, grid_right: f64) {
        let mut above_last = f64::INFINITY;
        for &t in &self.ticks {
            let y = y0 - self.fraction(t) * (y0 - y1);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" x2="{grid_right:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/>"##
            );
            if y < above_last - FONT - 3.0 {
                let _ = writeln!(
                    s,
                    r#"<text class="label" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                    x - 4.0,
                    y + 4.0,
                    self.label(t)
                );
                above_last = y;
            }
        }
    }
}

/// How category labels under a row of slots are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LabelFit {
    /// Level, every one.
    Level,
    /// Turned upright (reading upwards), every `n`-th one.
    Upright { every: usize },
}

impl LabelFit {
    /// Level if every label fits its slot; otherwise upright, thinned until a line of text fits.
    pub fn choose(names: &[String], slot: f64) -> LabelFit {
        let widest = names
            .iter()
            .map(|n| text_width(n, FONT))
            .fold(0.0, f64::max);
        if widest + 4.0 <= slot {
            LabelFit::Level
        } else {
            LabelFit::Upright {
                every: ((FONT + 4.0) / slot).ceil().max(1.0) as usize,
            }
        }
    }

    /// The height the labels take below the axis.
    pub fn height(&self, names: &[String]) -> f64 {
        match self {
            LabelFit::Level => FONT + 6.0,
            LabelFit::Upright { .. } => {
                names
                    .iter()
                    .map(|n| text_width(n, FONT))
                    .fold(0.0, f64::max)
                    + 8.0
            }
        }
    }

    /// Draws `names[i]` centred under `centre(i)`, hanging from `y`.
    pub fn draw(&self, s: &mut String, names: &[String], centre: impl Fn(usize) -> f64, y: f64) {
        for (i, name) in names.iter().enumerate() {
            let x = centre(i);
            match *self {
                LabelFit::Level => {
                    let _ = writeln!(
                        s,
                        r#"<text class="label" x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                        y + FONT + 2.0,
                        escape(name)
                    );
                }
                LabelFit::Upright { every } if i % every == 0 => {
                    let _ = writeln!(
                        s,
                        r#"<text class="label" x="{:.1}" y="{:.1}" text-anchor="end" transform="rotate(-90 {:.1} {:.1})">{}</text>"#,
                        x + FONT * 0.35,
                        y + 4.0,
                        x + FONT * 0.35,
                        y + 4.0,
                        escape(name)
                    );
                }
                LabelFit::Upright { .. } => {}
            }
        }
    }
}

/// One legend entry: a colour and what it means.
pub type Swatch = (String, String);

/// A legend in a column: a swatch (`<rect class="swatch" data-meaning>`) and a name per entry,
/// 16 px apart, starting at (`x`, `y`).
pub fn legend(s: &mut String, x: f64, y: f64, entries: &[Swatch]) {
    for (i, (colour, name)) in entries.iter().enumerate() {
        let y = y + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect class="swatch" data-meaning="{}" x="{x:.1}" y="{:.1}" width="10" height="10" fill="{colour}"/><text class="label" x="{:.1}" y="{:.1}">{}</text>"#,
            escape(name),
            y,
            x + 14.0,
            y + 9.0,
            escape(name)
        );
    }
}

/// A legend in rows under a chart: entries left to right from (`x`, `y`), a new row where the next
/// would pass `width`; the height it took.
pub fn legend_rows(s: &mut String, x: f64, y: f64, width: f64, entries: &[Swatch]) -> f64 {
    let (mut cx, mut cy) = (x, y);
    for (colour, name) in entries {
        let w = text_width(name, FONT) + 18.0 + 12.0;
        if cx > x && cx + w > x + width {
            cx = x;
            cy += 16.0;
        }
        let _ = writeln!(
            s,
            r#"<rect class="swatch" data-meaning="{}" x="{cx:.1}" y="{cy:.1}" width="10" height="10" fill="{colour}"/><text class="label" x="{:.1}" y="{:.1}">{}</text>"#,
            escape(name),
            cx + 14.0,
            cy + 9.0,
            escape(name)
        );
        cx += w;
    }
    if entries.is_empty() {
        0.0
    } else {
        cy - y + 16.0
    }
}

/// The height [`legend_rows`] takes for `entries` in `width`.
pub fn legend_rows_height(width: f64, entries: &[Swatch]) -> f64 {
    let mut scratch = String::new();
    legend_rows(&mut scratch, 0.0, 0.0, width, entries)
}

/// The width a [`legend`] needs.
pub fn legend_width(entries: &[Swatch]) -> f64 {
    entries
        .iter()
        .map(|(_, n)| text_width(n, FONT) + 18.0)
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_land_on_round_values_of_the_data_unit() {
        let a = Axis::new(0.0, 31.3e6, 5, Unit::bytes(31.3e6));
        assert_eq!(a.unit.name, "MB");
        assert_eq!((a.hi, a.ticks.len()), (40e6, 5));
        assert_eq!(a.label(10e6), "10 MB");
        let t = Axis::new(0.0, 0.0636, 6, Unit::seconds(0.0636));
        assert_eq!(t.unit.name, "ms");
        assert!((t.hi - 0.08).abs() < 1e-12, "{}", t.hi);
        let bytes = Axis::new(0.0, 0.0, 4, Unit::bytes(0.0));
        assert!(bytes.ticks.iter().all(|t| t.fract() == 0.0), "{bytes:?}");
        let small = Axis::new(0.0, 0.9, 4, Unit::plain(""));
        assert_eq!(small.label(0.25), "0.25");
        assert!(Axis::new(5.0, 5.0, 4, Unit::plain("")).hi > 5.0);
    }

    #[test]
    fn labels_turn_upright_and_thin_when_slots_are_narrow() {
        let names: Vec<String> = (0..64).map(|i| format!("dev {i}")).collect();
        assert_eq!(LabelFit::choose(&names, 60.0), LabelFit::Level);
        assert_eq!(
            LabelFit::choose(&names, 20.0),
            LabelFit::Upright { every: 1 }
        );
        assert_eq!(
            LabelFit::choose(&names, 5.0),
            LabelFit::Upright { every: 3 }
        );
    }
}

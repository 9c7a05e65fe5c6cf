//! Every colour the reports use, in one place, so that no colour means two things on one page: a
//! timeline's kinds, the memory terms, the limits, the run's series, the pipeline stages and the
//! devices each have their own. Stages and devices are generated (as many as there are), in
//! lightness bands that no fixed colour falls into.

/// Timeline kinds.
pub const FORWARD: &str = "#2f6fb3";
pub const BACKWARD: &str = "#d2691e";
pub const BACKWARD_INPUT: &str = "#c9a227";
pub const BACKWARD_WEIGHTS: &str = "#8e44ad";
pub const WAITING: &str = "#dfe6e9";
pub const REDUCTION: &str = "#4a5a66";
pub const OPTIMIZER: &str = "#1e8449";

/// Memory terms, in `MemoryTerms` order, then what a measured total holds beyond them.
pub const WEIGHTS: &str = "#1b3a5c";
pub const GRADIENTS: &str = "#e05a7a";
pub const MASTER: &str = "#17b890";
pub const OPTIMIZER_STATE: &str = "#6c3fc5";
pub const ACTIVATIONS: &str = "#f4c542";
pub const COMM: &str = "#29a3c6";
pub const OTHER: &str = "#c8c8c8";

/// Limits drawn across charts.
pub const CAPACITY: &str = "#c62828";
pub const USABLE: &str = "#222222";
pub const LINK_BUDGET: &str = "#795548";
/// The used part of a headroom gauge (a limit far above the bars).
pub const USED: &str = "#9fa8da";

/// Bytes a device sent on a link; a device's live memory over the step, and its peak.
pub const SENT: &str = "#5c6bc0";
pub const LIVE: &str = "#3f51b5";
pub const PEAK: &str = "#b71c1c";

/// A run's own series.
pub const TRAINING_LOSS: &str = "#0d47a1";
pub const VALIDATION_LOSS: &str = "#ad1457";
pub const TOKENS_PER_S: &str = "#00796b";

/// Outlines in the layout picture.
pub const TP_GROUP: &str = "#000000";
pub const NODE: &str = "#9e9e9e";

/// Every fixed colour above (a unit test checks they differ, and that no generated one equals them).
#[cfg(test)]
pub const FIXED: [&str; 26] = [
    FORWARD,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHTS,
    WAITING,
    REDUCTION,
    OPTIMIZER,
    WEIGHTS,
    GRADIENTS,
    MASTER,
    OPTIMIZER_STATE,
    ACTIVATIONS,
    COMM,
    OTHER,
    CAPACITY,
    USABLE,
    LINK_BUDGET,
    USED,
    SENT,
    LIVE,
    PEAK,
    TRAINING_LOSS,
    VALIDATION_LOSS,
    TOKENS_PER_S,
    TP_GROUP,
    NODE,
];

/// Pipeline stage `i` of `n`: light fills (lightness 86%) whose hues spread over the circle.
pub fn stage(i: usize, n: usize) -> String {
    spread(i, n, 0.55, 0.86)
}

/// Device `i` of `n` (a line per device): darker strokes (lightness 34–46%) whose hues spread.
pub fn device(i: usize, n: usize) -> String {
    // Past a dozen hues neighbours blur: the lightness steps too, in three bands.
    let band = (i % 3) as f64 * 0.06;
    spread(i, n, 0.85, 0.34 + band)
}

/// Hue `i` of `n` spread evenly round the circle (offset so that `n = 1` is not red), as hex.
/// Neighbouring hues of many can round to one hex colour: the low four bits of each channel carry
/// the index instead (a shift of at most 6%), so the first 4096 always differ.
fn spread(i: usize, n: usize, saturation: f64, lightness: f64) -> String {
    let hue = (20.0 + 360.0 * i as f64 / n.max(1) as f64) % 360.0;
    let (r, g, b) = hsl(hue, saturation, lightness);
    let tag = |c: u8, shift: usize| (c & 0xf0) | ((i >> shift) & 0xf) as u8;
    format!("#{:02x}{:02x}{:02x}", tag(r, 8), tag(g, 4), tag(b, 0))
}

fn hsl(h: f64, s: f64, l: f64) -> (u8, u8, u8) {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let x = c * (1.0 - ((h / 60.0) % 2.0 - 1.0).abs());
    let m = l - c / 2.0;
    let (r, g, b) = match (h / 60.0) as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let byte = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    (byte(r), byte(g), byte(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn no_colour_means_two_things() {
        let mut seen = BTreeSet::new();
        for c in FIXED {
            assert!(
                seen.insert(c.to_string()),
                "{c} twice among the fixed colours"
            );
        }
        for n in [1, 2, 3, 8, 32, 64, 512, 4096] {
            let mut generated = BTreeSet::new();
            for i in 0..n {
                for c in [stage(i, n), device(i, n)] {
                    assert!(!seen.contains(&c), "{c} is also a fixed colour");
                    assert!(generated.insert(c.clone()), "{c} twice among {n}");
                }
            }
        }
    }
}

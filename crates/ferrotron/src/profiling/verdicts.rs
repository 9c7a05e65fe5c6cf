//! The verdicts of a profile: every measured figure further from its prediction than the threshold,
//! with its likely cause — stragglers, idle, bytes — and what agrees, said too.

use super::Measured;
use ferrotron_engine::memory::format_bytes;

/// What the verdicts compare: the devices' measurements and coordinates, the plan, the thresholds.
pub(crate) struct Evidence<'a> {
    pub devices: &'a [Measured],
    /// (tp rank, dp rank, stage) of every device.
    pub coords: &'a [ferrotron_core::rank::Coords],
    pub plan: &'a ferrotron_core::plan::Plan,
    pub predicted_idle: &'a [f64],
    /// A figure further than this from its prediction gets a verdict.
    pub threshold: f64,
    /// A device computing this fraction above its stage's median is a straggler.
    pub straggler_threshold: f64,
}

/// A line for every measured figure further from its prediction than the threshold, with the likely
/// cause; or one line saying that everything is within it.
pub(crate) fn verdicts(e: &Evidence) -> Vec<String> {
    let busy: Vec<f64> = e.devices.iter().map(|m| m.report.busy_s).collect();
    let (mut out, worst_straggler) = stragglers(e, &busy);
    let (idle_off, idle_ok) = idle(e, &busy, worst_straggler.as_deref());
    let (bytes_off, bytes_ok) = bytes(e);
    out.extend(idle_off);
    out.extend(bytes_off);
    out.extend(memory(e));
    // What agrees is said too, so that a reader of a report with some figures off still sees which
    // were measured to match.
    let agreeing: Vec<String> = idle_ok.into_iter().chain(bytes_ok).collect();
    let th = 100.0 * e.threshold;
    if out.is_empty() {
        out.push(format!(
            "every measured idle fraction and byte count is within {th:.0}% of the prediction: {}",
            agreeing.join(", ")
        ));
    } else if !agreeing.is_empty() {
        out.push(format!(
            "within {th:.0}% of the prediction: {}",
            agreeing.join(", ")
        ));
    }
    out
}

/// The devices that compute well above the others of their stage (which do the same work), and the
/// worst of them (by its ratio to the median): the one the others wait on.
fn stragglers(e: &Evidence, busy: &[f64]) -> (Vec<String>, Option<String>) {
    let mut out = Vec::new();
    let mut worst: Option<(f64, String)> = None;
    for (d, &b) in busy.iter().enumerate() {
        let (t, dp, s) = (e.coords[d].tp, e.coords[d].dp, e.coords[d].pp);
        let mut peers: Vec<f64> = (0..e.devices.len())
            .filter(|&x| e.coords[x].pp == s)
            .map(|x| busy[x])
            .collect();
        if peers.len() < 2 {
            continue;
        }
        peers.sort_by(f64::total_cmp);
        let median = peers[peers.len() / 2];
        if median > 0.0 && b > median * (1.0 + e.straggler_threshold) {
            let ratio = b / median;
            let who = format!("device {d} (stage {s}, dp rank {dp}, tp rank {t})");
            if worst.as_ref().is_none_or(|w| ratio > w.0) {
                worst = Some((ratio, who.clone()));
            }
            out.push(format!(
                "{who} computes {ratio:.2}× its stage's median ({b:.4} s vs {median:.4} s): a \
                 straggler"
            ));
        }
    }
    (out, worst.map(|w| w.1))
}

/// Per stage, idle against the predicted bubble: the verdicts (with the likely cause: the
/// straggler, unbalanced stages, or collectives) and the stages that agree.
fn idle(e: &Evidence, busy: &[f64], straggler: Option<&str>) -> (Vec<String>, Vec<String>) {
    let stages = e.predicted_idle.len();
    let of_stage = |s: usize| (0..e.devices.len()).filter(move |&d| e.coords[d].pp == s);
    let stage_busy: Vec<f64> = (0..stages)
        .map(|s| of_stage(s).map(|d| busy[d]).sum::<f64>() / of_stage(s).count().max(1) as f64)
        .collect();
    let by_busy = |x: &usize, y: &usize| stage_busy[*x].total_cmp(&stage_busy[*y]);
    let cheap = (0..stages).min_by(by_busy).unwrap_or(0);
    let dear = (0..stages).max_by(by_busy).unwrap_or(0);
    let (mut off, mut ok) = (Vec::new(), Vec::new());
    for (s, &want) in e.predicted_idle.iter().enumerate() {
        let idle = of_stage(s)
            .map(|d| {
                let r = &e.devices[d].report;
                if r.span_s > 0.0 {
                    1.0 - r.busy_s / r.span_s
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / of_stage(s).count().max(1) as f64;
        let agrees = (idle - want).abs() <= e.threshold;
        let (got, want) = (100.0 * idle, 100.0 * want);
        if agrees {
            ok.push(format!("stage {s} idle {got:.0}% vs {want:.0}%"));
            continue;
        }
        let imbalance = stage_busy[dear] / stage_busy[cheap];
        let why = if let Some(straggler) = straggler {
            format!("waiting on the straggler, {straggler}")
        } else if stage_busy[cheap] > 0.0 && imbalance > 1.0 + e.threshold {
            format!("stages unbalanced — stage {dear} costs {imbalance:.2}× stage {cheap}")
        } else {
            "time blocked in collectives or on neighbours beyond the model".to_string()
        };
        off.push(format!(
            "stage {s} idle {got:.0}% vs predicted {want:.0}%: {why}"
        ));
    }
    (off, ok)
}

/// Memory terms of at least this share of a device's peak get a verdict when they are off.
const MEMORY_TERM_SHARE: f64 = 0.05;

/// Every memory term (of at least 5% of a device's peak, measured or predicted) off its prediction
/// by more than the threshold on some device: its worst device, and on how many it is off.
fn memory(e: &Evidence) -> Vec<String> {
    let names = crate::report::TERM_COLUMNS;
    let mut out = Vec::new();
    for (t, name) in names.iter().enumerate().take(6) {
        // (device, measured, predicted) of each device where the term is off.
        let mut off: Vec<(usize, u64, u64)> = Vec::new();
        for (d, m) in e.devices.iter().enumerate() {
            let got = m.report.memory.peak_terms();
            let want = e.plan.memory_bytes_per_stage[e.coords[d].pp];
            let (g, w) = (got.terms()[t].1, want.terms()[t].1);
            let share = g.max(w) as f64 / got.total.max(want.total).max(1) as f64;
            let ratio = g as f64 / w.max(1) as f64;
            if share >= MEMORY_TERM_SHARE && (ratio - 1.0).abs() > e.threshold {
                off.push((d, g, w));
            }
        }
        let far = |x: &(usize, u64, u64)| (x.1 as f64 / x.2.max(1) as f64).ln().abs();
        if let Some(&(d, g, w)) = off.iter().max_by(|a, b| far(a).total_cmp(&far(b))) {
            out.push(format!(
                "memory, {name}: {} measured vs {} predicted on device {d} ({:.2}×); off by more \
                 than {:.0}% on {} of {} devices",
                format_bytes(g),
                format_bytes(w),
                g as f64 / w.max(1) as f64,
                100.0 * e.threshold,
                off.len(),
                e.devices.len()
            ));
        }
    }
    out
}

/// Bytes per group (on its busiest device) against the planner's traffic.
fn bytes(e: &Evidence) -> (Vec<String>, Vec<String>) {
    let traffic = &e.plan.comm_bytes_per_step;
    let (mut off, mut ok) = (Vec::new(), Vec::new());
    for (group, kinds, want) in [
        ("tp", &["tp"][..], traffic.tp),
        ("dp", &["dp"], traffic.dp),
        ("pp", &["p2p", "pp"], traffic.pp),
        ("cp", &["cp"], traffic.cp),
        // Expert parallelism's all-to-alls, priced at a balanced load: a router that favours
        // some experts moves more or less.
        ("ep", &["ep"], traffic.ep),
    ] {
        let got = e
            .devices
            .iter()
            .map(|m| {
                kinds
                    .iter()
                    .map(|k| m.report.stats.bytes_sent_by_group(k))
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0) as f64;
        if want == 0.0 && got == 0.0 {
            continue;
        }
        let ratio = got / want.max(1.0);
        if (ratio - 1.0).abs() > e.threshold {
            off.push(format!(
                "{group} bytes {} vs predicted {} ({ratio:.2}×)",
                format_bytes(got as u64),
                format_bytes(want as u64)
            ));
        } else {
            ok.push(format!("{group} bytes {ratio:.2}× the prediction"));
        }
    }
    (off, ok)
}

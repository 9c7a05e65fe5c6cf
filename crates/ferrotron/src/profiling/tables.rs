//! The profile's tables: per device the step measured and predicted, the bytes per group and
//! what they take on the cluster's links, and peak memory per term.

use super::Measured;
use crate::report::Table;
use ferrotron_engine::memory::format_bytes;
use ferrotron_engine::parallel::StepReport;

/// The profile's tables, printed as markdown and shown in the page.
pub(crate) struct Tables {
    pub devices: Table,
    pub links: Table,
    pub memory: Table,
}

impl Tables {
    pub(crate) fn of(
        input: &ferrotron_core::plan::PlanInput,
        layout: &ferrotron_core::layout::Layout,
        plan: &ferrotron_core::plan::Plan,
        devices: &[Measured],
        coords: &[ferrotron_core::rank::Coords],
        predicted_idle: &[f64],
    ) -> Tables {
        Tables {
            devices: device_table(plan, devices, coords, predicted_idle),
            links: link_table(input, layout, devices, coords),
            memory: memory_table(plan, devices, coords),
        }
    }
}

/// Device time a step spent blocked in collectives of group `kind` (waiting and transferring).
fn blocked(r: &StepReport, kind: &str) -> f64 {
    r.stats
        .by_op
        .iter()
        .filter(|(k, _)| k.split('/').next() == Some(kind))
        .map(|(_, s)| s.time_blocked_s + s.time_transfer_s)
        .sum()
}

fn sent(r: &StepReport, kinds: &[&str]) -> u64 {
    kinds.iter().map(|k| r.stats.bytes_sent_by_group(k)).sum()
}

fn received(r: &StepReport, kinds: &[&str]) -> u64 {
    r.stats
        .by_op
        .iter()
        .filter(|(k, _)| kinds.contains(&k.split('/').next().unwrap_or("")))
        .map(|(_, o)| o.bytes_received)
        .sum()
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

/// Three byte counts as `a / b / c`.
fn three(a: u64, b: u64, c: u64) -> String {
    format!(
        "{} / {} / {}",
        format_bytes(a),
        format_bytes(b),
        format_bytes(c)
    )
}

/// Per device, the step measured (device time) and predicted.
fn device_table(
    plan: &ferrotron_core::plan::Plan,
    devices: &[Measured],
    coords: &[ferrotron_core::rank::Coords],
    predicted_idle: &[f64],
) -> Table {
    let traffic = &plan.comm_bytes_per_step;
    let mut table = Table::new(
        "per device, the step measured (device time) and predicted",
        &[
            "device",
            "stage",
            "dp",
            "tp",
            "computing (ms)",
            "blocked in tp (ms)",
            "blocked in dp (ms)",
            "blocked in world (ms)",
            "waiting on neighbours (ms)",
            "idle (%)",
            "predicted idle (%)",
            "sent tp / dp / pp",
            "predicted tp / dp / pp",
            "received",
        ],
    );
    for (d, m) in devices.iter().enumerate() {
        let r = &m.report;
        let (t, dp, s) = (coords[d].tp, coords[d].dp, coords[d].pp);
        let idle = if r.span_s > 0.0 {
            1.0 - r.busy_s / r.span_s
        } else {
            0.0
        };
        table.row(vec![
            d.to_string(),
            s.to_string(),
            dp.to_string(),
            t.to_string(),
            ms(r.busy_s),
            ms(blocked(r, "tp")),
            ms(blocked(r, "dp")),
            ms(blocked(r, "world")),
            ms(blocked(r, "p2p")),
            format!("{:.1}", 100.0 * idle),
            format!("{:.1}", 100.0 * predicted_idle[s]),
            three(sent(r, &["tp"]), sent(r, &["dp"]), sent(r, &["p2p", "pp"])),
            three(traffic.tp as u64, traffic.dp as u64, traffic.pp as u64),
            format_bytes(r.stats.total().bytes_received),
        ]);
    }
    table
}

/// Bytes per group and what they take on the cluster's links.
fn link_table(
    input: &ferrotron_core::plan::PlanInput,
    layout: &ferrotron_core::layout::Layout,
    devices: &[Measured],
    coords: &[ferrotron_core::rank::Coords],
) -> Table {
    let links = ferrotron_core::plan::links(&input.cluster, layout);
    let bw = |l: &ferrotron_core::topology::Link| l.bandwidth_bytes_per_s.max(1.0);
    let mut table = Table::new(
        format!(
            "bytes per group and what they take on the cluster's links ({}/s tp, {}/s dp, {}/s pp)",
            format_bytes(links.tp.bandwidth_bytes_per_s as u64),
            format_bytes(links.dp.bandwidth_bytes_per_s as u64),
            format_bytes(links.pp.bandwidth_bytes_per_s as u64),
        ),
        &[
            "device",
            "stage",
            "dp",
            "tp",
            "sent tp / dp / pp",
            "received tp / dp / pp",
            "on the tp link (ms)",
            "on the dp link (ms)",
            "on the pp link (ms)",
        ],
    );
    for (d, m) in devices.iter().enumerate() {
        let r = &m.report;
        let (t, dp, s) = (coords[d].tp, coords[d].dp, coords[d].pp);
        let (tp_b, dp_b, pp_b) = (sent(r, &["tp"]), sent(r, &["dp"]), sent(r, &["p2p", "pp"]));
        table.row(vec![
            d.to_string(),
            s.to_string(),
            dp.to_string(),
            t.to_string(),
            three(tp_b, dp_b, pp_b),
            three(
                received(r, &["tp"]),
                received(r, &["dp"]),
                received(r, &["p2p", "pp"]),
            ),
            ms(tp_b as f64 / bw(&links.tp)),
            ms(dp_b as f64 / bw(&links.dp)),
            ms(pp_b as f64 / bw(&links.pp)),
        ]);
    }
    table
}

/// Peak memory per term, measured beside predicted.
fn memory_table(
    plan: &ferrotron_core::plan::Plan,
    devices: &[Measured],
    coords: &[ferrotron_core::rank::Coords],
) -> Table {
    let mut table = Table::new(
        "peak memory per term, measured / predicted (MB)",
        &[
            "device",
            "weights (MB)",
            "gradients (MB)",
            "master (MB)",
            "optimizer (MB)",
            "activations (MB)",
            "comm (MB)",
            "total (MB)",
            "measured / predicted",
        ],
    );
    let mb = |a: u64, b: u64| format!("{:.2} / {:.2}", a as f64 / 1e6, b as f64 / 1e6);
    for (d, m) in devices.iter().enumerate() {
        let (got, want) = (
            m.report.memory.peak_terms(),
            plan.memory_bytes_per_stage[coords[d].pp],
        );
        let mut row = vec![d.to_string()];
        row.extend(
            got.terms()
                .iter()
                .zip(want.terms())
                .map(|(g, w)| mb(g.1, w.1)),
        );
        row.push(mb(got.total, want.total));
        row.push(format!(
            "{:.2}",
            got.total as f64 / want.total.max(1) as f64
        ));
        table.row(row);
    }
    table
}

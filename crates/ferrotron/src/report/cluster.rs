//! The layout drawn on the cluster — "the layout is a map of the interconnect": nodes as boxes with
//! their devices inside, each device filled with its pipeline stage's colour and labelled with its
//! data-parallel replica (and context-parallel rank), tensor-parallel groups outlined, and each link
//! class labelled with its bandwidth and the bytes per step per device it carries.

use super::colours;
use super::svg::{self, escape, legend, legend_width, FONT};
use ferrotron_core::layout::Layout;
use ferrotron_core::plan::Traffic;
use ferrotron_core::rank::{Dim, RankGrid};
use ferrotron_core::topology::Cluster;
use std::fmt::Write;

/// Nodes drawn; the others repeat the pattern and are stated.
const MAX_NODES: usize = 8;
/// Devices per row inside a node box.
const PER_ROW: usize = 8;
const CELL_W: f64 = 74.0;
const CELL_H: f64 = 38.0;
const GAP: f64 = 6.0;

/// The bytes per step per device each dimension moves, and whether its groups stay inside nodes.
fn dims(grid: &RankGrid, traffic: &Traffic) -> Vec<(&'static str, f64, bool)> {
    [
        ("tp", Dim::Tp, traffic.tp),
        ("cp", Dim::Cp, traffic.cp),
        ("dp", Dim::Dp, traffic.dp),
        ("pp", Dim::Pp, traffic.pp),
    ]
    .into_iter()
    .filter(|&(_, d, bytes)| grid.size(d) > 1 && bytes > 0.0)
    .map(|(name, d, bytes)| (name, bytes, grid.within_nodes(d)))
    .collect()
}

/// What one link class carries, in words: `inside a node, 300 GB/s: tp 1.20 GB, dp 13.06 GB per
/// device per step`.
fn link_text(inside: bool, bandwidth: f64, carried: &[(&str, f64, bool)]) -> String {
    let what: Vec<String> = carried
        .iter()
        .filter(|c| c.2 == inside)
        .map(|(name, bytes, _)| format!("{name} {}", super::show_bytes(*bytes as u64)))
        .collect();
    format!(
        "{}, {}/s: {}",
        if inside {
            "inside a node"
        } else {
            "between nodes"
        },
        super::show_bytes(bandwidth as u64),
        if what.is_empty() {
            "nothing in this layout".to_string()
        } else {
            format!("{} per device per step", what.join(", "))
        }
    )
}

/// The picture of `l` on `c`, with the bytes per step of `traffic` on each link class.
pub fn layout_map_svg(l: &Layout, c: &Cluster, traffic: &Traffic) -> String {
    let per_node = c.devices_per_node.max(1);
    let grid = l.rank_grid(per_node);
    let world = l.world_size();
    let nodes_used = world.div_ceil(per_node);
    let drawn = nodes_used.min(MAX_NODES);
    let carried = dims(&grid, traffic);
    let mut lines = vec![link_text(
        true,
        c.intra_node.bandwidth_bytes_per_s,
        &carried,
    )];
    if nodes_used > 1 {
        lines.push(link_text(
            false,
            c.inter_node.bandwidth_bytes_per_s,
            &carried,
        ));
    }
    if nodes_used > drawn {
        lines.push(format!(
            "nodes {drawn}–{} repeat this pattern for the later stages and replicas: not drawn",
            nodes_used - 1
        ));
    }
    let title = format!(
        "{world} devices on {nodes_used} node{} of {}: dp={} tp={} pp={}{}",
        if nodes_used == 1 { "" } else { "s" },
        c.name,
        l.dp,
        l.tp,
        l.pp,
        if l.cp > 1 {
            format!(" cp={}", l.cp)
        } else {
            String::new()
        }
    );
    let rows_per_node = per_node.div_ceil(PER_ROW);
    let cols = per_node.min(PER_ROW);
    let node_w = cols as f64 * (CELL_W + GAP) + GAP;
    let node_h = 20.0 + rows_per_node as f64 * (CELL_H + GAP) + GAP;
    // A swatch for each stage on the nodes drawn.
    let last_stage = grid.coords((drawn * per_node).min(world).max(1) - 1).pp;
    let mut entries: Vec<svg::Swatch> = (0..=last_stage)
        .map(|s| (colours::stage(s, l.pp), format!("pipeline stage {s}")))
        .collect();
    if l.tp > 1 {
        entries.push((
            colours::TP_GROUP.to_string(),
            "tensor-parallel group (outline)".into(),
        ));
    }
    let columns: Vec<&[svg::Swatch]> = entries.chunks(LEGEND_ROWS).collect();
    let legend_w = columns.iter().map(|c| legend_width(c)).sum::<f64>();
    let (left, top) = (4.0, 30.0 + 16.0 * lines.len() as f64);
    let text_w = lines
        .iter()
        .map(|t| svg::text_width(t, FONT) + 8.0)
        .fold(svg::title_width(&title, None), f64::max);
    let width = (left + node_w + 16.0 + legend_w).max(text_w);
    let legend_h = 16.0 * entries.len().min(LEGEND_ROWS) as f64;
    let height = (top + drawn as f64 * (node_h + GAP) + 4.0).max(top + legend_h);
    let mut s = svg::open(width, height);
    svg::title(&mut s, &title, None);
    for (i, line) in lines.iter().enumerate() {
        let _ = writeln!(
            s,
            r##"<text class="label link" data-link="{}" x="{left:.1}" y="{:.1}" fill="#333">{}</text>"##,
            if line.starts_with("inside") {
                "intra"
            } else if line.starts_with("between") {
                "inter"
            } else {
                "more"
            },
            32.0 + 16.0 * i as f64,
            escape(line)
        );
    }
    // A device's box.
    let place = |rank: usize| {
        let (node, slot) = (rank / per_node, rank % per_node);
        let y =
            top + node as f64 * (node_h + GAP) + 20.0 + (slot / PER_ROW) as f64 * (CELL_H + GAP);
        let x = left + GAP + (slot % PER_ROW) as f64 * (CELL_W + GAP);
        (x, y)
    };
    for node in 0..drawn {
        let y = top + node as f64 * (node_h + GAP);
        let _ = writeln!(
            s,
            r#"<rect class="node" data-node="{node}" x="{left:.1}" y="{y:.1}" width="{node_w:.1}" height="{node_h:.1}" fill="white" stroke="{}" stroke-width="1.5" rx="4"/><text class="label" x="{:.1}" y="{:.1}">node {node}</text>"#,
            colours::NODE,
            left + 6.0,
            y + 14.0
        );
        for slot in 0..per_node {
            let rank = node * per_node + slot;
            let (x, y) = place(rank);
            if rank >= world {
                let _ = writeln!(
                    s,
                    r##"<rect class="device" data-device="{rank}" x="{x:.1}" y="{y:.1}" width="{CELL_W}" height="{CELL_H}" fill="white" stroke="#ccc" stroke-dasharray="3 2"><title>device {rank}: not used by this layout</title></rect>"##
                );
                continue;
            }
            let at = grid.coords(rank);
            let place_text = match l.cp {
                1 => format!("s{} d{} t{}", at.pp, at.dp, at.tp),
                _ => format!("s{} d{} c{} t{}", at.pp, at.dp, at.cp, at.tp),
            };
            let _ = writeln!(
                s,
                r##"<rect class="device" data-device="{rank}" data-stage="{}" x="{x:.1}" y="{y:.1}" width="{CELL_W}" height="{CELL_H}" fill="{}" stroke="#777" stroke-width="0.5"><title>device {rank}: pipeline stage {}, data-parallel replica {}, context rank {}, tensor rank {}</title></rect><text class="label" x="{:.1}" y="{:.1}" text-anchor="middle">dev {rank}</text><text class="label" x="{:.1}" y="{:.1}" text-anchor="middle" font-size="{}">{place_text}</text>"##,
                at.pp,
                colours::stage(at.pp, l.pp),
                at.pp,
                at.dp,
                at.cp,
                at.tp,
                x + CELL_W / 2.0,
                y + 15.0,
                x + CELL_W / 2.0,
                y + 30.0,
                FONT - 1.0,
            );
        }
    }
    if l.tp > 1 {
        tp_outlines(&mut s, &grid, world, drawn * per_node, &place);
    }
    let mut x = left + node_w + 16.0;
    for column in columns {
        legend(&mut s, x, top, column);
        x += legend_width(column);
    }
    s.push_str("</svg>\n");
    s
}

/// Legend entries per column.
const LEGEND_ROWS: usize = 16;

/// An outline round each tensor-parallel group's devices, per node (a group forced across nodes
/// gets one outline in each), and per row of devices inside a node.
fn tp_outlines(
    s: &mut String,
    grid: &RankGrid,
    world: usize,
    drawn: usize,
    place: &dyn Fn(usize) -> (f64, f64),
) {
    for group in grid.groups(Dim::Tp) {
        let mut run: Vec<usize> = Vec::new();
        let flush = |s: &mut String, run: &[usize]| {
            if let (Some(&a), Some(&b)) = (run.first(), run.last()) {
                let ((x0, y0), (x1, _)) = (place(a), place(b));
                let _ = writeln!(
                    s,
                    r#"<rect class="tp-group" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="{}" stroke-width="2" rx="3"/>"#,
                    x0 - 2.5,
                    y0 - 2.5,
                    x1 - x0 + CELL_W + 5.0,
                    CELL_H + 5.0,
                    colours::TP_GROUP
                );
            }
        };
        for &r in group.iter().filter(|&&r| r < world && r < drawn) {
            let same_row = run
                .last()
                .is_some_and(|&p| p + 1 == r && place(p).1 == place(r).1);
            if !same_row {
                flush(s, &run);
                run.clear();
            }
            run.push(r);
        }
        flush(s, &run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::layout::LayoutSpec;

    #[test]
    fn a_layout_on_two_nodes_outlines_its_tensor_groups_and_labels_both_links() {
        let c = Cluster::parse("dgx-a100-80g,nodes=2").unwrap();
        let l = LayoutSpec::parse("dp=2,tp=4,pp=2").unwrap().layout;
        let traffic = Traffic {
            tp: 1e9,
            pp: 2e9,
            dp: 3e9,
            cp: 0.0,
            ep: 0.0,
        };
        let svg = layout_map_svg(&l, &c, &traffic);
        assert_eq!(svg.matches("class=\"device\"").count(), 16);
        assert_eq!(svg.matches("class=\"tp-group\"").count(), 4);
        assert!(svg.contains("inside a node") && svg.contains("tp 1.00 GB"));
        assert!(svg.contains("between nodes") && svg.contains("pp 2.00 GB"));
        assert!(svg.contains("pipeline stage 1"));
    }
}

//! Pages and pictures of a run — measured (`profile`, `train --report`) or predicted (`plan --out`).
//!
//! Each page is one self-contained HTML file: real tables with units in their headers, and inline
//! SVG charts whose scales come from the data. The parts checks rely on are stable: in memory
//! charts each term segment is a `<rect class="term" data-device data-term>`, every axis, bar and
//! legend label is a `<text class="label">`, and pipeline actions are `<rect class="action">`.

pub mod bytes;
pub mod html;
pub mod lines;
pub mod memory;
pub mod plan;
pub mod profile;
pub mod run;
pub mod svg;
pub mod timeline;

pub use html::{page, Section, Table};

/// Bytes in the unit their size calls for (B, KB, MB, GB, TB).
pub fn show_bytes(b: u64) -> String {
    let unit = svg::Unit::bytes(b as f64);
    unit.show(b as f64, if unit.divisor == 1.0 { 0 } else { 2 })
}

/// Column names of the memory terms in tables, in `MemoryTerms` order, ending with their total.
pub const TERM_COLUMNS: [&str; 7] = [
    "weights",
    "gradients",
    "master",
    "optimizer",
    "activations",
    "comm",
    "total",
];

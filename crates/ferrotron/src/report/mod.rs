//! Pages and pictures of a run — measured (`profile`, `train --report`) or predicted (`plan --out`).
//!
//! Each page is one self-contained HTML file: real tables with units in their headers, and inline
//! SVG charts whose scales come from the data. The parts checks rely on are stable: in memory
//! charts each term segment is a `<rect class="term" data-device data-term>`, every axis, bar and
//! legend label is a `<text class="label">`, every legend swatch is a `<rect class="swatch"
//! data-meaning>`, and timeline boxes are `<rect class="action" data-row data-kind data-device>`.
//! Every page opens with what was run ([`RunFacts`]).

pub mod bytes;
pub mod cluster;
pub mod colours;
pub mod facts;
pub mod html;
pub mod lines;
pub mod memory;
pub mod plan;
pub mod profile;
pub mod run;
pub mod svg;
pub mod timeline;

pub use facts::RunFacts;
pub use html::{page, Section, Table};

/// Bytes in the unit their size calls for (B, KB, MB, GB, TB), as the terminal prints them.
pub use ferrotron_engine::memory::format_bytes as show_bytes;

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

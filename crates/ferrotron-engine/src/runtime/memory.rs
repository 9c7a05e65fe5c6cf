//! The runtime reports memory in the planner's terms, so measurement and prediction line up.
pub use ferrotron_core::plan::MemoryTerms;

//! A run directory's `metrics.jsonl`, read back. Shared by the engine's and the CLI's tests.

use std::path::Path;

/// Every record of the run in `out_dir`, in order.
pub fn metrics_records(out_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The training loss of every step the run in `out_dir` recorded.
pub fn metric_losses(out_dir: &Path) -> Vec<f64> {
    metrics_records(out_dir)
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

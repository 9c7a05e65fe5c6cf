//! `bench checkpoint`: how long a checkpoint save holds training, synchronous against
//! asynchronous (`checkpoint_async`), on the same model, layout and destination, in alternating
//! rounds. Each run's `metrics.jsonl` records `checkpoint_stall_s` for every step that saved.

use anyhow::{Context, Result};

/// What one mode measured over its rounds.
struct Stalls {
    /// Every save's stall, seconds.
    stalls: Vec<f64>,
    checkpoint_bytes: u64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One training run saving every `every` steps; its saves' stalls.
fn run_once(words: &[String], out: &std::path::Path, asynchronous: bool) -> Result<Vec<f64>> {
    let mut words = words.to_vec();
    words.extend([
        "--out-dir".into(),
        out.display().to_string(),
        "--overwrite".into(),
    ]);
    if asynchronous {
        words.push("--checkpoint-async".into());
    }
    let cfg = super::train::settings_of(&words)?;
    ferrotron_engine::runtime::train(&cfg, &mut |_| {})?;
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))
        .with_context(|| format!("{}: the run's metrics", out.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["checkpoint_stall_s"].as_f64())
        .collect())
}

/// `to`: where the checkpoints go (a directory or an `s3://` prefix; default each run's own).
pub fn run(
    model: &str,
    layout: &str,
    steps: usize,
    every: usize,
    rounds: usize,
    to: Option<&str>,
) -> Result<()> {
    anyhow::ensure!(
        every >= 1 && steps >= 2 * every,
        "--steps {steps} --every {every}: give at least two saves (steps ≥ 2 × every)"
    );
    let dir =
        std::env::temp_dir().join(format!("ferrotron-bench-checkpoint-{}", std::process::id()));
    let words: Vec<String> = [
        "--model",
        model,
        "--layout",
        layout,
        "--steps",
        &steps.to_string(),
        "--checkpoint-every",
        &every.to_string(),
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--eval-every",
        "0",
        "--eval-batches",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    println!(
        "ferrotron bench checkpoint: {model}, layout `{layout}`, a save every {every} of {steps} steps into {}, {rounds} alternated rounds (wall seconds the save held training)",
        to.unwrap_or("each run's directory")
    );
    let mut modes = [
        (
            false,
            Stalls {
                stalls: Vec::new(),
                checkpoint_bytes: 0,
            },
        ),
        (
            true,
            Stalls {
                stalls: Vec::new(),
                checkpoint_bytes: 0,
            },
        ),
    ];
    for round in 0..rounds {
        for (asynchronous, m) in modes.iter_mut() {
            let out = dir.join(format!("{round}-{asynchronous}"));
            m.stalls.extend(run_once(&words, &out, *asynchronous)?);
            let step = out
                .join("checkpoints")
                .join(ferrotron_engine::checkpoint::step_dir_name(every));
            m.checkpoint_bytes = std::fs::read_dir(&step)
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| e.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0);
            let _ = std::fs::remove_dir_all(&out);
        }
    }
    println!("| save | saves measured | median stall (ms) | max stall (ms) | checkpoint |");
    println!("|---|---|---|---|---|");
    let mut medians = Vec::new();
    for (asynchronous, m) in modes.iter_mut() {
        let max = m.stalls.iter().copied().fold(0.0, f64::max);
        let med = median(&mut m.stalls);
        medians.push(med);
        println!(
            "| {} | {} | {:.1} | {:.1} | {} |",
            if *asynchronous {
                "asynchronous"
            } else {
                "synchronous"
            },
            m.stalls.len(),
            med * 1e3,
            max * 1e3,
            ferrotron_engine::memory::format_bytes(m.checkpoint_bytes)
        );
    }
    println!(
        "\nasynchronous stall / synchronous stall: {:.1}% (medians)",
        100.0 * medians[1] / medians[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

//! The effective-batch guard, run as a user runs it: a run that continues another (resumed, or
//! fine-tuning the model it wrote) with different tokens per step is refused unless `--lr-scaling`
//! says how the LR follows; a layout change is never a batch change.

mod common;

use common::*;
use std::path::Path;

fn train(out: &Path, batch: &str, extra: &[&str]) -> std::process::Output {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/gnu-manuals.txt");
    let mut args = vec![
        "train",
        "--data",
        data.to_str().unwrap(),
        "--batch-size",
        batch,
        "--seq-len",
        "32",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--warmup-steps",
        "0",
        "--out-dir",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    if !extra.contains(&"--model") {
        args.extend_from_slice(&["--model", "llama-tiny"]);
    }
    ferrotron(&args)
}

/// `tokens_per_step` and `lr` (the optimizer's, in f32) of each line of a run's metrics.
fn steps(out: &Path) -> Vec<(u64, f32)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["tokens_per_step"].as_u64().unwrap(),
                v["lr"].as_f64().unwrap() as f32,
            )
        })
        .collect()
}

#[test]
fn resuming_with_another_batch_needs_a_rule_and_another_layout_does_not() {
    let dir = temp_dir("effective-batch");
    let a = dir.join("a");
    let o = train(
        &a,
        "8",
        &["--steps", "2", "--lr", "0.004", "--min-lr", "0.004"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stderr(&o);
    assert!(
        said.contains("8 sequences × 32 tokens = 256 tokens per optimizer step"),
        "{said}"
    );
    assert_eq!(steps(&a), vec![(256, 0.004); 2]);
    let ck = a.join("checkpoints");
    let ck = ck.to_str().unwrap();

    // Another layout, the same batch: no question asked, the same tokens per step.
    let o = train(
        &a,
        "8",
        &[
            "--steps",
            "3",
            "--lr",
            "0.004",
            "--min-lr",
            "0.004",
            "--layout",
            "dp=2,mbs=2",
            "--resume",
            ck,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("lr-scaling"), "{}", stderr(&o));
    assert_eq!(steps(&a)[2], (256, 0.004));

    // Half the batch: refused, naming both batches and what each rule would give.
    let o = train(&a, "4", &["--steps", "4", "--resume", ck]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("256 tokens per optimizer step at lr 4e-3")
            && err.contains("128 in this run")
            && err.contains("--lr-scaling none")
            && err.contains("linear (lr 2e-3)"),
        "{err}"
    );
    assert_eq!(steps(&a).len(), 3, "a refused run writes nothing");

    // With a rule: applied, said, and recorded.
    let o = train(
        &a,
        "4",
        &["--steps", "4", "--resume", ck, "--lr-scaling", "linear"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("lr 4e-3 -> 2e-3"), "{}", stderr(&o));
    assert_eq!(steps(&a)[3], (128, 0.002));
}

#[test]
fn fine_tuning_a_run_s_model_with_another_batch_needs_a_rule() {
    let dir = temp_dir("effective-batch-fine-tune");
    let a = dir.join("a");
    let o = train(&a, "8", &["--steps", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let model = a.join("model");
    let model = model.to_str().unwrap();
    let o = train(&dir.join("b"), "16", &["--steps", "1", "--model", model]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("train_config.json") && stderr(&o).contains("--lr-scaling"),
        "{}",
        stderr(&o)
    );
    assert!(!dir.join("b").exists(), "a refused run claims no directory");
    let o = train(
        &dir.join("b"),
        "16",
        &["--steps", "1", "--model", model, "--lr-scaling", "sqrt"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // The same batch fine-tunes without a rule.
    let o = train(&dir.join("c"), "8", &["--steps", "1", "--model", model]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Settings that are there but cannot be read are an error, not a guard that does nothing.
    std::fs::write(a.join("train_config.json"), "{ not json").unwrap();
    let o = train(&dir.join("d"), "8", &["--steps", "1", "--model", model]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot be read"), "{}", stderr(&o));
}

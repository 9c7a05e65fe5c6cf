//! Bad input gets a clear error (or a correct result), never a panic, a silent wrong answer or
//! unbounded work: the cases users ran into, run as they ran them.

mod common;

use common::*;
use std::path::Path;

/// A token file of `input_ids` with `shape`.
fn token_file(path: &Path, ids: &[i64], shape: [usize; 2]) {
    let data: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let header = format!(
        "{{\"input_ids\":{{\"dtype\":\"I64\",\"shape\":[{},{}],\"data_offsets\":[0,{}]}}}}",
        shape[0],
        shape[1],
        data.len()
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

/// Runs `ferrotron args…`, expects it to fail, and returns its standard error.
fn fails(args: &[&str]) -> String {
    let o = ferrotron(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "`{}` succeeded: {err}", args.join(" "));
    assert!(
        !err.contains("panicked"),
        "`{}` panicked: {err}",
        args.join(" ")
    );
    err
}

#[test]
fn token_batches_that_cannot_be_a_step_are_refused_by_grads_and_verify() {
    let dir = temp_dir("bad-tokens");
    let model = fixture("llama_tiny");
    let vocab = 512;
    for (name, ids, shape, want) in [
        (
            "vocab",
            vec![1, 2, vocab, 3],
            [1, 4],
            "token id 512 is outside the model's vocabulary of 512",
        ),
        (
            "seq1",
            vec![1, 2],
            [2, 1],
            "sequences of 1 token(s) predict nothing",
        ),
        ("rows0", vec![], [0, 4], "the batch has no sequences"),
    ] {
        let file = dir.join(format!("{name}.safetensors"));
        token_file(&file, &ids, shape);
        let f = file.to_str().unwrap();
        let m = model.to_str().unwrap();
        let out = dir.join("g.safetensors");
        for args in [
            vec!["verify", "--model", m, "--tokens", f, "--layout", "tp=2"],
            vec!["verify", "--model", m, "--tokens", f, "--layout", "dp=1"],
            vec![
                "grads",
                "--model",
                m,
                "--tokens",
                f,
                "--out",
                out.to_str().unwrap(),
            ],
        ] {
            let err = fails(&args);
            assert!(err.contains(want) && err.contains(f), "{name}: {err}");
        }
    }
    let m = model.to_str().unwrap();
    // More devices than one process runs as threads: refused before any thread starts.
    let err = fails(&[
        "verify", "--model", m, "--layout", "dp=300", "--batch", "300",
    ]);
    assert!(
        err.contains("300 devices as threads of one process: at most 256"),
        "{err}"
    );
    for (flag, value, want) in [
        ("--batch", "0", "no sequences"),
        ("--tolerance", "nan", "must be a positive relative error"),
    ] {
        let err = fails(&["verify", "--model", m, "--layout", "tp=2", flag, value]);
        assert!(err.contains(flag) && err.contains(want), "{err}");
    }
}

/// A setting read from the environment that the engine does not understand is an error naming it,
/// not a silent default.
#[test]
fn an_unknown_huge_pages_setting_is_named() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["plan", "--model", "llama-small", "--global-batch", "8"])
        .env("FERROTRON_HUGE_PAGES", "yes")
        .output()
        .expect("runs");
    let err = stderr(&o);
    assert!(!o.status.success() && !err.contains("panicked"), "{err}");
    assert!(
        err.contains("FERROTRON_HUGE_PAGES=yes: give 0 (small pages) or 1"),
        "{err}"
    );
}

#[test]
fn flags_and_specs_name_what_is_wrong() {
    for (args, want) in [
        ("train --lr -1", "`lr`: must be a positive number"),
        (
            "plan --model llama-small --global-batch -8",
            "'-8' for '--global-batch",
        ),
        (
            "plan --model llama-small --global-batch 8 --seq 0",
            "--seq: a sequence needs at least one token",
        ),
        (
            "plan --model llama-small --global-batch 8 --layout pp=1000",
            "field `pp`: dp·tp·pp = 1·1·1000 = 1000 devices",
        ),
        (
            "plan --model llama-small --global-batch 8 --layout dp=3",
            "field `dp`: the global batch of 8 sequences does not divide among dp=3",
        ),
        (
            "plan --model params=1e30 --global-batch 8 --layout dp=8",
            "field `params`: `1e30` is beyond the 1e15 parameters",
        ),
        (
            "schedule --pp 1000 --micro-batches 100000",
            "beyond the 16777216 a schedule may hold",
        ),
        (
            "train --cluster nodes=0",
            "field `nodes`: `0` must be a whole number",
        ),
        (
            "train --data /no/such/file.txt --steps 1",
            "/no/such/file.txt",
        ),
        // A model `plan` prices and the engine does not run: said before any work.
        (
            "train --model deepseek-v3 --steps 1",
            "not implemented by the engine yet: plan it",
        ),
        (
            "bench train --model deepseek-v3",
            "not implemented by the engine yet: plan it",
        ),
    ] {
        let args: Vec<&str> = args.split_whitespace().collect();
        let err = fails(&args);
        assert!(err.contains(want), "`{}`: {err}", args.join(" "));
        // Each cause once: an OS error is not repeated after the message that quotes it.
        assert!(err.matches("(os error").count() <= 1, "{err}");
    }
}

#[test]
fn plan_prints_any_size_in_bounded_lines_and_readable_units() {
    // The command's standard output, after it succeeded.
    let prints = |args: &str| {
        let o = ferrotron(&args.split_whitespace().collect::<Vec<_>>());
        assert!(o.status.success(), "`{args}`: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = prints("plan --model gpt3-175b --global-batch 8 --layout dp=8");
    let widest = out.lines().map(|l| l.chars().count()).max().unwrap();
    assert!(widest < 400, "a {widest}-character line");
    assert!(out.contains("total (TB)"), "{out}");
    let out = prints("plan --model llama-small --global-batch 8 --layout dp=2,pp=2");
    assert!(
        out.contains("total (MB)") && !out.contains("| 0.00 | 0.00 |"),
        "{out}"
    );
    // 64 stages: the first and last 8 and the worst are drawn, the rest counted.
    let out = prints(
        "plan --model arch=llama,layers=64,hidden=1024,heads=8,vocab=32000 \
         --cluster dgx-a100-80g,nodes=8 --global-batch 64 --layout pp=64,mbs=1",
    );
    assert!(out.contains("more stages not drawn"), "{out}");
    assert!(out.lines().filter(|l| l.contains("  stage ")).count() <= 17);
    let out = prints("schedule --pp 100 --micro-batches 1000");
    assert!(
        out.contains("too large to draw") && out.len() < 2000,
        "{out}"
    );
}

/// `train` into a directory that holds a run: refused unless resumed or overwritten.
#[test]
fn a_run_directory_holds_one_run() {
    let dir = temp_dir("run-dir");
    let run = train;
    // The run fails, and its error names every one of `says` and none of `omits`.
    let refused = |o: &std::process::Output, says: &[&str], omits: &[&str]| {
        let err = stderr(o);
        assert!(
            !o.status.success()
                && says.iter().all(|s| err.contains(s))
                && !omits.iter().any(|s| err.contains(s)),
            "{err}"
        );
    };
    let a = dir.join("a");
    assert!(run(&a, "2", &[]).status.success());
    refused(
        &run(&a, "2", &[]),
        &[
            "already holds a run (last checkpoint: step-000002)",
            "--resume",
            "--overwrite",
        ],
        &[],
    );
    // Resuming its own checkpoints continues it, appending to its metrics.
    let ck = a.join("checkpoints");
    let o = run(&a, "3", &["--resume", ck.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 3);
    // Another run's checkpoint would mix the two.
    let b = dir.join("b");
    assert!(run(&b, "2", &[]).status.success());
    let o = run(
        &a,
        "4",
        &["--resume", b.join("checkpoints").to_str().unwrap()],
    );
    refused(&o, &["would mix the two"], &[]);
    // --overwrite would delete the very checkpoint a --resume into the same directory needs.
    let o = run(&a, "4", &["--overwrite", "--resume", ck.to_str().unwrap()]);
    refused(&o, &["--overwrite would delete"], &[]);
    assert!(
        a.join("checkpoints/step-000003").exists(),
        "nothing was deleted"
    );
    // --overwrite replaces it: one run's metrics, its checkpoints only.
    let o = run(&a, "2", &["--overwrite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2);
    assert!(!a.join("checkpoints/step-000003").exists());
    assert!(a.join("checkpoints/step-000002").exists());
    // A run stopped before its first checkpoint has nothing to resume: the refusal says so.
    std::fs::remove_dir_all(a.join("checkpoints")).unwrap();
    refused(
        &run(&a, "2", &[]),
        &["wrote no checkpoint to continue from", "--overwrite"],
        &["--resume"],
    );
}

#[test]
fn holding_nothing_out_gives_no_validation_loss_rather_than_zero() {
    let dir = temp_dir("no-val");
    let o = ferrotron(&[
        "train",
        "--model",
        "llama-tiny",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--val-fraction",
        "0",
        "--out-dir",
        dir.join("r").to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains("no validation loss") && !out.contains("0.0000 ->"),
        "{out}"
    );
    let metrics = std::fs::read_to_string(dir.join("r/metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["val_loss"].is_null(), "{line}");
    }
}

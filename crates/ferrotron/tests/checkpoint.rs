//! Checkpoints survive the trainer dying mid-save: `ferrotron train` is aborted at every point of a
//! save and killed at random moments; afterwards `latest` names a complete checkpoint, every
//! checkpoint directory verifies, and resuming finishes the run exactly as if nothing happened.
//! The offline `checkpoint` commands run as a user runs them.

mod common;

use common::*;
use ferrotron_engine::checkpoint::{self, Checkpoint, CRASH_ENV};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn corpus() -> PathBuf {
    let d = temp_dir("corpus");
    let f = d.join("manual.txt");
    std::fs::write(&f, &ferrotron_engine::data::BUILTIN_CORPUS[..60_000]).unwrap();
    f
}

/// `ferrotron train` on the tiny Llama over 4 devices, checkpointing every step.
fn train_cmd(out: &Path, corpus: &Path, steps: usize, resume: bool) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    c.args([
        "train",
        "--model",
        fixture("llama_tiny").to_str().unwrap(),
        "--data",
        corpus.to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--layout",
        "dp=2,tp=2,zero=1",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    if resume {
        c.args(["--resume", out.join("checkpoints").to_str().unwrap()]);
    }
    c
}

/// Every checkpoint directory under `root` verifies, and `latest` (if any) names one of them.
/// Returns the step `latest` names.
fn check_invariants(root: &Path) -> Option<usize> {
    if !root.exists() {
        return None;
    }
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.starts_with("step-") {
            if let Err(e) = Checkpoint::open(&p) {
                panic!("{name} looks complete but does not verify: {e}");
            }
        } else {
            assert!(
                name == "latest" || name.starts_with('.'),
                "unexpected {name} in the checkpoint directory"
            );
        }
    }
    if !root.join("latest").exists() {
        return None;
    }
    let ck = Checkpoint::open(root).expect("`latest` names a complete checkpoint");
    Some(ck.manifest.step)
}

fn final_params(out: &Path) -> Vec<Vec<u32>> {
    let (_, p) = checkpoint::load_params(&out.join("checkpoints")).unwrap();
    p.tensors
        .iter()
        .map(|t| t.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn a_crash_at_any_point_of_a_save_leaves_the_previous_checkpoint() {
    let corpus = corpus();
    let reference = temp_dir("crash-ref");
    assert!(train_cmd(&reference, &corpus, 3, false)
        .output()
        .unwrap()
        .status
        .success());
    // Synchronous saves, and asynchronous ones (the crash then comes in the writing thread, or
    // when the save is committed at a later step).
    for asynchronous in [false, true] {
        let with_mode = |mut c: Command| {
            if asynchronous {
                c.arg("--checkpoint-async");
            }
            c
        };
        for point in ["rank-file", "manifest", "rename", "latest"] {
            let out = temp_dir(&format!("crash-{point}-{asynchronous}"));
            let o = with_mode(train_cmd(&out, &corpus, 3, false))
                .env(CRASH_ENV, format!("{point}@2"))
                .output()
                .unwrap();
            assert!(!o.status.success(), "{point}: the hook aborts the save");
            let root = out.join("checkpoints");
            assert_eq!(
                check_invariants(&root),
                Some(1),
                "{point} (async: {asynchronous}): `latest` still names step 1"
            );
            let o = with_mode(train_cmd(&out, &corpus, 3, true))
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{point}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            assert_eq!(check_invariants(&root), Some(3));
            assert!(
                final_params(&out) == final_params(&reference),
                "{point} (async: {asynchronous}): resumed run differs from the uninterrupted one"
            );
        }
    }
}

/// Every array of every rank file of checkpoint `dir`, by file and key, as bits.
fn arrays(dir: &Path) -> std::collections::BTreeMap<(String, String), Vec<u32>> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.starts_with("rank-") {
            for (key, (_, values)) in read_f32(&p) {
                out.insert(
                    (name.clone(), key),
                    values.iter().map(|x| x.to_bits()).collect(),
                );
            }
        }
    }
    out
}

#[test]
fn asynchronous_saves_write_the_synchronous_state_and_record_their_stall() {
    let corpus = corpus();
    let (sync, asy) = (temp_dir("save-sync"), temp_dir("save-async"));
    assert!(train_cmd(&sync, &corpus, 4, false)
        .output()
        .unwrap()
        .status
        .success());
    let o = train_cmd(&asy, &corpus, 4, false)
        .arg("--checkpoint-async")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Kept: the newest two, each bit for bit the synchronous save's state.
    for step in ["step-000003", "step-000004"] {
        let (a, b) = (
            sync.join("checkpoints").join(step),
            asy.join("checkpoints").join(step),
        );
        assert!(!arrays(&a).is_empty());
        assert!(
            arrays(&a) == arrays(&b),
            "{step}: the asynchronous save's arrays differ"
        );
    }
    assert_eq!(check_invariants(&asy.join("checkpoints")), Some(4));
    // Every step saved (--checkpoint-every 1): each records how long its save held the devices.
    for out in [&sync, &asy] {
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let stall = v["checkpoint_stall_s"].as_f64();
            assert!(stall.is_some_and(|s| s > 0.0), "{line}");
            // The copy an asynchronous save holds is the planner's figure, byte for byte.
            for d in v["devices"].as_array().unwrap() {
                let measured = &d["checkpoint_snapshot_bytes"];
                assert_eq!(out == &asy, measured.is_u64(), "{line}");
                assert_eq!(
                    measured, &d["predicted_checkpoint_snapshot_bytes"],
                    "{line}"
                );
            }
        }
    }
}

#[test]
fn killing_the_trainer_at_random_moments_never_loses_a_checkpoint() {
    let corpus = corpus();
    let steps = 60;
    let reference = temp_dir("kill-ref");
    let o = train_cmd(&reference, &corpus, steps, false)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = temp_dir("kill");
    let root = out.join("checkpoints");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut kills = 0;
    for _ in 0..12 {
        let latest = check_invariants(&root);
        if latest == Some(steps) {
            break;
        }
        let mut cmd = train_cmd(&out, &corpus, steps, latest.is_some());
        if latest.is_none() {
            // Killed before its first checkpoint (a loaded machine is slow to start): nothing to
            // continue, so the run is started again as its refusal says.
            cmd.arg("--overwrite");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.gen_range(150..700)));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        let now = check_invariants(&root);
        eprintln!("killed: latest {latest:?} → {now:?}");
        assert!(now >= latest, "a kill lost progress: {latest:?} → {now:?}");
    }
    assert!(kills > 0, "the trainer was killed at least once");
    if check_invariants(&root) != Some(steps) {
        let resume = check_invariants(&root).is_some();
        let mut cmd = train_cmd(&out, &corpus, steps, resume);
        if !resume {
            cmd.arg("--overwrite");
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(check_invariants(&root), Some(steps));
    assert!(
        final_params(&out) == final_params(&reference),
        "killed and resumed {kills} times, the run differs from the uninterrupted one"
    );
}

#[test]
fn checkpoint_commands_inspect_reshard_export_and_import() {
    let root = temp_dir("cmds");
    let imported = root.join("imported");
    let o = ferrotron(&[
        "checkpoint",
        "import",
        fixture("gpt2_tiny").to_str().unwrap(),
        "--out",
        imported.to_str().unwrap(),
        "--layout",
        "tp=2,pp=2",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let resharded = root.join("resharded");
    let o = ferrotron(&[
        "checkpoint",
        "reshard",
        imported.to_str().unwrap(),
        "--layout",
        "dp=2,zero=3",
        "--out",
        resharded.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = ferrotron(&["checkpoint", "inspect", resharded.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for want in [
        "step 0",
        "dp=2",
        "zero=3",
        "rank-00001.safetensors",
        "transformer.h.0.attn.c_attn.weight",
        "checksums OK",
    ] {
        assert!(text.contains(want), "inspect lacks `{want}`:\n{text}");
    }
    let hf = root.join("hf");
    let o = ferrotron(&[
        "checkpoint",
        "export",
        resharded.to_str().unwrap(),
        "--hf",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A whole model: the tokenizer came in with the import and goes out with the export.
    assert_eq!(
        std::fs::read(hf.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture("gpt2_tiny").join("tokenizer.json")).unwrap()
    );
    let want = read_f32(&fixture("gpt2_tiny").join("model.safetensors"));
    let got = read_f32(&hf.join("model.safetensors"));
    for (name, (shape, values)) in &got {
        assert_eq!(&want[name].0, shape, "{name}");
        assert!(&want[name].1 == values, "{name} changed on the way");
    }
    // A damaged file is named.
    let f = resharded.join("step-000000").join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x80;
    std::fs::write(&f, bytes).unwrap();
    let o = ferrotron(&["checkpoint", "inspect", resharded.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("rank-00000.safetensors") && err.contains("checksum mismatch"),
        "{err}"
    );
}

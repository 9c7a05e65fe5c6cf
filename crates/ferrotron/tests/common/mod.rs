#![allow(dead_code)]
//! Helpers shared by the command-line tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty directory for test `tag` of this test process (the directories of earlier runs
/// removed first: see `stale_dirs.rs`).
pub fn temp_dir(tag: &str) -> PathBuf {
    stale_dirs::remove_stale("ferrotron-cli-");
    let d = std::env::temp_dir().join(format!("ferrotron-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A path as a command-line argument.
pub fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// `ferrotron ARGS…`, run to completion.
pub fn ferrotron(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .env("ATEN_CPU_CAPABILITY", REFERENCE_TORCH)
        .output()
        .expect("runs")
}

/// The PyTorch CPU capability the QLoRA references were made with (an AVX2 machine, whose sums
/// run in 8 lanes; tests/fixtures/README.md): NF4 quantization reproduces its sums' order.
pub const REFERENCE_TORCH: &str = "avx2";

/// A command's standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Every f32 tensor of a safetensors file: name → (shape, values).
pub fn read_f32(path: &PathBuf) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == safetensors::Dtype::F32)
        .map(|(n, v)| {
            (
                n,
                (
                    v.shape().to_vec(),
                    v.data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
            )
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den).sqrt()
}
pub mod readme;
#[path = "../../../ferrotron-engine/tests/common/run_metrics.rs"]
mod run_metrics;
#[path = "../../../ferrotron-engine/tests/common/stale_dirs.rs"]
mod stale_dirs;
#[allow(unused_imports)]
pub use run_metrics::{metric_losses, metrics_records};

/// `grads --adapter`'s output `got` (`loss`, `grad.<PEFT name>`) against `reference`'s f32 values
/// (PEFT's): the loss within 1e-6, one gradient per adapter tensor, each of its shape and within
/// 1e-5 relative.
pub fn assert_adapter_grads(got: &PathBuf, reference: &PathBuf, what: &str) {
    let (got, want) = (read_f32(got), read_f32(reference));
    let loss = want["loss_f32"].1[0] as f64;
    let loss_err = (got["loss"].1[0] as f64 - loss).abs() / loss;
    assert!(loss_err <= 1e-6, "{what}: loss {loss_err:e}");
    let names: Vec<&String> = want.keys().filter(|k| k.starts_with("grad_f32.")).collect();
    assert_eq!(
        got.len() - 1,
        names.len(),
        "{what}: one gradient per adapter tensor"
    );
    for name in names {
        let g = &got[&name.replace("grad_f32.", "grad.")];
        assert_eq!(g.0, want[name].0, "{what}: {name}");
        assert!(rel_err(&g.1, &want[name].1) <= 1e-5, "{what}: {name}");
    }
}

/// `train` of `llama-tiny` for `steps` steps of 2 × 16 tokens into `out`, then `extra`.
pub fn train_args(out: &Path, steps: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--model",
        "llama-tiny",
        "--steps",
        steps,
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--out-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(out.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// [`train_args`], run to completion.
pub fn train(out: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let args = train_args(out, steps, extra);
    ferrotron(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

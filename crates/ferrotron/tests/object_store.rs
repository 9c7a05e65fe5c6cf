//! `s3://` models on a real S3-compatible server (s3s-fs, started by `scripts/local-s3.sh`): read
//! exactly as the same directory on disk, a sharded index included.
mod common;
#[path = "../../ferrotron-engine/tests/common/local_s3.rs"]
mod local_s3;

use common::{fixture, path, read_f32, stderr, temp_dir};
use ferrotron_engine::storage::Location;
use local_s3::LocalS3;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

/// One server for this test binary, with the bucket `models`.
fn server() -> &'static LocalS3 {
    static SERVER: OnceLock<LocalS3> = OnceLock::new();
    SERVER.get_or_init(|| {
        let s = LocalS3::start(&temp_dir("s3-server"), &["models"]);
        s.export();
        s
    })
}

/// `ferrotron ARGS…` with the server's variables.
fn ferrotron(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    server().apply(&mut cmd).args(args).output().expect("runs")
}

/// Uploads every file of the local directory `dir` under `url`.
fn upload(dir: &Path, url: &str) {
    let to = Location::parse(url).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            to.join(p.file_name().unwrap().to_str().unwrap())
                .upload_file(&p)
                .unwrap();
        }
    }
}

fn grads(model: &str, layout: &str, out: &Path) -> Vec<u8> {
    let refs = fixture("llama_tiny").join("reference_grads.safetensors");
    let o = ferrotron(&[
        "grads",
        "--model",
        model,
        "--tokens",
        path(&refs),
        "--layout",
        layout,
        "--out",
        path(out),
    ]);
    assert!(o.status.success(), "{model} {layout}: {}", stderr(&o));
    std::fs::read(out).unwrap()
}

#[test]
fn grads_of_an_s3_model_equal_the_local_directory_bit_for_bit() {
    server();
    let dir = temp_dir("s3-grads");
    upload(&fixture("llama_tiny"), "s3://models/llama_tiny");
    // The same weights split over a sharded index (two files).
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    let all = read_f32(&fixture("llama_tiny").join("model.safetensors"));
    let mut map = serde_json::Map::new();
    let names: Vec<&String> = all.keys().collect();
    for (k, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let tensors: Vec<(String, Vec<usize>, &[f32])> = part
            .iter()
            .map(|n| ((*n).clone(), all[*n].0.clone(), all[*n].1.as_slice()))
            .collect();
        ferrotron_engine::hf::write_tensors(
            &sharded.join(&file),
            &tensors,
            ferrotron_engine::hf::StorageDtype::F32,
        )
        .unwrap();
        for n in part {
            map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(
        fixture("llama_tiny").join("config.json"),
        sharded.join("config.json"),
    )
    .unwrap();
    upload(&sharded, "s3://models/llama_tiny_sharded");

    for layout in ["tp=1", "tp=2"] {
        let local = grads(
            path(&fixture("llama_tiny")),
            layout,
            &dir.join("local.safetensors"),
        );
        let remote = grads(
            "s3://models/llama_tiny",
            layout,
            &dir.join("s3.safetensors"),
        );
        assert!(
            local == remote,
            "{layout}: s3:// gradients differ from the local ones"
        );
        let remote = grads(
            "s3://models/llama_tiny_sharded",
            layout,
            &dir.join("s3s.safetensors"),
        );
        assert!(
            local == remote,
            "{layout}: the sharded s3:// model's gradients differ"
        );
    }
}

#[test]
fn a_missing_bucket_or_model_is_said_before_any_work() {
    let dir = temp_dir("s3-missing");
    let refs = fixture("llama_tiny").join("reference_grads.safetensors");
    let out = dir.join("g.safetensors");
    for (model, says) in [
        ("s3://no-such-bucket/m", "does not exist"),
        ("s3://models/no-such-model", "config.json"),
        ("s3://Bad_Bucket/m", "not a bucket name"),
    ] {
        let o = ferrotron(&[
            "grads",
            "--model",
            model,
            "--tokens",
            path(&refs),
            "--out",
            path(&out),
        ]);
        let e = stderr(&o);
        assert!(!o.status.success() && e.contains(says), "{model}: {e}");
    }
}

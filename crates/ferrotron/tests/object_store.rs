//! `s3://` models on a real S3-compatible server (s3s-fs, started by `scripts/local-s3.sh`): read
//! exactly as the same directory on disk, a sharded index included.
mod common;
#[path = "../../ferrotron-engine/tests/common/local_s3.rs"]
mod local_s3;

use common::{fixture, metric_losses, metrics_records, path, read_f32, stderr, temp_dir};
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

/// `grads` of `model` on llama_tiny's reference tokens, split as `layout`.
fn run_grads(model: &str, layout: &str, out: &Path) -> Output {
    let refs = fixture("llama_tiny").join("reference_grads.safetensors");
    ferrotron(&[
        "grads",
        "--model",
        model,
        "--tokens",
        path(&refs),
        "--layout",
        layout,
        "--out",
        path(out),
    ])
}

/// [`run_grads`], which must succeed: the gradients file's bytes.
fn grads(model: &str, layout: &str, out: &Path) -> Vec<u8> {
    let o = run_grads(model, layout, out);
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
        for url in ["s3://models/llama_tiny", "s3://models/llama_tiny_sharded"] {
            let remote = grads(url, layout, &dir.join("s3.safetensors"));
            assert!(
                local == remote,
                "{layout}: {url}'s gradients differ from the local ones"
            );
        }
    }
}

#[test]
fn a_missing_bucket_or_model_is_said_before_any_work() {
    let dir = temp_dir("s3-missing");
    let out = dir.join("g.safetensors");
    for (model, says) in [
        ("s3://no-such-bucket/m", "does not exist"),
        ("s3://models/no-such-model", "config.json"),
        ("s3://Bad_Bucket/m", "not a bucket name"),
    ] {
        let o = run_grads(model, "tp=1", &out);
        let e = stderr(&o);
        assert!(!o.status.success() && e.contains(says), "{model}: {e}");
    }
}

/// The bytes of `model.safetensors` a tp=`tp` device needs: the tensors tensor parallelism cuts,
/// ÷ tp; the replicated ones (norms) whole; K and V ÷ the KV heads when there are fewer than tp
/// (a KV head is then replicated over the devices whose query heads share it); the header.
fn bytes_a_device_needs(file: &Path, tp: u64, kv_heads: u64) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: u64 = st
        .tensors()
        .iter()
        .map(|(name, view)| {
            let n = view.data().len() as u64;
            if name.contains("norm") {
                n
            } else if name.contains("k_proj") || name.contains("v_proj") {
                n.div_ceil(tp.min(kv_heads))
            } else {
                n.div_ceil(tp)
            }
        })
        .sum();
    header + tensors
}

#[test]
fn with_tp4_each_device_reads_only_its_quarter_of_an_s3_model_and_trains_as_from_disk() {
    server();
    upload(&fixture("llama_tiny"), "s3://models/llama_tiny_train");
    let dir = temp_dir("s3-train");
    let train_with = |model: &str, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            model,
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--layout",
            "tp=4",
            "--out-dir",
            path(out),
        ];
        args.extend_from_slice(extra);
        let o = ferrotron(&args);
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            metrics_records(out),
        )
    };
    let train = |model: &str, out: &Path| train_with(model, out, &[]);
    let (printed, remote) = train("s3://models/llama_tiny_train", &dir.join("s3"));
    let (_, local) = train(path(&fixture("llama_tiny")), &dir.join("local"));
    // llama_tiny: 4 query heads, 2 KV heads.
    let need = bytes_a_device_needs(&fixture("llama_tiny").join("model.safetensors"), 4, 2);
    let devices = remote[0]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4);
    for (d, device) in devices.iter().enumerate() {
        let r = device["model_bytes_read"].as_u64().unwrap();
        assert!(
            r > 0 && r <= need,
            "device {d} read {r} bytes; it needs at most {need}"
        );
    }
    assert!(printed.contains("model read at start"), "{printed}");
    // The same training, whichever way the model was read.
    for (a, b) in remote.iter().zip(&local) {
        assert_eq!(a["loss"], b["loss"]);
    }
    assert_eq!(
        remote[0]["run"]["initial_val_loss"],
        local[0]["run"]["initial_val_loss"]
    );

    // LoRA: each device reads its own shard of the frozen base as well (the whole base is read
    // only for rank 0's evaluations), and trains as from disk.
    let lora = [
        "--lora-rank",
        "4",
        "--lora-targets",
        "q_proj,o_proj,down_proj",
    ];
    let (_, remote) = train_with("s3://models/llama_tiny_train", &dir.join("lora-s3"), &lora);
    let (_, local) = train_with(path(&fixture("llama_tiny")), &dir.join("lora-local"), &lora);
    for (d, device) in remote[0]["devices"].as_array().unwrap().iter().enumerate() {
        let r = device["model_bytes_read"].as_u64().unwrap();
        assert!(
            r > 0 && r <= need,
            "LoRA: device {d} read {r} bytes of the base; it needs at most {need}"
        );
    }
    for (a, b) in remote.iter().zip(&local) {
        assert_eq!(a["loss"], b["loss"]);
    }
    assert_eq!(
        remote[0]["run"]["initial_val_loss"],
        local[0]["run"]["initial_val_loss"]
    );
}

#[test]
fn plan_and_verify_take_an_s3_model() {
    server();
    upload(&fixture("llama_tiny"), "s3://models/llama_tiny_commands");
    let model = "s3://models/llama_tiny_commands";
    let o = ferrotron(&[
        "plan",
        "--model",
        model,
        "--cluster",
        "this-machine,devices_per_node=2",
        "--seq",
        "16",
        "--global-batch",
        "2",
    ]);
    assert!(o.status.success(), "plan: {}", stderr(&o));
    let o = ferrotron(&["verify", "--model", model, "--layout", "tp=2"]);
    assert!(o.status.success(), "verify: {}", stderr(&o));
}

/// `train` of llama-tiny (common::train_args) with this server's variables.
fn train(out: &Path, steps: &str, extra: &[&str]) -> Output {
    let args = common::train_args(out, steps, extra);
    ferrotron(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn checkpoints_saved_to_s3_verify_and_resume_on_another_layout_as_local_ones_do() {
    // Saved on tp=2, resumed on dp=2,tp=2.
    server();
    let dir = temp_dir("s3-checkpoints");
    let remote = "s3://models/run-checkpoints";
    let local_ck = dir.join("local-checkpoints");
    for (ck, out) in [
        (remote, dir.join("s3")),
        (path(&local_ck), dir.join("local")),
    ] {
        let o = train(
            &out,
            "4",
            &[
                "--layout",
                "tp=2",
                "--checkpoint-every",
                "2",
                "--checkpoint-dir",
                ck,
            ],
        );
        assert!(o.status.success(), "{ck}: {}", stderr(&o));
    }
    // Two complete checkpoints and `latest` on the store.
    let root = Location::parse(remote).unwrap();
    assert_eq!(
        String::from_utf8(root.join("latest").read(100).unwrap())
            .unwrap()
            .trim(),
        "step-000004"
    );
    for step in ["step-000002", "step-000004"] {
        assert!(
            root.join(step).join("manifest.json").exists().unwrap(),
            "{step}"
        );
    }
    let o = ferrotron(&["checkpoint", "inspect", remote]);
    assert!(o.status.success(), "inspect: {}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("checksums OK"));
    // A damaged byte of an array on the store is found (its hash), and named.
    let stored = server().object_file(
        "models",
        "run-checkpoints/step-000002/rank-00001.safetensors",
    );
    let mut bytes = std::fs::read(&stored).unwrap();
    let last = bytes.len() - 5;
    bytes[last] ^= 0x40;
    std::fs::write(&stored, &bytes).unwrap();
    let o = ferrotron(&["checkpoint", "inspect", &format!("{remote}/step-000002")]);
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("rank-00001") && e.contains("corrupt"),
        "{e}"
    );

    // Resumed on another layout, from the store and from disk: the same continuation.
    for (ck, out) in [
        (remote, dir.join("s3")),
        (path(&local_ck), dir.join("local")),
    ] {
        let o = train(
            &out,
            "6",
            &[
                "--layout",
                "dp=2,tp=2",
                "--resume",
                ck,
                "--checkpoint-every",
                "2",
                "--checkpoint-dir",
                ck,
            ],
        );
        assert!(o.status.success(), "resume {ck}: {}", stderr(&o));
    }
    assert_eq!(
        metric_losses(&dir.join("s3")),
        metric_losses(&dir.join("local"))
    );
    assert_eq!(metric_losses(&dir.join("s3")).len(), 6);
    // Each device of the new layout read from the store only the arrays of its tensor-parallel
    // half (by the 256 KiB hash blocks they touch, each checked), the norms whole.
    let records = metrics_records(&dir.join("s3"));
    let params = 4 * records[0]["run"]["parameters"].as_u64().unwrap();
    let resumed = &records[4];
    for d in resumed["devices"].as_array().unwrap() {
        let read = d["model_bytes_read"].as_u64().unwrap();
        assert!(
            read > params / 3 && read < params * 6 / 10,
            "{read} of {params}"
        );
    }
}

#[test]
fn a_checkpoint_directory_on_a_missing_bucket_is_refused_before_training() {
    let dir = temp_dir("s3-no-bucket");
    let o = train(&dir, "2", &["--checkpoint-dir", "s3://no-such-bucket/ck"]);
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("s3://no-such-bucket") && e.contains("does not exist"),
        "{e}"
    );
    assert!(
        !dir.join("metrics.jsonl").exists(),
        "refused before training"
    );
}

#[test]
fn asynchronous_saves_to_s3_commit_every_checkpoint() {
    server();
    let dir = temp_dir("s3-async");
    let url = "s3://models/run-async";
    let o = train(
        &dir,
        "4",
        &[
            "--layout",
            "dp=2",
            "--checkpoint-every",
            "1",
            "--checkpoint-async",
            "--checkpoint-dir",
            url,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let root = Location::parse(url).unwrap();
    let latest = root.join("latest").read(100).unwrap();
    assert_eq!(String::from_utf8(latest).unwrap().trim(), "step-000004");
    for step in 1..=4 {
        let at = format!("{url}/step-{step:06}");
        let o = ferrotron(&["checkpoint", "inspect", &at]);
        assert!(o.status.success(), "{at}: {}", stderr(&o));
    }
}

#[test]
fn checkpoint_import_reshard_export_and_inspect_take_s3_at_both_ends() {
    server();
    upload(&fixture("gpt2_tiny"), "s3://models/gpt2_tiny");
    let dir = temp_dir("s3-tools");
    let run = |args: &[&str]| {
        let o = ferrotron(args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    run(&[
        "checkpoint",
        "import",
        "s3://models/gpt2_tiny",
        "--out",
        "s3://models/tools/imported",
        "--layout",
        "tp=2,pp=2",
    ]);
    run(&[
        "checkpoint",
        "reshard",
        "s3://models/tools/imported",
        "--layout",
        "dp=2,zero=3",
        "--out",
        "s3://models/tools/resharded",
    ]);
    let text = run(&["checkpoint", "inspect", "s3://models/tools/resharded"]);
    assert!(
        text.contains("zero=3") && text.contains("checksums OK"),
        "{text}"
    );
    run(&[
        "checkpoint",
        "export",
        "s3://models/tools/resharded",
        "--hf",
        "s3://models/tools/exported",
    ]);
    // The exported model, fetched: every tensor as it went in, and the tokenizer with it.
    let exported = Location::parse("s3://models/tools/exported").unwrap();
    let local = dir.join("exported");
    std::fs::create_dir_all(&local).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::write(local.join(f), exported.join(f).read(1 << 30).unwrap()).unwrap();
    }
    let want = read_f32(&fixture("gpt2_tiny").join("model.safetensors"));
    let got = read_f32(&local.join("model.safetensors"));
    assert_eq!(want.len(), got.len());
    for (name, (shape, values)) in &got {
        assert_eq!(&want[name].0, shape, "{name}");
        assert!(&want[name].1 == values, "{name} changed on the way");
    }
    assert_eq!(
        std::fs::read(local.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture("gpt2_tiny").join("tokenizer.json")).unwrap()
    );
    // Nothing is written over what the tool did not write.
    let o = ferrotron(&[
        "checkpoint",
        "import",
        "s3://models/gpt2_tiny",
        "--out",
        "s3://models/tools/imported",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("--overwrite"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn adapters_on_s3_give_the_local_adapters_gradients_bit_for_bit() {
    server();
    upload(&fixture("llama_tiny"), "s3://models/llama_tiny_base");
    upload(
        &fixture("lora").join("llama_tiny"),
        "s3://models/llama_tiny_adapter",
    );
    let dir = temp_dir("s3-adapter");
    let refs = fixture("lora")
        .join("llama_tiny")
        .join("lora_reference.safetensors");
    let grads = |model: &str, adapter: &str, out: &Path| {
        let o = ferrotron(&[
            "grads",
            "--model",
            model,
            "--adapter",
            adapter,
            "--tokens",
            path(&refs),
            "--layout",
            "tp=2",
            "--out",
            path(out),
        ]);
        assert!(o.status.success(), "{adapter}: {}", stderr(&o));
        std::fs::read(out).unwrap()
    };
    let local = grads(
        path(&fixture("llama_tiny")),
        path(&fixture("lora").join("llama_tiny")),
        &dir.join("local.safetensors"),
    );
    let remote = grads(
        "s3://models/llama_tiny_base",
        "s3://models/llama_tiny_adapter",
        &dir.join("s3.safetensors"),
    );
    assert!(
        local == remote,
        "the adapters' gradients differ when read from s3://"
    );
}

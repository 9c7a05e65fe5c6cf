//! Sharded checkpoints: resuming on the same layout is bitwise the uninterrupted run; resuming on
//! another layout reshards parameters and Adam moments and continues within f32 tolerance; damaged
//! or foreign checkpoints are refused naming the file; Hugging Face import/export round-trips.

mod common;

use common::*;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::ModelConfig;
use ferrotron_engine::checkpoint::{self, Checkpoint, Kind, MANIFEST};
use ferrotron_engine::data;
use ferrotron_engine::hf::{self, StorageDtype};
use ferrotron_engine::runtime::{train, TrainConfig};
use ferrotron_engine::transformer::ParamStore;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// f32 relative tolerance after five AdamW steps on two layouts (different reduction orders).
const TOL: f64 = 1e-5;

/// An 8-layer variant of the tiny Llama (so that pp=4 with two chunks per device fits), saved as a
/// Hugging Face directory with the fixture's tokenizer, and a small corpus.
fn model_and_data() -> &'static (PathBuf, PathBuf) {
    static SETUP: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = temp_dir("model");
        let cfg = ModelConfig::llama(512, 64, 176, 8, 4, 2, 256, 10000.0);
        let params = ParamStore::init_random(&cfg, 5);
        hf::save_model(&dir, &cfg, &params, StorageDtype::F32).unwrap();
        std::fs::copy(
            fixture("llama_tiny").join("tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        let corpus = dir.join("manual.txt");
        std::fs::write(&corpus, &data::BUILTIN_CORPUS[..60_000]).unwrap();
        (dir, corpus)
    })
}

fn config(tag: &str, layout: &str) -> TrainConfig {
    let (model, corpus) = model_and_data();
    {
        let mut c = TrainConfig::default();
        c.input.model = model.display().to_string();
        c.input.data = corpus.display().to_string();
        c.optimizer.steps = 5;
        c.optimizer.batch_size = 8;
        c.input.seq_len = 32;
        c.optimizer.lr = 3e-3;
        c.optimizer.min_lr = 3e-4;
        c.optimizer.warmup_steps = 2;
        // See data_parallel.rs: with eps = 1e-8 Adam turns f32 rounding of near-zero gradients into
        // 1e-5-sized parameter differences between layouts; 1e-6 keeps updates smooth.
        c.optimizer.adam_eps = 1e-6;
        c.logging.eval_every = 0;
        c.logging.eval_batches = 1;
        c.checkpointing.checkpoint_every = 3;
        c.parallelism.layout = layout.parse().unwrap();
        c.checkpointing.out_dir = temp_dir(tag);
        c
    }
}

/// A run's losses by step, and its final parameters (from its last checkpoint).
struct Run {
    losses: Vec<(usize, f64)>,
    params: ParamStore,
    out: PathBuf,
}

fn run(cfg: &TrainConfig) -> Run {
    let mut losses = Vec::new();
    train(cfg, &mut |r| losses.push((r.step, r.loss))).unwrap();
    let root = cfg.checkpointing.out_dir.join("checkpoints");
    let (_, params) = checkpoint::load_params(&root).unwrap();
    Run {
        losses,
        params,
        out: cfg.checkpointing.out_dir.clone(),
    }
}

fn step3(r: &Run) -> PathBuf {
    r.out.join("checkpoints").join("step-000003")
}

fn assert_close(got: &Run, want: &Run, what: &str) {
    assert_eq!(got.losses.len(), 2, "{what}: steps 4 and 5");
    for (g, w) in got.losses.iter().zip(&want.losses[3..]) {
        assert_eq!(g.0, w.0);
        let e = (g.1 - w.1).abs() / w.1.abs();
        assert!(
            e <= TOL,
            "{what}: step {} loss {} vs {} ({e:e})",
            g.0,
            g.1,
            w.1
        );
    }
    for ((s, a), b) in got
        .params
        .specs
        .iter()
        .zip(&got.params.tensors)
        .zip(&want.params.tensors)
    {
        let e = rel_err(a, b);
        assert!(e <= TOL, "{what}: {} after step 5 off by {e:e}", s.name);
    }
}

fn assert_bitwise(got: &Run, want: &Run, what: &str) {
    let bits = |l: &[(usize, f64)]| l.iter().map(|(s, x)| (*s, x.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&got.losses), bits(&want.losses[3..]), "{what}: losses");
    for ((s, a), b) in got
        .params
        .specs
        .iter()
        .zip(&got.params.tensors)
        .zip(&want.params.tensors)
    {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: {} differs after resuming",
            s.name
        );
    }
}

/// Both directions of a pair of layouts, and each resumed on itself (bitwise).
fn check_pair(tag: &str, a: &str, b: &str) {
    check_pair_with(&config, tag, a, b)
}

/// [`check_pair`] with the runs `config` sets up.
fn check_pair_with(config: &dyn Fn(&str, &str) -> TrainConfig, tag: &str, a: &str, b: &str) {
    let full_a = run(&config(&format!("{tag}-a"), a));
    let full_b = run(&config(&format!("{tag}-b"), b));
    for (from, to, full_to, dir) in [(&full_a, b, &full_b, "ab"), (&full_b, a, &full_a, "ba")] {
        let resumed = run(&{
            let mut c = config(&format!("{tag}-{dir}"), to);
            c.checkpointing.resume = Some(step3(from));
            c
        });
        let (from_layout, _) = if dir == "ab" { (a, b) } else { (b, a) };
        assert_close(&resumed, full_to, &format!("`{from_layout}` → `{to}`"));
    }
    for (full, l) in [(&full_a, a), (&full_b, b)] {
        let resumed = run(&{
            let mut c = config(&format!("{tag}-same"), l);
            c.checkpointing.resume = Some(step3(full));
            c
        });
        assert_bitwise(&resumed, full, &format!("`{l}` → itself"));
    }
}

/// A mixture of experts whose experts are divided over pairs of replicas, ZeRO-3 sharding them
/// over the replicas holding the same ones, resumed on one device (every expert whole) and back.
/// Four sequences per step, one per replica (or one micro-batch of four): the same function.
#[test]
fn resume_experts_split_over_replicas_on_one_device_and_back() {
    check_pair_with(&mixtral_tiny, "moe", "dp=4,ep=2,zero=3", "mbs=4");
}

/// `mixtral-tiny`, four sequences a step, on `layout`.
fn mixtral_tiny(tag: &str, layout: &str) -> TrainConfig {
    let mut c = config(tag, layout);
    c.input.model = "mixtral-tiny".into();
    c.optimizer.batch_size = 4;
    c
}

/// Each expert whole on one device of a tensor-parallel pair (`etp=1`), the experts over
/// replicas too, resumed with each expert's columns over the pair instead, and back.
#[test]
fn resume_whole_experts_over_tp_on_column_split_experts_and_back() {
    check_pair_with(
        &mixtral_tiny,
        "moe-etp",
        "dp=2,ep=2,tp=2,etp=1,mbs=2,zero=3",
        "tp=2,mbs=4",
    );
}

#[test]
fn resume_3d_on_one_device_and_back() {
    check_pair("3d", "dp=2,tp=2,pp=2", "");
}

#[test]
fn resume_context_parallel_zero1_on_tp2_and_back() {
    // ZeRO-1 shards over the dp × cp replicas: 4 shards, resharded onto 2 tensor-parallel halves.
    check_pair("cp", "dp=2,cp=2,zero=1", "tp=2");
}

#[test]
fn resume_tp2_on_tp4_and_back() {
    check_pair("tp", "tp=2", "tp=4");
}

#[test]
fn resume_pp2_on_interleaved_pp4_and_back() {
    check_pair("pp", "pp=2", "pp=4,vpp=2,schedule=interleaved");
}

#[test]
fn resume_zero1_dp4_on_zero3_dp2_tp2_and_back() {
    check_pair("zero", "dp=4,zero=1", "dp=2,tp=2,zero=3");
}

#[test]
fn mixed_precision_resumes_bitwise_with_its_loss_scaler() {
    let cfg = |tag: &str| {
        let mut c = config(tag, "dp=2,tp=2,zero=2");
        c.numerics.precision = ferrotron_core::precision::MixedPrecision::Fp16;
        c.numerics.loss_scale = 1024.0;
        c.numerics.loss_scale_window = 2;
        c
    };
    let full = run(&cfg("fp16-full"));
    let ck = Checkpoint::open(&step3(&full)).unwrap();
    let scaler = ck
        .manifest
        .loss_scaler
        .expect("fp16 records its loss scaler");
    assert_eq!((scaler.scale, scaler.clean_steps), (2048.0, 1));
    let resumed = run(&{
        let mut c = cfg("fp16-resumed");
        c.checkpointing.resume = Some(step3(&full));
        c
    });
    assert_bitwise(&resumed, &full, "fp16 dp=2,tp=2,zero=2");
}

#[test]
fn offline_reshard_equals_resharding_on_resume() {
    let full = run(&config("reshard-src", "dp=2,tp=2,pp=2,zero=1"));
    let target = LayoutSpec::parse("tp=4,zero=0").unwrap().layout;
    let out = temp_dir("reshard-out");
    let written = checkpoint::reshard(&step3(&full), &target, &out, false).unwrap();
    let ck = Checkpoint::open(&out).unwrap();
    assert_eq!(ck.dir, written);
    assert_eq!(ck.manifest.layout, target.to_string());
    assert_eq!(ck.manifest.world_size, 4);
    assert_eq!(ck.manifest.step, 3);
    // Every tensor and moment is the same whole, whichever layout holds it.
    let src = Checkpoint::open(&step3(&full)).unwrap();
    for spec in ck.manifest.model.param_specs() {
        for kind in Kind::ALL {
            let (a, b) = (
                ck.read_whole(&spec.name, kind).unwrap(),
                src.read_whole(&spec.name, kind).unwrap(),
            );
            assert!(a == b, "{} {kind:?} changed by resharding", spec.name);
        }
    }
    let via_offline = run(&{
        let mut c = config("reshard-offline", "tp=4");
        c.checkpointing.resume = Some(out.clone());
        c
    });
    let via_resume = run(&{
        let mut c = config("reshard-online", "tp=4");
        c.checkpointing.resume = Some(step3(&full));
        c
    });
    assert_bitwise(
        &via_offline,
        &Run {
            losses: [vec![(0, 0.0); 3], via_resume.losses.clone()].concat(),
            ..via_resume
        },
        "offline reshard",
    );
}

/// A copy of a run's step-3 checkpoint to damage.
fn damaged_copy(src: &Path, tag: &str) -> PathBuf {
    let dst = temp_dir(tag);
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_naming_the_file() {
    let full = run(&{
        let mut c = config("damage-src", "dp=2,tp=2");
        c.optimizer.steps = 3;
        c
    });
    let good = step3(&full);
    Checkpoint::open(&good).unwrap();

    // A flipped byte.
    let d = damaged_copy(&good, "flip");
    let f = d.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x01;
    std::fs::write(&f, bytes).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("checksum mismatch"),
        "{e}"
    );

    // A missing rank file (a replica's, which holds nothing under ZeRO-0, but is still required).
    let d = damaged_copy(&good, "missing");
    std::fs::remove_file(d.join("rank-00003.safetensors")).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("rank-00003.safetensors") && e.contains("missing"),
        "{e}"
    );

    // A manifest naming a tensor that no file holds.
    let d = damaged_copy(&good, "phantom");
    let path = d.join(MANIFEST);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let file = m["tensors"][3]["pieces"][0]["file"]
        .as_str()
        .unwrap()
        .to_string();
    m["tensors"][3]["pieces"][0]["key"] = "param/model.layers.99.mlp.up_proj.weight".into();
    write_sealed(&path, m);
    let e = open_err(&d);
    assert!(e.contains(&file) && e.contains("layers.99"), "{e}");

    // A manifest whose piece lies outside its tensor.
    let d = damaged_copy(&good, "outside");
    let path = d.join(MANIFEST);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let name = m["tensors"][3]["name"].as_str().unwrap().to_string();
    m["tensors"][3]["pieces"][0]["tp_slice"]["ranges"] = serde_json::json!([[0, 9999]]);
    write_sealed(&path, m);
    let e = open_err(&d);
    assert!(
        e.contains(MANIFEST) && e.contains(&name) && e.contains("outside"),
        "{e}"
    );

    // A manifest whose pieces leave part of a tensor uncovered.
    let d = damaged_copy(&good, "uncovered");
    let path = d.join(MANIFEST);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let name = m["tensors"][2]["name"].as_str().unwrap().to_string();
    m["tensors"][2]["pieces"]
        .as_array_mut()
        .unwrap()
        .retain(|p| p["kind"] != "param" || p["file"] != "rank-00000.safetensors");
    write_sealed(&path, m);
    let ck = Checkpoint::open(&d).unwrap();
    let e = ck.params().unwrap_err().to_string();
    assert!(
        e.contains(MANIFEST) && e.contains(&name) && e.contains("no file holds"),
        "{e}"
    );

    // A manifest naming a file outside the checkpoint: refused, though the file checks out.
    let d = damaged_copy(&good, "escape");
    let outside = d.parent().unwrap().join("escaped-rank-00001.safetensors");
    std::fs::rename(d.join("rank-00001.safetensors"), &outside).unwrap();
    let path = d.join(MANIFEST);
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "\"rank-00001.safetensors\"",
        "\"../escaped-rank-00001.safetensors\"",
    );
    write_sealed(&path, serde_json::from_str(&text).unwrap());
    let e = open_err(&d);
    assert!(
        e.contains(MANIFEST)
            && e.contains("../escaped-rank-00001")
            && e.contains("must lie inside"),
        "{e}"
    );
    let _ = std::fs::remove_file(outside);

    // A `latest` that points out of its directory.
    let root = temp_dir("latest-escape");
    std::fs::write(
        root.join(ferrotron_engine::checkpoint::LATEST),
        format!("../../{}\n", good.strip_prefix("/").unwrap().display()),
    )
    .unwrap();
    let e = open_err(&root);
    assert!(e.contains("latest") && e.contains("must lie inside"), "{e}");

    // The run's tokenizer travels with the checkpoint, checksummed.
    let d = damaged_copy(&good, "tokenizer");
    assert!(d.join("tokenizer.json").exists());
    std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
    let e = open_err(&d);
    assert!(e.contains("tokenizer.json") && e.contains("corrupt"), "{e}");

    // A corrupt manifest.
    let d = damaged_copy(&good, "badjson");
    std::fs::write(d.join(MANIFEST), "{\"format\": ").unwrap();
    let e = open_err(&d);
    assert!(
        e.contains(MANIFEST) && e.contains("not a valid manifest"),
        "{e}"
    );

    // A manifest edited by hand (its step): the checksum catches it, in `inspect` too.
    let d = damaged_copy(&good, "edited");
    let path = d.join(MANIFEST);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["step"] = (m["step"].as_u64().unwrap() + 1).into();
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains(MANIFEST) && e.contains("checksum does not match"),
        "{e}"
    );
    let e = checkpoint::inspect(&d).unwrap_err().to_string();
    assert!(e.contains("checksum does not match"), "{e}");

    // A checkpoint of another model: resuming the GPT-2 fixture from it.
    let e = train(
        &{
            let mut c = config("foreign", "");
            c.input.model = fixture("gpt2_tiny").display().to_string();
            c.checkpointing.resume = Some(good.clone());
            c
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(MANIFEST) && e.contains("another model"), "{e}");

    // Nothing left to train.
    let e = train(
        &{
            let mut c = config("done", "");
            c.optimizer.steps = 3;
            c.checkpointing.resume = Some(good);
            c
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("nothing is left to train"), "{e}");
}

#[test]
fn hugging_face_import_export_round_trips_byte_for_byte() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let src = fixture(model);
        let root = temp_dir(&format!("import-{model}"));
        let layout = LayoutSpec::parse("dp=2,tp=2,pp=2,zero=3").unwrap().layout;
        checkpoint::import_hf(&src, &layout, &root, false).unwrap();
        let ck = Checkpoint::open(&root).unwrap();
        assert_eq!(ck.manifest.step, 0);
        assert_eq!(ck.manifest.optimizer.step, 0);
        let out = temp_dir(&format!("export-{model}"));
        checkpoint::export_hf(&root, &out, StorageDtype::F32, false).unwrap();
        let read = |p: &Path| std::fs::read(p.join("model.safetensors")).unwrap();
        let (a, b) = (read(&src), read(&out));
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&a).unwrap(),
            safetensors::SafeTensors::deserialize(&b).unwrap(),
        );
        let (cfg, _) = hf::load_model(&out).unwrap();
        for spec in cfg.param_specs() {
            let (x, y) = (a.tensor(&spec.name).unwrap(), b.tensor(&spec.name).unwrap());
            assert_eq!(x.shape(), y.shape(), "{model} {}", spec.name);
            assert!(x.data() == y.data(), "{model} {} bytes differ", spec.name);
        }
    }
}

#[test]
fn training_from_an_imported_model_equals_training_from_its_directory() {
    let (model, _) = model_and_data();
    let root = temp_dir("import-train");
    checkpoint::import_hf(
        model,
        &LayoutSpec::parse("tp=2").unwrap().layout,
        &root,
        false,
    )
    .unwrap();
    let direct = run(&{
        let mut c = config("import-direct", "dp=2");
        c.checkpointing.checkpoint_every = 0;
        c
    });
    let imported = run(&{
        let mut c = config("import-resumed", "dp=2");
        c.checkpointing.checkpoint_every = 0;
        c.checkpointing.resume = Some(root);
        c
    });
    assert_eq!(imported.losses.len(), 5);
    assert_bitwise(
        &imported,
        &Run {
            losses: [vec![(0, 0.0); 3], direct.losses.clone()].concat(),
            ..direct
        },
        "import as step 0",
    );
}

/// `m` written as the manifest at `path`, its checksum recomputed: a deliberate edit, which the
/// checks behind the checksum must still catch.
fn write_sealed(path: &std::path::Path, m: serde_json::Value) {
    let mut m: checkpoint::Manifest = serde_json::from_value(m).unwrap();
    m.checksum = Some(m.digest());
    std::fs::write(path, serde_json::to_string(&m).unwrap()).unwrap();
}

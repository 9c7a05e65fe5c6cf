//! The parsers of untrusted input, fuzzed: every generated input must end in `Ok` or an error
//! within a time and memory bound — no panic, no hang, no allocation sized by the input.
//!
//! Inputs are mutations of valid seeds (bytes flipped, deleted, duplicated, spliced from another
//! seed, and values replaced by ones that break parsers: 0, -1, huge, NaN, `..`, …), drawn from a
//! fixed-seed generator so a failure reproduces. Whatever parses is then used as the program
//! would: a layout is evaluated by the planner, a model config planned, a checkpoint read, a
//! token file checked against a model.

mod common;

use common::{ferrotron, fixture, stderr, temp_dir};
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{self, PlanInput, PlanModel};
use ferrotron_core::topology::Cluster;
use ferrotron_engine::{checkpoint, data, hf, memory, runtime::TrainConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// No input may take longer than this to end in `Ok` or an error.
const TIME_BOUND: Duration = Duration::from_secs(5);
/// Nor make the heap grow by more than this (the inputs are a few kB; the models tiny).
const MEMORY_BOUND: u64 = 256 << 20;

/// Values that break parsers, spliced in place of a run of bytes.
const NASTY: &[&str] = &[
    "0",
    "-1",
    "-0",
    "1",
    "2",
    "3",
    "7",
    "1e30",
    "1e308",
    "-1e308",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "0.5",
    "1.0000001",
    "",
    " ",
    ",",
    "=",
    ",,",
    "==",
    "..",
    "../..",
    "/",
    "/etc/passwd",
    "\"",
    "\\",
    "{}",
    "[]",
    "null",
    "true",
    "false",
    "[1,2]",
    "[[0,1],[1,0]]",
    "\u{0}",
    "é",
    "auto",
];

/// A mutation of one of `seeds`.
fn mutate(seeds: &[Vec<u8>], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut v = seeds[rng.gen_range(0..seeds.len())].clone();
    for _ in 0..rng.gen_range(1..=4) {
        let n = v.len();
        let at = if n == 0 { 0 } else { rng.gen_range(0..n) };
        let len = if n == 0 {
            0
        } else {
            rng.gen_range(0..=(n - at).min(8))
        };
        match rng.gen_range(0..7) {
            0 if n > 0 => v[at] ^= 1 << rng.gen_range(0..8),
            1 if n > 0 => v[at] = rng.gen(),
            2 => {
                v.drain(at..at + len);
            }
            3 => {
                let copy = v[at..at + len].to_vec();
                v.splice(at..at, copy);
            }
            4 => {
                let other = &seeds[rng.gen_range(0..seeds.len())];
                let from = rng.gen_range(0..other.len().max(1));
                let take = rng.gen_range(0..=(other.len() - from.min(other.len())).min(32));
                let piece = other[from.min(other.len())..from.min(other.len()) + take].to_vec();
                v.splice(at..at + len, piece);
            }
            5 => v.truncate(at),
            _ => {
                let nasty = NASTY[rng.gen_range(0..NASTY.len())].as_bytes().to_vec();
                // Replace a run of digits or letters (a value, most often) when there is one here.
                let end = (at..n)
                    .find(|&i| !v[i].is_ascii_alphanumeric() && v[i] != b'.' && v[i] != b'-')
                    .unwrap_or(n);
                v.splice(at..end.max(at), nasty);
            }
        }
    }
    v
}

/// How an input's structure is known to the generator, so that half the mutations keep it and
/// reach past the first parse: a `key=value,…` spec, JSON, TOML, or a safetensors file whose
/// header (JSON) is mutated and its length prefix kept right.
#[derive(Clone, Copy)]
enum Form {
    KeyValues,
    Json,
    Toml,
    SafetensorsHeader,
}

/// A JSON value that breaks parsers.
fn nasty_json(rng: &mut ChaCha8Rng) -> serde_json::Value {
    use serde_json::json;
    let pick = [
        json!(0),
        json!(-1),
        json!(1),
        json!(2),
        json!(1e30),
        json!(-1e308),
        json!(u64::MAX),
        json!(4294967296u64),
        json!(0.5),
        json!(""),
        json!("../../outside"),
        json!("/etc/passwd"),
        json!("nan"),
        json!(null),
        json!(true),
        json!([]),
        json!({}),
        json!([0]),
        json!([1e20, 3]),
        json!([u64::MAX, u64::MAX]),
        json!("x".repeat(100)),
    ];
    pick[rng.gen_range(0..pick.len())].clone()
}

/// Every node of `v`, as JSON pointers.
fn pointers(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => m.iter().for_each(|(k, c)| {
            pointers(
                c,
                format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                out,
            )
        }),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, c)| pointers(c, format!("{at}/{i}"), out)),
        _ => {}
    }
    out.push(at);
}

/// 1–3 nodes of `v` replaced by a nasty value, nudged (a number ±1, doubled, negated) or removed.
fn mutate_json_value(v: &mut serde_json::Value, rng: &mut ChaCha8Rng) {
    for _ in 0..rng.gen_range(1..=3) {
        let mut all = Vec::new();
        pointers(v, String::new(), &mut all);
        let at = all[rng.gen_range(0..all.len())].clone();
        let Some(node) = v.pointer_mut(&at) else {
            continue;
        };
        match (rng.gen_range(0..3), node.as_f64()) {
            (0, Some(x)) => {
                let nudged = [x + 1.0, x - 1.0, x * 2.0, -x, x / 2.0][rng.gen_range(0..5)];
                *node = match serde_json::Number::from_f64(nudged) {
                    Some(n) if nudged.fract() != 0.0 || nudged.abs() > 9e15 => {
                        serde_json::Value::Number(n)
                    }
                    _ => serde_json::json!(nudged as i64),
                };
            }
            (1, _) if !at.is_empty() => {
                let (parent, key) = at.rsplit_once('/').expect("a child pointer");
                match v.pointer_mut(parent) {
                    Some(serde_json::Value::Object(m)) => {
                        m.remove(&key.replace("~1", "/").replace("~0", "~"));
                    }
                    Some(serde_json::Value::Array(a)) => {
                        let i: usize = key.parse().expect("an index");
                        a.remove(i);
                    }
                    _ => {}
                }
            }
            _ => *node = nasty_json(rng),
        }
    }
}

/// A structure-keeping mutation of `seed`, in its `form`.
fn mutate_form(form: Form, seed: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    match form {
        Form::KeyValues => {
            let text = String::from_utf8_lossy(seed);
            let mut items: Vec<String> = text.split(',').map(str::to_string).collect();
            for _ in 0..rng.gen_range(1..=3) {
                let k = rng.gen_range(0..items.len());
                match rng.gen_range(0..4) {
                    0 => {
                        let key = items[k].split('=').next().unwrap_or("").to_string();
                        items[k] = format!("{key}={}", NASTY[rng.gen_range(0..NASTY.len())]);
                    }
                    1 if items.len() > 1 => {
                        items.remove(k);
                    }
                    2 => {
                        let copy = items[k].clone();
                        items.push(copy);
                    }
                    _ => {
                        let key = items[k].split('=').next().unwrap_or("").to_string();
                        let n: u64 = [0, 1, 2, 3, 5, 8, 64, 1000, 1 << 20, 1 << 40, u64::MAX]
                            [rng.gen_range(0..11)];
                        items[k] = format!("{key}={n}");
                    }
                }
            }
            items.join(",").into_bytes()
        }
        Form::Json => {
            let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(seed) else {
                return seed.to_vec();
            };
            mutate_json_value(&mut v, rng);
            serde_json::to_vec_pretty(&v).expect("serialises")
        }
        Form::Toml => {
            let Ok(t) = toml::from_str::<toml::Table>(&String::from_utf8_lossy(seed)) else {
                return seed.to_vec();
            };
            let mut v = serde_json::to_value(t).expect("TOML is JSON");
            mutate_json_value(&mut v, rng);
            // Nulls have no TOML form: the key is left out instead.
            if let serde_json::Value::Object(m) = &mut v {
                m.retain(|_, x| !x.is_null());
            }
            match toml::to_string(&v) {
                Ok(t) => t.into_bytes(),
                Err(_) => seed.to_vec(),
            }
        }
        Form::SafetensorsHeader => {
            let n = u64::from_le_bytes(seed[..8].try_into().expect("8 bytes")) as usize;
            let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&seed[8..8 + n]) else {
                return seed.to_vec();
            };
            mutate_json_value(&mut v, rng);
            let header = serde_json::to_vec(&v).expect("serialises");
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&header);
            out.extend_from_slice(&seed[8 + n..]);
            out
        }
    }
}

/// A number from the environment: `FERROTRON_FUZZ_SEED` picks another sequence of inputs and
/// `FERROTRON_FUZZ_SCALE` multiplies their count, for longer hunts than CI's.
fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How a target ends: `Ok` when the input was accepted and used to the end, otherwise the error
/// message the user would read.
type Outcome = Result<(), String>;

fn said(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The longest refusal that still reads as a clear error: a dozen lines (the planner's "no layout"
/// lists up to 12 cuts). It may quote a value, not echo the input or grow with the sizes in it.
const MAX_ERROR_CHARS: usize = 2500;

/// An error a user cannot act on: empty, or so long that it must be echoing the input.
fn unclear(msg: &str) -> bool {
    msg.trim().is_empty() || msg.chars().count() > MAX_ERROR_CHARS
}

/// What went wrong with one input.
struct Failure {
    input: Vec<u8>,
    what: String,
}

/// Feeds `iterations` mutations of `seeds` (and the seeds themselves) to `target`, which accepts
/// the input (parsed and used to the end) or refuses it with a message, on a worker
/// thread that counts its heap as device `account`; returns how many inputs were tried. Fails on
/// a panic, on an input that takes longer than [`TIME_BOUND`] (a hang), or one whose heap peak is
/// over [`MEMORY_BOUND`].
fn fuzz(
    name: &str,
    account: usize,
    form: Form,
    seeds: Vec<Vec<u8>>,
    iterations: usize,
    target: impl Fn(&[u8]) -> Outcome + Send + Sync + 'static,
) -> usize {
    let current: Arc<Mutex<Vec<u8>>> = Arc::default();
    let (done_tx, done_rx) = mpsc::channel::<Result<bool, Failure>>();
    let worker_input = current.clone();
    let worker = std::thread::spawn(move || {
        memory::set_device(account);
        let mut rng = ChaCha8Rng::seed_from_u64(
            0x5eed ^ account as u64 ^ env_number("FERROTRON_FUZZ_SEED", 0) << 8,
        );
        let total = seeds.len() + iterations * env_number("FERROTRON_FUZZ_SCALE", 1) as usize;
        for k in 0..total {
            let input = if k < seeds.len() {
                seeds[k].clone()
            } else if rng.gen_bool(0.5) {
                mutate(&seeds, &mut rng)
            } else {
                let seed = &seeds[rng.gen_range(0..seeds.len())];
                mutate_form(form, seed, &mut rng)
            };
            *worker_input.lock().unwrap() = input.clone();
            memory::reset_peaks(account);
            let base = memory::device_memory(account).peak_total;
            let started = Instant::now();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target(&input)));
            let took = started.elapsed();
            let grew = memory::device_memory(account)
                .peak_total
                .saturating_sub(base);
            let failure = match &outcome {
                Err(p) => Some(format!(
                    "panicked: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
                Ok(_) if took > TIME_BOUND => Some(format!("took {took:?}")),
                Ok(_) if grew > MEMORY_BOUND => {
                    Some(format!("grew the heap by {}", memory::format_bytes(grew)))
                }
                Ok(Err(msg)) if unclear(msg) => Some(format!("was refused unclearly: {msg:?}")),
                Ok(_) => None,
            };
            let failed = failure.is_some();
            let report = match failure {
                Some(what) => Err(Failure { input, what }),
                None => Ok(matches!(outcome, Ok(Ok(())))),
            };
            if done_tx.send(report).is_err() || failed {
                break;
            }
        }
    });
    let (mut tried, mut accepted) = (0, 0);
    loop {
        match done_rx.recv_timeout(TIME_BOUND * 4) {
            Ok(Ok(ok)) => {
                tried += 1;
                accepted += usize::from(ok);
            }
            Ok(Err(f)) => panic!("{name}: input {tried} {}: {}", f.what, shown(&f.input)),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "{name}: input {tried} hangs: {}",
                shown(&current.lock().unwrap())
            ),
        }
    }
    worker.join().expect("the worker catches every panic");
    eprintln!(
        "{name}: {tried} inputs ({accepted} accepted, the rest refused with an error): no panic, none over {TIME_BOUND:?} or {}",
        memory::format_bytes(MEMORY_BOUND)
    );
    tried
}

/// An input as a person reads it in a failure message: the first 2,000 characters.
fn shown(bytes: &[u8]) -> String {
    let t = String::from_utf8_lossy(bytes);
    let cut: String = t.chars().take(2000).collect();
    format!(
        "{cut:?}{}",
        if t.chars().count() > 2000 { " …" } else { "" }
    )
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn seeds(items: &[&str]) -> Vec<Vec<u8>> {
    items.iter().map(|s| s.as_bytes().to_vec()).collect()
}

/// The planner's question about `model` on `cluster`.
fn input(model: PlanModel, cluster: Cluster) -> PlanInput {
    PlanInput::new(model, cluster, 128, 16)
}

fn small_model() -> PlanModel {
    PlanModel::parse("llama-small").unwrap()
}

#[test]
fn layout_strings() {
    let n = fuzz(
        "layout strings",
        40,
        Form::KeyValues,
        seeds(&[
            "dp=2,tp=2,pp=2,zero=1,mbs=2",
            "dp=1,tp=4,pp=1,sp=true,recompute=selective",
            "pp=4,vpp=2,schedule=interleaved,mbs=1",
            "pp=2,schedule=zbh1,recompute=full",
            "dp=8,zero=3",
            "tp=auto,pp=auto",
            "auto",
            "dp=2,cp=2,tp=2,zero=1",
            "cp=4,cp_comm=a2a,mbs=1",
            "cp=8,cp_comm=ring,pp=1",
        ]),
        6000,
        |b| {
            let spec = LayoutSpec::parse(&text(b)).map_err(said)?;
            let cluster = Cluster::parse("this-machine,nodes=1,devices_per_node=8").unwrap();
            let input = input(small_model(), cluster);
            if spec.auto_keys.is_empty() {
                plan::evaluate(&input, &spec.layout).map_err(said)?;
            }
            Ok(())
        },
    );
    assert!(n > 6000);
}

#[test]
fn cluster_specs() {
    let n = fuzz(
        "cluster specs",
        41,
        Form::KeyValues,
        seeds(&[
            "dgx-a100-80g,nodes=2",
            "dgx-h100-80g",
            "this-machine",
            "nodes=2,devices_per_node=4,memory_gib=24,peak_tflops=100,intra_gbs=100,inter_gbs=10",
            "nodes=1,devices_per_node=8,memory_gib=80,peak_tflops=312,intra_gbs=300,inter_gbs=25,intra_latency_us=5,inter_latency_us=10,gemm_efficiency=0.6,gemm_half_width=500,link_efficiency=0.8,dp_overlap=0.5",
        ]),
        5000,
        |b| {
            let cluster = Cluster::parse(&text(b)).map_err(said)?;
            let input = input(small_model(), cluster);
            plan::evaluate(&input, &LayoutSpec::parse("dp=1").unwrap().layout).map_err(said)?;
            // A search of a huge cluster is slow by nature, not by the input's fault.
            if input.cluster.world_size() <= 4096 {
                plan::search(&input).map_err(said)?;
            }
            Ok(())
        },
    );
    assert!(n > 5000);
}

#[test]
fn model_specs() {
    let n = fuzz(
        "model specs",
        42,
        Form::KeyValues,
        seeds(&[
            "arch=gpt,layers=96,hidden=12288,heads=96,kv_heads=96,ffn=49152,vocab=51200,positions=2048",
            "arch=llama,layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256",
            "params=7.5e9",
            "llama2-70b",
            "llama-small",
        ]),
        5000,
        |b| {
            let model = PlanModel::parse(&text(b)).map_err(said)?;
            let cluster = Cluster::parse("dgx-a100-80g,nodes=8").unwrap();
            let layout = LayoutSpec::parse("dp=8,tp=8").unwrap().layout;
            plan::evaluate(&input(model, cluster), &layout).map_err(said)?;
            Ok(())
        },
    );
    assert!(n > 5000);
}

#[test]
fn model_config_json() {
    let configs: Vec<Vec<u8>> = ["llama_tiny", "gpt2_tiny"]
        .iter()
        .map(|m| std::fs::read(fixture(m).join("config.json")).unwrap())
        .collect();
    let n = fuzz("config.json", 43, Form::Json, configs, 5000, |b| {
        let cfg = ModelConfig::from_hf_json(&text(b), Path::new("config.json")).map_err(said)?;
        let _ = cfg.num_params();
        let cluster = Cluster::parse("dgx-a100-80g").unwrap();
        let layout = LayoutSpec::parse("tp=2,pp=1").unwrap().layout;
        plan::evaluate(&input(PlanModel::Shape(cfg), cluster), &layout).map_err(said)?;
        Ok(())
    });
    assert!(n > 5000);
}

#[test]
fn peft_adapter_configs() {
    // A PEFT adapter directory whose config is mutated: loaded for its model, and the adapters
    // then priced by the planner.
    let dir = temp_dir("fuzz-peft");
    let src = fixture("lora").join("llama_tiny");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    let model = ModelConfig::from_hf_file(&fixture("llama_tiny").join("config.json")).unwrap();
    let seeds = vec![
        std::fs::read(src.join("adapter_config.json")).unwrap(),
        std::fs::read(
            fixture("lora")
                .join("gpt2_tiny")
                .join("adapter_config.json"),
        )
        .unwrap(),
    ];
    let n = fuzz(
        "adapter_config.json",
        48,
        Form::Json,
        seeds,
        2000,
        move |b| {
            std::fs::write(dir.join("adapter_config.json"), b).map_err(said)?;
            let adapters =
                ferrotron_engine::lora::Adapters::load_peft(&dir, &model).map_err(said)?;
            let cluster = Cluster::parse("dgx-a100-80g").unwrap();
            let layout = LayoutSpec::parse("tp=2").unwrap().layout;
            let input = PlanInput {
                lora: Some(adapters.config),
                ..input(PlanModel::Shape(model.clone()), cluster)
            };
            plan::evaluate(&input, &layout).map_err(said)?;
            Ok(())
        },
    );
    assert!(n > 2000);
}

#[test]
fn train_toml() {
    let example = "model = \"tests/fixtures/llama_tiny\"\ndata = \"data/gnu-manuals.txt\"\nsteps = 240\nbatch_size = 16\nseq_len = 128\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 20\nweight_decay = 0.1\nbeta1 = 0.9\nbeta2 = 0.95\nadam_eps = 1e-8\ngrad_clip = 1.0\nseed = 0\neval_every = 40\neval_batches = 8\nval_fraction = 0.05\nout_dir = \"runs/default\"\nthreads = 0\nlayout = \"mbs=4\"\nsave_dtype = \"f32\"\ncluster = \"this-machine\"\ndevice_memory = \"40MB\"\nbackend = \"threads\"\nprecision = \"fp16\"\nloss_scale = 65536.0\nloss_scale_window = 1000\ncheckpoint_every = 0\nkeep_checkpoints = 0\n";
    let n = fuzz(
        "train TOML",
        44,
        Form::Toml,
        seeds(&[
            example,
            "steps = 5\nlayout = \"dp=2,tp=2\"\nresume = \"runs/x/checkpoints\"\n",
        ]),
        5000,
        |b| {
            let table = toml::from_str::<toml::Table>(&text(b)).map_err(said)?;
            let serde_json::Value::Object(map) = serde_json::to_value(table).map_err(said)? else {
                unreachable!("a TOML table is a JSON object");
            };
            let defaults = TrainConfig::default();
            let cfg =
                TrainConfig::layered(Some(map), &defaults, &|_| false, "run.toml").map_err(said)?;
            cfg.check().map_err(said)?;
            Ok(())
        },
    );
    assert!(n > 5000);
}

/// A two-rank checkpoint of the tiny Llama (imported: step 0), and its files' bytes.
fn checkpoint_dir(tag: &str) -> std::path::PathBuf {
    let root = temp_dir(tag);
    let layout = LayoutSpec::parse("tp=2").unwrap().layout;
    checkpoint::import_hf(&fixture("llama_tiny"), &layout, &root, false).unwrap()
}

#[test]
fn checkpoint_manifests() {
    let dir = checkpoint_dir("fuzz-manifest");
    let manifest = std::fs::read(dir.join("manifest.json")).unwrap();
    let target_dir = dir.clone();
    let n = fuzz(
        "manifest JSON",
        45,
        Form::Json,
        vec![manifest],
        1500,
        move |b| {
            // A mutated manifest that still parses is sealed again (as a deliberate edit would
            // be), so that the checks behind the checksum are reached; the rest go as they are.
            let sealed = serde_json::from_slice::<checkpoint::Manifest>(b)
                .ok()
                .map(|mut m| {
                    m.checksum = Some(m.digest());
                    serde_json::to_vec(&m).unwrap()
                });
            let b = sealed.as_deref().unwrap_or(b);
            std::fs::write(target_dir.join("manifest.json"), b).unwrap();
            let ck = checkpoint::Checkpoint::open(&target_dir).map_err(said)?;
            ck.params().map_err(said)?;
            checkpoint::inspect(&target_dir).map_err(said)?;
            Ok(())
        },
    );
    assert!(n > 1500);
}

#[test]
fn safetensors_headers() {
    let dir = temp_dir("fuzz-safetensors");
    let src = fixture("llama_tiny");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let (head, body) = bytes.split_at(8 + header_len);
    let body = body.to_vec();
    // Only the header is mutated (its length prefix included); the tensor bytes follow as they are.
    let target_dir = dir.clone();
    let n = fuzz(
        "safetensors headers",
        46,
        Form::SafetensorsHeader,
        vec![head.to_vec()],
        3000,
        move |h| {
            let mut file = h.to_vec();
            file.extend_from_slice(&body);
            std::fs::write(target_dir.join("model.safetensors"), &file).unwrap();
            hf::load_model(&target_dir).map_err(said)?;
            Ok(())
        },
    );
    assert!(n > 3000);
}

#[test]
fn token_files() {
    let dir = temp_dir("fuzz-tokens");
    let reference = fixture("llama_tiny").join("reference_grads.safetensors");
    let batch = data::read_token_file(&reference).unwrap();
    let seed_file = dir.join("seed.safetensors");
    let ids: Vec<i64> = batch.ids.iter().map(|&i| i as i64).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let header = format!(
        "{{\"input_ids\":{{\"dtype\":\"I64\",\"shape\":[{},{}],\"data_offsets\":[0,{}]}}}}",
        batch.batch,
        batch.seq,
        bytes.len()
    );
    let mut seed = (header.len() as u64).to_le_bytes().to_vec();
    seed.extend_from_slice(header.as_bytes());
    seed.extend_from_slice(&bytes);
    std::fs::write(&seed_file, &seed).unwrap();
    let (cfg, _) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let file = dir.join("tokens.safetensors");
    let n = fuzz(
        "token files",
        47,
        Form::SafetensorsHeader,
        vec![seed],
        5000,
        move |b| {
            std::fs::write(&file, b).unwrap();
            let batch = data::read_token_file(&file).map_err(said)?;
            batch.check(&cfg)
        },
    );
    assert!(n > 5000);
}

/// What stands at a reader's path in place of its file: a link to a device, a FIFO nobody writes,
/// a sparse file larger than the reader's limit. Each must be refused at once, naming what it is.
fn hostile_files(
    dir: &std::path::Path,
    name: &str,
    limit: u64,
) -> Vec<(std::path::PathBuf, &'static str)> {
    let mut out = Vec::new();
    let device = dir.join(format!("device-{name}"));
    std::fs::create_dir_all(&device).unwrap();
    let _ = std::fs::remove_file(device.join(name));
    std::os::unix::fs::symlink("/dev/zero", device.join(name)).unwrap();
    out.push((device.join(name), "a device"));
    let fifo = dir.join(format!("fifo-{name}"));
    std::fs::create_dir_all(&fifo).unwrap();
    let c = std::ffi::CString::new(fifo.join(name).to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    out.push((fifo.join(name), "a FIFO"));
    if limit > 1 << 50 {
        return out; // no limit to pass (weights are mapped, not read)
    }
    let big = dir.join(format!("big-{name}"));
    std::fs::create_dir_all(&big).unwrap();
    std::fs::File::create(big.join(name))
        .unwrap()
        .set_len(limit + 1)
        .unwrap();
    out.push((big.join(name), "more than the"));
    out
}

/// Every reader of a file a user or a piece of data names, fed a device, a FIFO and an oversized
/// file: a clear refusal within a second, naming what the path is.
#[test]
fn readers_refuse_devices_fifos_and_oversized_files() {
    use ferrotron_core::bounded;
    let dir = temp_dir("fuzz-hostile");
    let model = fixture("llama_tiny");
    let cfg = ferrotron_core::model::preset("llama-tiny").unwrap();
    type Reader<'a> = Box<dyn Fn(&std::path::Path) -> String + 'a>;
    let err = |r: Result<(), String>| r.err().unwrap_or_else(|| "accepted".into());
    let copy_model = |to: &std::path::Path, except: &str| {
        std::fs::create_dir_all(to).unwrap();
        for f in std::fs::read_dir(&model).unwrap().flatten() {
            if f.file_name() != except && !to.join(f.file_name()).exists() {
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
    };
    let readers: Vec<(&str, u64, Reader)> = vec![
        (
            "config.json",
            bounded::SETTINGS,
            Box::new(|p: &std::path::Path| {
                err(ferrotron_core::model::ModelConfig::from_hf_file(p)
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "tokenizer.json",
            bounded::TOKENIZER,
            Box::new(|p: &std::path::Path| {
                err(ferrotron_engine::data::load_tokenizer(p)
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "corpus.txt",
            bounded::CORPUS,
            Box::new(|p: &std::path::Path| {
                err(ferrotron_engine::data::read_corpus(p.to_str().unwrap())
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "tokens.safetensors",
            bounded::CORPUS,
            Box::new(|p: &std::path::Path| {
                err(ferrotron_engine::data::read_token_file(p)
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "model.safetensors",
            u64::MAX - 1,
            Box::new(|p: &std::path::Path| {
                let d = p.parent().unwrap();
                copy_model(d, "model.safetensors");
                err(ferrotron_engine::hf::load_model(d)
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "adapter_config.json",
            bounded::SETTINGS,
            Box::new(|p: &std::path::Path| {
                err(
                    ferrotron_engine::lora::Adapters::load_peft(p.parent().unwrap(), &cfg)
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                )
            }),
        ),
        (
            "manifest.json",
            bounded::SETTINGS,
            Box::new(|p: &std::path::Path| {
                err(checkpoint::Checkpoint::open(p.parent().unwrap())
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            }),
        ),
        (
            "run.toml",
            bounded::SETTINGS,
            Box::new(|p: &std::path::Path| {
                let o = ferrotron(&[
                    "train",
                    "--config",
                    p.to_str().unwrap(),
                    "--out-dir",
                    p.with_extension("out").to_str().unwrap(),
                ]);
                stderr(&o)
            }),
        ),
        (
            "hosts",
            bounded::SETTINGS,
            Box::new(|p: &std::path::Path| {
                stderr(&ferrotron(&[
                    "launch",
                    "--hostfile",
                    p.to_str().unwrap(),
                    "--",
                    "train",
                ]))
            }),
        ),
        (
            "metrics.jsonl",
            bounded::RECORDS,
            Box::new(|p: &std::path::Path| {
                stderr(&ferrotron(&[
                    "report",
                    p.parent().unwrap().to_str().unwrap(),
                    "--out",
                    p.with_extension("html").to_str().unwrap(),
                ]))
            }),
        ),
        (
            "runs.toml",
            bounded::RECORDS,
            Box::new(|p: &std::path::Path| {
                stderr(&ferrotron(&[
                    "calibrate",
                    "--runs",
                    p.to_str().unwrap(),
                    "--out",
                    p.with_extension("out").to_str().unwrap(),
                ]))
            }),
        ),
    ];
    for (name, limit, read) in &readers {
        for (path, what) in hostile_files(&dir, name, *limit) {
            let started = std::time::Instant::now();
            let e = read(&path);
            assert!(
                started.elapsed().as_secs_f64() < 5.0,
                "{name} as {what} took long"
            );
            assert!(
                e.contains(what) && !e.contains("panicked"),
                "{name} as {what}: {e}"
            );
        }
    }
}

//! The `ferrotron` command line, run as a user runs it.

mod common;

use common::*;

#[test]
fn grads_writes_loss_and_every_gradient_by_hf_name() {
    for (model, layout) in [
        ("llama_tiny", "dp=1,tp=1,pp=1,mbs=1"),
        ("gpt2_tiny", "dp=1,tp=1,pp=1,mbs=1"),
        ("llama_tiny", "pp=2,mbs=1,schedule=1f1b"),
        ("gpt2_tiny", "pp=4,mbs=1,schedule=gpipe"),
        ("llama_tiny", "tp=2,mbs=1"),
        ("llama_tiny", "tp=4,sp=true,mbs=2"),
        ("gpt2_tiny", "tp=4,mbs=2"),
        ("gpt2_tiny", "tp=2,pp=2,sp=true,mbs=1"),
        ("gpt2_tiny", "dp=2,tp=2,zero=3,mbs=1"),
    ] {
        let dir = temp_dir(&format!("grads-{model}-{}", layout.len()));
        let out = dir.join("grads.safetensors");
        let refs = fixture(model).join("reference_grads.safetensors");
        let o = ferrotron(&[
            "grads",
            "--model",
            fixture(model).to_str().unwrap(),
            "--tokens",
            refs.to_str().unwrap(),
            "--layout",
            layout,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got = read_f32(&out);
        let want = read_f32(&refs);
        assert_eq!(got["loss"].0, Vec::<usize>::new(), "loss is a scalar");
        let loss_err = (got["loss"].1[0] as f64 - want["loss_f32"].1[0] as f64).abs()
            / want["loss_f32"].1[0] as f64;
        assert!(loss_err <= 1e-6, "{model}: loss {loss_err:e}");
        let names: Vec<&String> = want.keys().filter(|k| k.starts_with("grad_f32.")).collect();
        assert_eq!(names.len(), got.len() - 1, "one gradient per parameter");
        for name in names {
            let g = &got[&name.replace("grad_f32.", "grad.")];
            assert_eq!(g.0, want[name].0, "{name}: full Hugging Face shape");
            assert!(rel_err(&g.1, &want[name].1) <= 1e-5, "{model}: {name}");
        }
    }
}

#[test]
fn grads_refuses_bad_input_clearly() {
    let dir = temp_dir("grads-bad");
    let model = fixture("llama_tiny");
    let refs = fixture("llama_tiny").join("reference_grads.safetensors");
    let out = dir.join("g.safetensors");
    let run = |model: &str, tokens: &str, layout: &str| {
        ferrotron(&[
            "grads",
            "--model",
            model,
            "--tokens",
            tokens,
            "--layout",
            layout,
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let o = run(model.to_str().unwrap(), refs.to_str().unwrap(), "tp=3");
    assert!(
        !o.status.success() && stderr(&o).contains("4 attention heads do not divide over 3"),
        "{}",
        stderr(&o)
    );
    let o = run(model.to_str().unwrap(), refs.to_str().unwrap(), "auto");
    assert!(
        !o.status.success() && stderr(&o).contains("`auto`") && stderr(&o).contains("planner"),
        "{}",
        stderr(&o)
    );
    let o = run(model.to_str().unwrap(), refs.to_str().unwrap(), "tp=two");
    assert!(
        !o.status.success() && stderr(&o).contains("tp"),
        "{}",
        stderr(&o)
    );
    let o = run(
        model.to_str().unwrap(),
        model.join("config.json").to_str().unwrap(),
        "",
    );
    assert!(
        !o.status.success() && stderr(&o).contains("config.json"),
        "{}",
        stderr(&o)
    );
    let o = run(dir.to_str().unwrap(), refs.to_str().unwrap(), "");
    assert!(
        !o.status.success() && stderr(&o).contains("config.json"),
        "{}",
        stderr(&o)
    );
    let o = run(
        model.to_str().unwrap(),
        model.join("model.safetensors").to_str().unwrap(),
        "",
    );
    assert!(
        !o.status.success() && stderr(&o).contains("input_ids"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn train_reads_toml_and_flags_win() {
    let dir = temp_dir("train");
    let corpus = dir.join("text.txt");
    let text: String = (0..400)
        .map(|i| format!("Line {i}: the sort command orders lines; uniq removes repeats.\n\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "model = \"{}\"\ndata = \"{}\"\nsteps = 7\nbatch_size = 4\nseq_len = 32\neval_every = 2\nout_dir = \"{}\"\n",
            fixture("llama_tiny").display(),
            corpus.display(),
            dir.join("run").display()
        ),
    )
    .unwrap();
    let o = ferrotron(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--steps",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("validation loss"), "{stdout}");
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    assert_eq!(
        metrics.lines().count(),
        3,
        "the flag overrides the file's 7 steps"
    );
    assert!(
        dir.join("run/model/model.safetensors").exists()
            && dir.join("run/model/config.json").exists()
    );

    std::fs::write(&config, "stepz = 3\n").unwrap();
    let o = ferrotron(&["train", "--config", config.to_str().unwrap()]);
    assert!(
        !o.status.success() && stderr(&o).contains("stepz") && stderr(&o).contains("run.toml"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bench_train_prints_a_table() {
    let o = ferrotron(&[
        "bench",
        "train",
        "--model",
        "llama-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--warmup",
        "0",
        "--steps",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(
        s.contains("tokens/s") && s.contains("GFLOP/s") && s.contains("forward / backward / AdamW"),
        "{s}"
    );
}

#[test]
fn plan_json_has_the_stable_fields() {
    let o = ferrotron(&[
        "plan",
        "--model",
        "llama2-7b",
        "--cluster",
        "dgx-a100-80g,nodes=2",
        "--seq",
        "4096",
        "--global-batch",
        "64",
        "--layout",
        "dp=4,tp=4,pp=1,zero=1,mbs=1,recompute=selective",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in [
        "dp",
        "tp",
        "pp",
        "vpp",
        "zero",
        "micro_batch_size",
        "num_micro_batches",
        "schedule",
        "recompute",
        "sequence_parallel",
    ] {
        assert!(!v["layout"][key].is_null(), "layout.{key}");
    }
    for key in [
        "weights",
        "gradients",
        "master_weights",
        "optimizer_states",
        "activations",
        "comm_buffers",
        "total",
    ] {
        assert!(v["memory_bytes"][key].is_u64(), "memory_bytes.{key}");
    }
    for key in ["tp", "pp", "dp"] {
        assert!(
            v["comm_bytes_per_step"][key].is_number(),
            "comm_bytes_per_step.{key}"
        );
    }
    for key in ["bubble_fraction", "step_time_s", "tflops_per_device", "mfu"] {
        assert!(v[key].is_number(), "{key}");
    }
    assert!(v["fits"].is_boolean() && v["explain"].is_array());

    let o = ferrotron(&[
        "plan",
        "--model",
        "llama2-7b",
        "--cluster",
        "dgx-a100-80g,nodes=2",
        "--seq",
        "4096",
        "--global-batch",
        "64",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = v["candidates"].as_array().unwrap();
    assert!(!c.is_empty() && c.iter().all(|p| p["fits"] == true));
    assert!(c
        .windows(2)
        .all(|w| w[0]["step_time_s"].as_f64() <= w[1]["step_time_s"].as_f64()));

    // `auto` keys search among layouts that keep the explicit ones.
    let o = ferrotron(&[
        "plan",
        "--model",
        "llama2-7b",
        "--cluster",
        "dgx-a100-80g,nodes=2",
        "--seq",
        "4096",
        "--global-batch",
        "64",
        "--layout",
        "tp=2,pp=auto",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["layout"]["tp"] == 2));

    // The text says first what it priced: `plan` defaults to mixed bf16, `train` to f32.
    for (flags, priced) in [
        (
            &[][..],
            "priced in weights bf16, gradients bf16, master fp32",
        ),
        (
            &["--precision", "f32"][..],
            "priced in weights fp32, gradients fp32, master none",
        ),
    ] {
        let mut args = vec!["plan", "--model", "llama-small", "--global-batch", "8"];
        args.extend_from_slice(flags);
        let o = ferrotron(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.starts_with(priced), "{text}");
        assert!(
            text.lines()
                .next()
                .unwrap()
                .contains("`train` trains in f32"),
            "{text}"
        );
    }
}

#[test]
fn plan_refuses_bad_input_clearly() {
    let run = |args: &[&str]| {
        let mut all = vec!["plan", "--global-batch", "64"];
        all.extend_from_slice(args);
        ferrotron(&all)
    };
    for (args, needle) in [
        (
            vec![
                "--model",
                "llama2-7b",
                "--cluster",
                "dgx-a100-80g",
                "--layout",
                "tp=3,dp=1",
            ],
            "tp",
        ),
        (
            vec!["--model", "llama2-7b", "--cluster", "dgx-z100"],
            "dgx-z100",
        ),
        (
            vec!["--model", "arch=gpt,layers=2,hidden=-8,heads=2,vocab=10"],
            "hidden",
        ),
        (
            vec![
                "--model",
                "llama2-7b",
                "--cluster",
                "dgx-a100-80g",
                "--layout",
                "dp=16",
            ],
            "dp",
        ),
        (
            vec![
                "--model",
                "llama2-7b",
                "--cluster",
                "dgx-a100-80g,nodes=2",
                "--layout",
                "tp=16",
            ],
            "tp=16",
        ),
    ] {
        let o = run(&args);
        assert!(
            !o.status.success() && stderr(&o).contains(needle),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn schedule_prints_the_action_lists() {
    let o = ferrotron(&[
        "schedule",
        "--schedule",
        "1f1b",
        "--pp",
        "4",
        "--micro-batches",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(
        s.contains("stage  0 | F0") && s.contains("bubble (idle / step, worst stage) 0.273"),
        "{s}"
    );
}

#[test]
fn verify_passes_for_every_parallel_layout_and_refuses_what_does_not_split() {
    let model = fixture("llama_tiny");
    for layout in [
        "dp=2,tp=2,pp=2,zero=1",
        "dp=4,zero=3",
        "dp=2,tp=2,sp=true,zero=2,mbs=2",
        "tp=2",
        "tp=4,sp=true,mbs=2",
        "tp=2,pp=2,schedule=zbh1,mbs=2",
        "pp=2,schedule=1f1b,mbs=2",
        "pp=4,schedule=zbh1,mbs=1,recompute=full",
        "pp=2,vpp=2,schedule=interleaved,mbs=1",
        "mbs=2,recompute=selective",
    ] {
        let o = ferrotron(&[
            "verify",
            "--model",
            model.to_str().unwrap(),
            "--layout",
            layout,
        ]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success()
                && out.contains("OK: the split computes the same loss and gradients"),
            "{layout}: {out}{}",
            stderr(&o)
        );
    }
    let o = ferrotron(&[
        "verify",
        "--model",
        model.to_str().unwrap(),
        "--layout",
        "dp=3",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("not divisible by dp"),
        "{}",
        stderr(&o)
    );
}

/// A mixture of experts: replicas of one micro-batch each compute the unsplit model's function; more
/// micro-batches take the load-balancing loss per micro-batch step, and `verify` says how to compare.
#[test]
fn verify_explains_a_mixture_of_experts_micro_batches() {
    let model = fixture("variants").join("mixtral");
    // `verify --layout` followed by `layout_and_flags` (the layout, then any flags).
    let verify = |layout_and_flags: &str| {
        let mut args = vec!["verify", "--model", model.to_str().unwrap(), "--layout"];
        args.extend(layout_and_flags.split_whitespace());
        ferrotron(&args)
    };
    let o = verify("dp=2,mbs=4");
    assert!(o.status.success(), "{}", stderr(&o));
    // Its experts divided over the two replicas.
    let o = verify("dp=2,mbs=4,ep=2,zero=2");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = verify("dp=2");
    assert!(
        !o.status.success() && stderr(&o).contains("give mbs=4 (one micro-batch per replica)"),
        "{}",
        stderr(&o)
    );
    // Its experts' columns over a tensor-parallel group, beside expert parallelism.
    let o = verify("dp=2,tp=2,mbs=4,ep=2");
    assert!(o.status.success(), "{}", stderr(&o));
    // Each expert whole on one device of the tensor-parallel pair (etp=1).
    let o = verify("dp=2,tp=2,mbs=4,ep=2,etp=1");
    assert!(o.status.success(), "{}", stderr(&o));
    // Its sequences cut over a context-parallel pair, which is also its expert-parallel group.
    let o = verify("cp=2,ep=2,mbs=8");
    assert!(o.status.success(), "{}", stderr(&o));
    // An asynchronous schedule, verified by training against its delayed-update reference, with
    // and without expert parallelism.
    let o = verify("pp=2,schedule=2bw,mbs=4 --steps 2");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = verify("dp=2,ep=2,pp=2,schedule=pipedream,mbs=2 --steps 2");
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn benchmarks_refuse_zero_counts_clearly() {
    for args in [
        &["bench", "train", "--steps", "0"][..],
        &["bench", "comm", "--devices", "2,0"],
        &["bench", "pipeline", "--micro-batches", "0"],
    ] {
        let o = ferrotron(args);
        assert!(
            !o.status.success() && stderr(&o).contains("invalid value '0'"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn a_reader_that_stops_early_ends_the_output_without_a_panic() {
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args([
            "plan",
            "--model",
            "llama-small",
            "--global-batch",
            "8",
            "--seq",
            "128",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    drop(child.stdout.take()); // as `| head -0` does
    let o = child.wait_with_output().expect("ends");
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// `--layout auto` says what it chose and why before the first step, and every step its MFU.
#[test]
fn auto_explains_its_choice_before_training_and_steps_report_mfu() {
    let out = temp_dir("auto-explains");
    let o = train(&out, "2", &["--layout", "auto", "--eval-every", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let (chose, first_step) = (
        err.find("layout auto: ").expect("the choice"),
        err.find("step     1").expect("a progress line"),
    );
    assert!(chose < first_step, "{err}");
    assert!(
        err.contains("1. the arithmetic first") && err.contains("chosen: "),
        "{err}"
    );
    assert!(err.contains("MFU "), "{err}");
}

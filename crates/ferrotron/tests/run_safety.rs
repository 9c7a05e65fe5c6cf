//! Nothing lost, nothing silent (#40): the run directory's lock, offline tools that never replace
//! what they did not write, graceful preemption, the non-finite guard, ranges and meaningless
//! layouts refused, bounded reads.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};

fn refused(o: &std::process::Output, says: &[&str]) -> String {
    let err = stderr(o);
    assert!(!o.status.success(), "succeeded: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for s in says {
        assert!(err.contains(s), "`{s}` missing from: {err}");
    }
    err
}

/// A lock file naming `pid` on this host, as `train` writes it.
fn lock_of(dir: &Path, pid: u32) {
    std::fs::create_dir_all(dir).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap();
    let text =
        format!(r#"{{"pid":{pid},"host":"{host}","since":0,"process_start":null,"what":"train"}}"#);
    std::fs::write(dir.join(".ferrotron.lock"), text).unwrap();
}

#[test]
fn a_locked_run_directory_is_refused_naming_its_holder() {
    let dir = temp_dir("lock");
    let a = dir.join("a");
    assert!(train(&a, "2", &[]).status.success());
    assert!(
        !a.join(".ferrotron.lock").exists(),
        "the lock goes with the run"
    );
    // A live holder (this test process): a second run, --overwrite and --resume are all refused.
    lock_of(&a, std::process::id());
    let holder = format!("pid {}", std::process::id());
    for extra in [
        vec![],
        vec!["--overwrite"],
        vec!["--resume", a.join("checkpoints").to_str().unwrap()],
    ] {
        refused(&train(&a, "3", &extra), &["is in use by `train`", &holder]);
    }
    assert!(
        a.join("checkpoints/step-000002").exists(),
        "nothing deleted"
    );
    // A holder that is gone: reported; a plain run is refused, --resume continues the run.
    lock_of(&a, 999_999_999);
    refused(
        &train(&a, "3", &[]),
        &["which is gone", "--resume", "--overwrite"],
    );
    let o = train(
        &a,
        "3",
        &["--resume", a.join("checkpoints").to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("taking over the lock"));
    // And --overwrite replaces it.
    lock_of(&a, 999_999_999);
    let o = train(&a, "2", &["--overwrite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A model the user keeps in `<out>/model` is not replaced without --overwrite.
    let b = dir.join("b");
    std::fs::create_dir_all(b.join("model")).unwrap();
    std::fs::write(b.join("model/config.json"), "{}").unwrap();
    refused(
        &train(&b, "1", &[]),
        &["holds files no run wrote", "--overwrite"],
    );
    assert_eq!(
        std::fs::read_to_string(b.join("model/config.json")).unwrap(),
        "{}"
    );
}

/// Concurrent starts and --overwrites in one directory, with random delays: whatever wins, the
/// directory ends holding exactly one run, whole.
#[test]
fn concurrent_runs_and_overwrites_never_mix_two_runs() {
    let dir = temp_dir("concurrent").join("run");
    let mut seed = 0x9e37_79b9_u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    assert!(train(&dir, "2", &[]).status.success());
    for trial in 0..20 {
        let steps: Vec<String> = (0..2).map(|_| (2 + next(3)).to_string()).collect();
        let delay = std::time::Duration::from_millis(next(300));
        let mut children = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            if i == 1 {
                std::thread::sleep(delay);
            }
            let args = train_args(&dir, s, &["--overwrite"]);
            children.push(
                Command::new(env!("CARGO_BIN_EXE_ferrotron"))
                    .args(&args)
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
        }
        let outcomes: Vec<_> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for o in &outcomes {
            let err = stderr(o);
            assert!(
                o.status.success() || err.contains("is in use by `train`"),
                "trial {trial}: {err}"
            );
        }
        assert!(outcomes.iter().any(|o| o.status.success()), "trial {trial}");
        // One run: its metrics are whole lines of steps 1..n, its last checkpoint is step n.
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let steps: Vec<u64> = metrics
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("whole lines");
                v["step"].as_u64().unwrap()
            })
            .collect();
        let n = steps.len() as u64;
        assert_eq!(steps, (1..=n).collect::<Vec<_>>(), "trial {trial}");
        let latest = std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap();
        assert_eq!(latest.trim(), format!("step-{n:06}"), "trial {trial}");
        let settings = std::fs::read_to_string(dir.join("train_config.json")).unwrap();
        assert!(
            settings.contains(&format!("\"steps\": {n}")),
            "trial {trial}"
        );
        assert!(!dir.join(".ferrotron.lock").exists(), "trial {trial}");
    }
}

#[test]
fn offline_tools_never_replace_what_they_did_not_write() {
    let dir = temp_dir("offline");
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert!(train(&a, "2", &[]).status.success());
    assert!(train(&b, "3", &[]).status.success());
    let (ca, cb) = (a.join("checkpoints"), b.join("checkpoints"));
    let (ca, cb) = (ca.to_str().unwrap(), cb.to_str().unwrap());
    // reshard and import over another run's checkpoints.
    refused(
        &ferrotron(&["checkpoint", "reshard", ca, "--layout", "dp=2", "--out", cb]),
        &["already holds checkpoints", "--overwrite"],
    );
    let model = fixture("llama_tiny");
    refused(
        &ferrotron(&["checkpoint", "import", model.to_str().unwrap(), "--out", cb]),
        &["already holds checkpoints", "--overwrite"],
    );
    assert_eq!(
        std::fs::read_to_string(b.join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step-000003"
    );
    // export over another model.
    let hf = dir.join("hf");
    let hf_s = hf.to_str().unwrap();
    assert!(ferrotron(&["checkpoint", "export", ca, "--hf", hf_s])
        .status
        .success());
    let before = std::fs::read(hf.join("model.safetensors")).unwrap();
    refused(
        &ferrotron(&["checkpoint", "export", cb, "--hf", hf_s]),
        &["already holds a model", "--overwrite"],
    );
    assert_eq!(std::fs::read(hf.join("model.safetensors")).unwrap(), before);
    // --overwrite replaces: only the new run's steps are left.
    let o = ferrotron(&[
        "checkpoint",
        "reshard",
        ca,
        "--layout",
        "dp=2",
        "--out",
        cb,
        "--overwrite",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!b.join("checkpoints/step-000003").exists());
    assert!(
        ferrotron(&["checkpoint", "export", cb, "--hf", hf_s, "--overwrite"])
            .status
            .success()
    );
}

/// SIGTERM at a random step: the run saves that step's checkpoint and exits 143; resuming from it
/// ends where the uninterrupted run ends, bit for bit.
#[test]
fn sigterm_saves_the_step_and_the_resume_equals_the_uninterrupted_run() {
    let dir = temp_dir("preempt");
    let steps = "4000";
    let (whole, cut) = (dir.join("whole"), dir.join("cut"));
    assert!(train(&whole, steps, &["--checkpoint-every", "100000"])
        .status
        .success());
    let child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(train_args(&cut, steps, &["--checkpoint-every", "100000"]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once some steps are recorded, at a moment that varies with the machine.
    let metrics = cut.join("metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 20 {
        assert!(started.elapsed().as_secs() < 60, "the run never got going");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(143), "{err}");
    assert!(err.contains("stopped by SIGTERM after step"), "{err}");
    let recorded = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert!(recorded < 4000, "stopped early");
    let latest = std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{recorded:06}"));
    assert!(
        !cut.join("model").exists(),
        "no final model from a stopped run"
    );
    let resume = cut.join("checkpoints");
    let o = train(
        &cut,
        steps,
        &[
            "--checkpoint-every",
            "100000",
            "--resume",
            resume.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(whole.join("model/model.safetensors")).unwrap(),
        std::fs::read(cut.join("model/model.safetensors")).unwrap(),
        "the resumed run ends where the uninterrupted one does"
    );
    let lines = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert_eq!(lines, 4000, "each step recorded once");
}

#[test]
fn non_finite_weights_and_settings_out_of_range_are_refused() {
    let dir = temp_dir("ranges");
    let out = dir.join("run");
    for (extra, says) in [
        (vec!["--beta1", "1.0"], "`beta1`: 1 is outside [0, 1)"),
        (vec!["--beta2", "1.5"], "`beta2`: 1.5 is outside [0, 1)"),
        (vec!["--adam-eps", "0"], "`adam_eps`"),
        (vec!["--min-lr", "0.1"], "`min_lr`: 0.1 is above lr"),
        (vec!["--weight-decay", "-1"], "`weight_decay`"),
        (vec!["--grad-clip", "-1"], "`grad_clip`"),
        (vec!["--loss-scale-window", "0"], "`loss_scale_window`"),
        (vec!["--straggler-steps", "0"], "`straggler_steps`"),
        (vec!["--threads", "100000"], "`threads`"),
        (
            vec!["--lora-rank", "4", "--lora-alpha", "nan"],
            "`lora_alpha`",
        ),
        (vec!["--peer-timeout", "nan"], "`peer_timeout`"),
        (vec!["--layout", "sp=true"], "sp=true with tp=1"),
        (vec!["--layout", "zero=3"], "zero=3 with one replica"),
        (
            vec!["--layout", "schedule=zbh1"],
            "schedule=zbh1 needs a pipeline",
        ),
        (vec!["--layout", "schedule=2bw"], "delayed weights"),
        (
            vec!["--layout", "pp=2,schedule=interleaved"],
            "interleaved with vpp=1",
        ),
    ] {
        refused(&train(&out, "1", &extra), &[says]);
    }
    assert!(!out.exists(), "a refused run leaves nothing behind");
    // A NaN in a loaded weight is refused, naming the tensor.
    let model = dir.join("nan-model");
    std::fs::create_dir_all(&model).unwrap();
    let src = fixture("llama_tiny");
    for f in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
    }
    let name = poison(&model.join("model.safetensors"), "down_proj");
    let o = ferrotron(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out-dir",
        dir.join("nan-run").to_str().unwrap(),
    ]);
    refused(&o, &[&format!("tensor `{name}` holds a non-finite value")]);
}

#[test]
fn devices_fifos_and_directories_are_refused_by_the_readers() {
    let dir = temp_dir("readers");
    let out = dir.join("run");
    let fifo = dir.join("fifo.txt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (flag, path, says) in [
        ("--data", "/dev/zero", "a device"),
        ("--data", fifo.to_str().unwrap(), "a FIFO"),
        ("--tokenizer", "/dev/zero", "a device"),
        ("--config", "/dev/zero", "a device"),
    ] {
        let o = train(&out, "1", &[flag, path]);
        refused(&o, &[says]);
    }
}

/// Writes a NaN over the fourth value of the first f32 tensor whose name holds `part`; its name.
fn poison(file: &Path, part: &str) -> String {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (name, entry) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, v)| k.contains(part) && v["dtype"] == "F32")
        .expect("an f32 tensor");
    let at = 8 + n + entry["data_offsets"][0].as_u64().unwrap() as usize + 3 * 4;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(file, bytes).unwrap();
    name.clone()
}

/// The hang drill: device 1 stops answering after step 3; the others give up after the peer
/// timeout, every device writes its flight records, and the error names the device behind and the
/// collective it never entered.
#[test]
fn a_hung_device_is_named_with_the_collective_it_never_entered() {
    let dir = temp_dir("hang");
    let out = dir.join("run");
    let started = std::time::Instant::now();
    let o = train(
        &out,
        "10",
        &[
            "--layout",
            "dp=2,tp=2",
            "--inject-hang",
            "1@3",
            "--peer-timeout",
            "5",
        ],
    );
    let took = started.elapsed().as_secs_f64();
    let err = refused(&o, &["the flight records", "rank 1 never entered"]);
    assert!(took <= 15.0, "took {took:.1} s: {err}");
    for rank in 0..4 {
        let f = out.join(format!("flight/rank-{rank}.json"));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap())
            .expect("flight records are JSON");
        assert!(!v["records"].as_array().unwrap().is_empty(), "{f:?}");
    }
    refused(
        &train(&out, "1", &["--inject-hang", "3"]),
        &["`inject_hang`: `3` is not RANK@STEP"],
    );
}

/// A copy of the tiny Llama fixture with `edit` applied to its config.json.
fn edited_model(dir: &Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> String {
    let model = dir.join(name);
    std::fs::create_dir_all(&model).unwrap();
    for f in std::fs::read_dir(fixture("llama_tiny")).unwrap().flatten() {
        std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
    }
    let path = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&path, c.to_string()).unwrap();
    model.to_str().unwrap().to_string()
}

/// The inputs whose errors used to be unclear, or missing, each with its clear error.
#[test]
fn unclear_and_silent_inputs_get_clear_errors() {
    let dir = temp_dir("unclear");
    let out = dir.join("run");
    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let under_file = file.join("checkpoints");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--device-memory".into(), "-1GB".into()],
            "`-1GB` must be positive",
        ),
        (
            vec!["--device-memory".into(), "1e30GB".into()],
            "more than 2⁶⁴",
        ),
        (
            vec!["--data".into(), "a,b.txt".into()],
            "`--data` is split at commas",
        ),
        (
            vec![
                "--checkpoint-dir".into(),
                under_file.to_str().unwrap().into(),
            ],
            "Not a directory",
        ),
        (
            vec![
                "--model".into(),
                edited_model(&dir, "h63", |c| {
                    c["hidden_size"] = 63.into();
                    c.as_object_mut().unwrap().remove("head_dim");
                }),
            ],
            "field `hidden_size`: 63 does not split",
        ),
        (
            vec![
                "--model".into(),
                edited_model(&dir, "deep", |c| {
                    c["num_hidden_layers"] = 1_000_000_000.into()
                }),
            ],
            "config.json's 1000000000 layers need",
        ),
        (
            vec![
                "--model".into(),
                edited_model(&dir, "tied", |c| c["tie_word_embeddings"] = true.into()),
            ],
            "`lm_head.weight` differs from `model.embed_tokens.weight`",
        ),
        (
            vec![
                "--model".into(),
                edited_model(&dir, "theta", |c| {
                    c["rope_parameters"]["rope_theta"] = 0.into()
                }),
            ],
            "field `rope_theta`: 0 must be positive",
        ),
        (
            vec![
                "--model".into(),
                edited_model(&dir, "eps", |c| c["rms_norm_eps"] = (-1).into()),
            ],
            "field `rms_norm_eps`: -1 must not be negative",
        ),
    ];
    for (extra, says) in cases {
        // `--model` given here replaces the tiny preset.
        let mut args = train_args(&out, "1", &[]);
        match extra.as_slice() {
            [flag, model] if flag == "--model" => args[2] = model.clone(),
            _ => args.extend(extra),
        }
        refused(
            &ferrotron(&args.iter().map(String::as_str).collect::<Vec<_>>()),
            &[says],
        );
    }
    refused(&train(&file, "1", &[]), &["is a file, not a directory"]);
}

/// `launch` tells a launcher that could not start from dead hosts: a missing mpirun, and (run as
/// root without `--allow-run-as-root`) OpenMPI's refusal, are the error, not "every host is gone".
#[test]
fn launch_tells_a_launcher_that_could_not_start_from_dead_hosts() {
    let dir = temp_dir("launcher");
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "localhost slots=2\n").unwrap();
    let out = dir.join("run");
    let launch = |mpirun: &str| {
        ferrotron(&[
            "launch",
            "--hostfile",
            hosts.to_str().unwrap(),
            "--mpirun",
            mpirun,
            "--probe-timeout",
            "5",
            "--",
            "train",
            "--model",
            "llama-tiny",
            "--layout",
            "dp=2",
            "--steps",
            "1",
            "--out-dir",
            out.to_str().unwrap(),
        ])
    };
    refused(
        &launch("/nonexistent/mpirun"),
        &["cannot run `/nonexistent/mpirun`"],
    );
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let has_mpirun = Command::new("mpirun").arg("--version").output().is_ok();
    if root && has_mpirun {
        let err = refused(
            &launch("mpirun"),
            &["mpirun could not start the job", "root"],
        );
        assert!(!err.contains("no host is left"), "{err}");
    }
}

/// A run whose loss goes non-finite (here an absurd learning rate blows the weights up after the
/// first update) stops at that step naming it, saves nothing more, and leaves the last good
/// checkpoint; the same on an asynchronous schedule.
#[test]
fn a_run_that_goes_non_finite_stops_at_that_step() {
    let dir = temp_dir("non-finite");
    for (name, layout) in [("sync", ""), ("2bw", "pp=2,schedule=2bw")] {
        let out = dir.join(name);
        let mut extra = vec![
            "--lr",
            "1e30",
            "--min-lr",
            "0",
            "--warmup-steps",
            "0",
            "--grad-clip",
            "0",
            "--checkpoint-every",
            "1",
        ];
        if !layout.is_empty() {
            extra.extend(["--layout", layout]);
        }
        refused(
            &train(&out, "6", &extra),
            &["step 2: the loss is NaN", "saves nothing"],
        );
        let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
        assert_eq!(latest.trim(), "step-000001", "{name}");
        assert!(!out.join("model").exists(), "{name}: no model saved");
        let o = ferrotron(&[
            "checkpoint",
            "inspect",
            out.join("checkpoints").to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
}

//! `grads` and `verify` with one MPI rank per device, under a real `mpirun` (built with
//! `--features mpi`; needs OpenMPI).
#![cfg(feature = "mpi")]

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Command;

fn mpirun(np: usize, args: &[&str]) -> (bool, String) {
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
            env!("CARGO_BIN_EXE_ferrotron"),
        ])
        .args(args)
        .env("ATEN_CPU_CAPABILITY", common::REFERENCE_TORCH)
        .output()
        .expect("mpirun runs (install openmpi-bin)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn verify_tensor_and_pipeline_layouts_with_one_rank_per_device() {
    for (model, layout, np) in [
        ("llama_tiny", "tp=2", 2),
        ("gpt2_tiny", "tp=2,sp=true,mbs=2", 2),
        ("llama_tiny", "tp=4,sp=true,mbs=2", 4),
        ("gpt2_tiny", "tp=2,pp=2,mbs=2", 4),
        ("llama_tiny", "cp=2,mbs=2", 2),
        ("llama_tiny", "cp=2,cp_comm=a2a,mbs=2", 2),
        ("llama_tiny", "dp=2,cp=2,zero=3,mbs=1", 4),
        ("llama_tiny", "pp=2,schedule=zbh1,mbs=2", 2),
    ] {
        let m = fixture(model);
        let (ok, text) = mpirun(
            np,
            &[
                "verify",
                "--model",
                m.to_str().unwrap(),
                "--layout",
                layout,
                "--backend",
                "mpi",
            ],
        );
        assert!(
            ok && text.contains("OK: the split computes the same loss and gradients")
                && text.contains(&format!("one MPI rank per device ({np} ranks)")),
            "{model} {layout}: {text}"
        );
    }
}

/// `grads` of the model in `model` (a directory with its `reference_grads.safetensors`) on `np` MPI
/// ranks under `layout`: the loss and every gradient, in its full Hugging Face shape, within 1e-5 of
/// the PyTorch reference.
fn mpi_grads_match_the_reference(model: &std::path::Path, layout: &str, np: usize) {
    let dir = std::env::temp_dir().join(format!(
        "ferrotron-mpi-grads-{}-{}",
        std::process::id(),
        layout.replace([',', '='], "-")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("grads.safetensors");
    let refs = model.join("reference_grads.safetensors");
    let (ok, text) = mpirun(
        np,
        &[
            "grads",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            refs.to_str().unwrap(),
            "--layout",
            layout,
            "--backend",
            "mpi",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    let (got, want) = (read_f32(&out), read_f32(&refs));
    let loss_err = (got["loss"].1[0] - want["loss_f32"].1[0]).abs() / want["loss_f32"].1[0];
    assert!(loss_err <= 1e-5, "{layout}: loss {loss_err:e}");
    for (name, w) in want.iter().filter(|(n, _)| n.starts_with("grad_f32.")) {
        let g = &got[&name.replace("grad_f32.", "grad.")];
        assert_eq!(g.0, w.0, "{name}: full Hugging Face shape");
        assert!(rel_err(&g.1, &w.1) <= 1e-5, "{layout}: {name}");
    }
}

#[test]
fn grads_under_mpi_match_pytorch() {
    mpi_grads_match_the_reference(&fixture("llama_tiny"), "tp=4", 4);
}

/// A Mixtral on four ranks, one sequence each, its experts divided over pairs of them: tokens
/// travel to their experts' ranks and back over MPI, the replicas sum their router statistics
/// before backward, and ZeRO-3 shards the experts over the ranks holding them; then over two
/// pipeline stages. The loss (with its load-balancing term) and every gradient are transformers'
/// for the whole batch.
#[test]
fn mixtral_grads_on_four_mpi_ranks_with_expert_parallelism_match_transformers() {
    mpi_grads_match_the_reference(&fixture("variants").join("mixtral"), "dp=4,ep=2,zero=3", 4);
    // Two pipeline stages of two replicas: the router statistics travel between the stages' ranks.
    mpi_grads_match_the_reference(
        &fixture("variants").join("mixtral"),
        "dp=2,ep=2,pp=2,mbs=2,schedule=zbh1",
        4,
    );
}

#[test]
fn a_job_of_the_wrong_size_is_refused_clearly() {
    let m = fixture("llama_tiny");
    let (ok, text) = mpirun(
        2,
        &[
            "verify",
            "--model",
            m.to_str().unwrap(),
            "--layout",
            "tp=4",
            "--backend",
            "mpi",
        ],
    );
    assert!(!ok, "{text}");
    assert!(
        text.contains("needs 4 devices, the job has 2 ranks"),
        "{text}"
    );
}

/// `ferrotron train` on the llama_tiny fixture and the bundled text, sequences of 32 tokens, no
/// evaluation, into `out`; `extra` adds or overrides flags.
fn train_args(out: &std::path::Path, extra: &[&str]) -> Vec<String> {
    train_args_of(fixture("llama_tiny").to_str().unwrap(), out, extra)
}

/// `train` of `model` (a preset or a directory) on the bundled manuals, 32-token sequences.
fn train_args_of(model: &str, out: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/gnu-manuals.txt");
    let mut args: Vec<String> = [
        "train",
        "--model",
        model,
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "32",
        "--eval-every",
        "0",
        "--out-dir",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

#[test]
fn training_under_mpi_matches_the_threads_backend_step_by_step() {
    let root = std::env::temp_dir().join(format!("ferrotron-mpi-train-{}", std::process::id()));
    let args = |backend: &str, out: &std::path::Path| {
        train_args(
            out,
            &[
                "--layout",
                "dp=2,tp=2,pp=2,zero=1",
                "--steps",
                "4",
                "--batch-size",
                "8",
                "--checkpoint-every",
                "2",
                "--backend",
                backend,
            ],
        )
    };
    let mpi_dir = root.join("mpi");
    let m = losses_on_mpi_and_threads(8, &root, &args);
    assert_eq!(m.len(), 4);
    // Every rank wrote its file of the checkpoints; resuming under MPI from step 2 continues the
    // run exactly.
    let ck = ferrotron_engine::checkpoint::Checkpoint::open(&mpi_dir.join("checkpoints")).unwrap();
    assert_eq!((ck.manifest.step, ck.manifest.world_size), (4, 8));
    let resumed_dir = root.join("mpi-resumed");
    let mut r = args("mpi", &resumed_dir);
    r.push("--resume".into());
    r.push(
        mpi_dir
            .join("checkpoints/step-000002")
            .display()
            .to_string(),
    );
    let (ok, text) = mpirun(8, &r.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{text}");
    let resumed = metric_losses(&resumed_dir);
    assert_eq!(resumed.len(), 2);
    assert_eq!(
        resumed[0].to_bits(),
        m[2].to_bits(),
        "step 3 after resuming"
    );
    assert_eq!(
        resumed[1].to_bits(),
        m[3].to_bits(),
        "step 4 after resuming"
    );
}

/// A mixture of experts in bf16 on four ranks, its sequences cut over context-parallel pairs that are
/// also its expert-parallel groups (16-bit rows in the all-to-alls): the same losses as the threads
/// backend, step by step.
#[test]
fn a_bf16_mixture_of_experts_over_cp_and_ep_trains_as_on_threads() {
    mixtral_tiny_trains_as_on_threads(
        "moe",
        "dp=2,cp=2,ep=2,zero=2,mbs=2",
        &["--precision", "bf16"],
    );
}

/// A mixture of experts whose tensor-parallel pairs each hold half the experts whole (`etp=1`),
/// expert parallelism dividing each half over the replicas: the same losses as the threads backend.
#[test]
fn a_mixture_of_experts_with_whole_experts_over_tp_trains_as_on_threads() {
    mixtral_tiny_trains_as_on_threads("etp", "dp=2,tp=2,ep=2,etp=1,zero=3,mbs=2", &[]);
}

/// Expert parallelism on an asynchronous pipeline (2BW): each device keeps the weight versions of
/// its two states (dense tensors over dp, its experts over dp/ep): the same losses as the threads
/// backend.
#[test]
fn a_mixture_of_experts_on_2bw_with_ep_trains_as_on_threads() {
    mixtral_tiny_trains_as_on_threads("2bw", "dp=2,ep=2,pp=2,schedule=2bw,mbs=1", &[]);
}

/// Three steps of `mixtral-tiny` (four sequences each) on `layout` over four MPI ranks and on the
/// threads backend: the same losses, step by step.
fn mixtral_tiny_trains_as_on_threads(tag: &str, layout: &str, extra: &[&str]) {
    let root = std::env::temp_dir().join(format!("ferrotron-mpi-{tag}-{}", std::process::id()));
    let args = |backend: &str, out: &std::path::Path| {
        let mut flags = vec!["--layout", layout, "--steps", "3", "--batch-size", "4"];
        flags.extend_from_slice(extra);
        flags.extend_from_slice(&["--backend", backend]);
        train_args_of("mixtral-tiny", out, &flags)
    };
    assert_eq!(losses_on_mpi_and_threads(4, &root, &args).len(), 3);
}

/// Runs `args(backend, out)` under `mpirun -np np` into `root/mpi` and on the threads backend into
/// `root/threads`; asserts every step's loss agrees within 1e-6 and returns the MPI run's.
fn losses_on_mpi_and_threads(
    np: usize,
    root: &std::path::Path,
    args: &dyn Fn(&str, &std::path::Path) -> Vec<String>,
) -> Vec<f64> {
    let (mpi_dir, threads_dir) = (root.join("mpi"), root.join("threads"));
    let a = args("mpi", &mpi_dir);
    let (ok, text) = mpirun(np, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        ok && text.contains("per device, measured peak memory"),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args("threads", &threads_dir))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (m, t) = (metric_losses(&mpi_dir), metric_losses(&threads_dir));
    assert_eq!(m.len(), t.len());
    for (k, (a, b)) in m.iter().zip(&t).enumerate() {
        assert!(
            (a - b).abs() / b <= 1e-6,
            "step {k}: mpi {a} vs threads {b}"
        );
    }
    m
}

#[test]
fn auto_plans_for_the_job_s_ranks() {
    let root = std::env::temp_dir().join(format!("ferrotron-mpi-auto-{}", std::process::id()));
    let args = |out: &std::path::Path, batch: &str| {
        train_args(
            out,
            &[
                "--layout",
                "auto",
                "--steps",
                "2",
                "--batch-size",
                batch,
                "--backend",
                "mpi",
            ],
        )
    };
    // Two ranks: a two-device layout, trained.
    let a = args(&root.join("two"), "8");
    let (ok, text) = mpirun(2, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{text}");
    let line = std::fs::read_to_string(root.join("two/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let layout = ferrotron_core::layout::LayoutSpec::parse(first["layout"].as_str().unwrap())
        .unwrap()
        .layout;
    assert_eq!(layout.world_size(), 2, "{layout}");
    // Three ranks: 4 layers split unevenly over 3 stages (batch 8 and 4 heads divide nothing else).
    let a = args(&root.join("three"), "8");
    let (ok, text) = mpirun(3, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{text}");
    let line = std::fs::read_to_string(root.join("three/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let layout = ferrotron_core::layout::LayoutSpec::parse(first["layout"].as_str().unwrap())
        .unwrap()
        .layout;
    assert_eq!((layout.world_size(), layout.pp), (3, 3), "{layout}");
    // Five ranks: 5 divides neither the batch nor the heads, and 4 layers cannot fill 5 stages; the
    // error says so.
    let a = args(&root.join("five"), "8");
    let (ok, text) = mpirun(5, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!ok, "{text}");
    assert!(
        text.contains("no layout of 5 devices") && text.contains("dp=5,tp=1,pp=1"),
        "{text}"
    );
}

/// The README's and the guides' `mpirun` commands, shortened like the others (`tests/readme.rs`), in a directory
/// laid out like a fresh clone.
#[test]
fn readme_mpirun_commands_run() {
    let dir = temp_dir("readme-mpi");
    common::readme::clone_like(&dir);
    let mut ran = 0;
    for c in common::readme::commands() {
        if c.words[0] != "mpirun" {
            continue;
        }
        let mut words = common::readme::shortened(&c.words[1..]);
        let bin = words
            .iter()
            .position(|w| w.ends_with("target/release/ferrotron"))
            .expect("the guides run target/release/ferrotron");
        words[bin] = env!("CARGO_BIN_EXE_ferrotron").to_string();
        let out = Command::new("mpirun")
            .args(&words)
            .current_dir(&dir)
            .output()
            .expect("mpirun runs");
        assert!(
            out.status.success(),
            "{} line {}: `mpirun {}` failed:\n{}",
            c.page,
            c.line,
            words.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        // Only rank 0 speaks: one banner, however many ranks.
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.matches("ferrotron train:").count() <= 1, "{err}");
        ran += 1;
    }
    assert!(ran >= 2, "only {ran} mpirun commands found");
}

/// `grads --adapter` of `model` under mpirun on 4 ranks (with `extra` flags) against the f32 adapter
/// gradients of `reference`.
fn mpi_adapter_grads_match(model: &str, adapter: &str, reference: &str, extra: &[&str]) {
    let dir = temp_dir(&format!("mpi-{adapter}-{model}"));
    let out = dir.join("grads.safetensors");
    let adapter = fixture(adapter).join(model);
    let refs = adapter.join(reference);
    let (model_dir, adapter_dir, refs_path, out_path) = (
        fixture(model).display().to_string(),
        adapter.display().to_string(),
        refs.display().to_string(),
        out.display().to_string(),
    );
    let mut args = vec![
        "grads",
        "--model",
        &model_dir,
        "--adapter",
        &adapter_dir,
        "--tokens",
        &refs_path,
        "--backend",
        "mpi",
        "--out",
        &out_path,
    ];
    args.extend_from_slice(extra);
    let (ok, text) = mpirun(4, &args);
    assert!(ok, "{text}");
    assert_adapter_grads(&out, &refs, model);
}

#[test]
fn lora_adapter_gradients_under_mpi_match_peft() {
    mpi_adapter_grads_match(
        "gpt2_tiny",
        "lora",
        "lora_reference.safetensors",
        &["--layout", "tp=2,pp=2,mbs=1"],
    );
}

/// QLoRA under MPI: each rank quantizes its shard of the base as it reads it, and ZeRO-3 gathers the
/// 4-bit codes over the ranks; the adapter gradients equal PEFT + bitsandbytes'.
#[test]
fn qlora_adapter_gradients_under_mpi_match_peft_with_bitsandbytes() {
    mpi_adapter_grads_match(
        "llama_tiny",
        "qlora",
        "qlora_reference.safetensors",
        &[
            "--quantize-base",
            "nf4",
            "--layout",
            "dp=2,tp=2,zero=3,mbs=1",
        ],
    );
}

/// Checkpoints live on a filesystem every rank shares; a rank that cannot write (or read) the
/// checkpoint directory ends the whole job with an error that names it — it never leaves the
/// others waiting in a collective.
#[test]
fn a_checkpoint_directory_the_ranks_cannot_use_ends_the_job_with_a_clear_error() {
    let dir = temp_dir("mpi-unwritable-checkpoints");
    let blocker = dir.join("not-a-directory");
    std::fs::write(&blocker, "a file where the checkpoint directory would be").unwrap();
    let cases: [(&str, Vec<String>); 2] = [
        (
            "write",
            vec![
                "--checkpoint-dir".into(),
                blocker.join("ck").display().to_string(),
                "--checkpoint-every".into(),
                "2".into(),
            ],
        ),
        (
            "read",
            vec!["--resume".into(), blocker.join("ck").display().to_string()],
        ),
    ];
    for (what, extra) in cases {
        let out = dir.join(format!("run-{what}"));
        let mut a = train_args(
            &out,
            &[
                "--steps",
                "4",
                "--batch-size",
                "4",
                "--backend",
                "mpi",
                "--layout",
                "dp=2,pp=2",
            ],
        );
        a.extend(extra);
        let started = std::time::Instant::now();
        let res = Command::new("mpirun")
            .env("MPIEXEC_TIMEOUT", "120") // a hang fails the test rather than CI
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                "4",
                env!("CARGO_BIN_EXE_ferrotron"),
            ])
            .args(&a)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&res.stderr).to_string();
        assert!(!res.status.success(), "{what}: {text}");
        assert!(
            started.elapsed().as_secs() < 60,
            "{what}: took {:?}",
            started.elapsed()
        );
        assert!(
            text.contains("not-a-directory"),
            "{what}: the error names the directory:\n{text}"
        );
    }
}

/// SIGTERM to mpirun while two ranks train: OpenMPI forwards it to the ranks, which finish their
/// step together and save it; the checkpoint verifies, and the run resumed from it ends with the
/// uninterrupted run's model, byte for byte.
#[test]
fn sigterm_under_mpirun_saves_the_step_on_every_rank() {
    let root = temp_dir("mpi-preempt");
    let out = root.join("run");
    let mut args: Vec<String> = [
        "--allow-run-as-root",
        "--oversubscribe",
        // mpirun waits this long for the ranks between its SIGTERM and its SIGKILL (and forwards
        // their last words meanwhile).
        "--mca",
        "odls_base_sigkill_timeout",
        "30",
        "-np",
        "2",
        env!("CARGO_BIN_EXE_ferrotron"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    const STEPS: &str = "3000";
    let cut = [
        "--backend",
        "mpi",
        "--layout",
        "dp=2",
        "--steps",
        STEPS,
        "--checkpoint-every",
        "100000",
    ];
    args.extend(train_args(&out, &cut));
    let child = Command::new("mpirun")
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mpirun runs");
    let metrics = out.join("metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 10 {
        assert!(started.elapsed().as_secs() < 120, "the run never got going");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    // The ranks stop after their step, save it together (the save is collective) and exit,
    // releasing rank 0's lock; mpirun itself lingers on its own timeouts, and is ended here.
    let signalled = std::time::Instant::now();
    while out.join(".ferrotron.lock").exists() {
        assert!(signalled.elapsed().as_secs() < 60, "the ranks did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut child = child;
    let _ = child.kill();
    let _ = child.wait();
    let recorded = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert!(recorded < 3000, "stopped early");
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{recorded:06}"));
    let o = ferrotron(&[
        "checkpoint",
        "inspect",
        out.join("checkpoints").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let resume = out.join("checkpoints");
    let mut resumed_args = cut.to_vec();
    resumed_args.extend(["--resume", resume.to_str().unwrap()]);
    let resumed = train_args(&out, &resumed_args);
    let (ok, text) = mpirun(2, &resumed.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{text}");
    assert_eq!(
        std::fs::read_to_string(&metrics).unwrap().lines().count(),
        3000,
        "each step recorded once"
    );
    // The same run uninterrupted ends with the same model, byte for byte.
    let whole = root.join("whole");
    let uninterrupted = train_args(&whole, &cut);
    let (ok, text) = mpirun(
        2,
        &uninterrupted.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(ok, "{text}");
    assert_eq!(
        std::fs::read(whole.join("model/model.safetensors")).unwrap(),
        std::fs::read(out.join("model/model.safetensors")).unwrap(),
        "the resumed run ends where the uninterrupted one does"
    );
}

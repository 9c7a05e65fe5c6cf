//! LoRA from the command line: `grads --adapter` (the interface checks use), `verify --adapter`,
//! `train --lora-rank` writing a PEFT adapter and a merged model, `checkpoint export --adapter` and
//! `--merge`, `plan --lora-rank`; and bad LoRA input refused by name.

mod common;

use common::*;

#[test]
fn grads_with_an_adapter_writes_every_adapter_gradient_by_its_peft_name() {
    for (model, layout) in [
        ("llama_tiny", ""),
        ("llama_tiny", "tp=4,sp=true,mbs=1"),
        ("gpt2_tiny", "dp=2,tp=2,pp=2,zero=2,mbs=1"),
    ] {
        let dir = temp_dir(&format!("lora-grads-{model}-{}", layout.len()));
        let out = dir.join("grads.safetensors");
        let adapter = fixture("lora").join(model);
        let refs = adapter.join("lora_reference.safetensors");
        let o = ferrotron(&[
            "grads",
            "--model",
            path(&fixture(model)),
            "--adapter",
            path(&adapter),
            "--tokens",
            path(&refs),
            "--layout",
            layout,
            "--out",
            path(&out),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_adapter_grads(&out, &refs, &format!("{model} {layout}"));
        // Named as the adapter's own tensors.
        let adapter_tensors = read_f32(&adapter.join("adapter_model.safetensors"));
        let got = read_f32(&out);
        assert_eq!(got.len() - 1, adapter_tensors.len());
        for peft_name in adapter_tensors.keys() {
            assert!(
                got.contains_key(&format!("grad.{peft_name}")),
                "{peft_name}"
            );
        }
    }
}

#[test]
fn verify_compares_a_split_lora_model_with_the_unsplit_one() {
    let o = ferrotron(&[
        "verify",
        "--model",
        path(&fixture("llama_tiny")),
        "--adapter",
        path(&fixture("lora").join("llama_tiny")),
        "--layout",
        "tp=2,pp=2,schedule=zbh1,mbs=2",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}{out}", stderr(&o));
    assert!(
        out.contains("LoRA adapters: rank 4, alpha 8") && out.contains("OK"),
        "{out}"
    );
}

#[test]
fn a_lora_run_exports_its_adapters_and_the_merged_model() {
    let dir = temp_dir("lora-train");
    let run = dir.join("run");
    let o = ferrotron(&[
        "train",
        "--model",
        path(&fixture("gpt2_tiny")),
        "--lora-rank",
        "2",
        "--lora-targets",
        "c_attn",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--layout",
        "tp=2",
        "--out-dir",
        path(&run),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("of them trained: LoRA adapters"), "{out}");
    assert!(
        stderr(&o).contains("LoRA: rank 2, alpha 4 on c_attn"),
        "{}",
        stderr(&o)
    );
    let peft = read_f32(&run.join("adapter").join("adapter_model.safetensors"));
    assert_eq!(peft.len(), 4 * 2, "A and B of c_attn in 4 layers");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("adapter").join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 2);
    assert_eq!(config["fan_in_fan_out"], true);
    let ck = run.join("checkpoints");
    let o = ferrotron(&["checkpoint", "inspect", path(&ck)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("LoRA adapters: rank 2, alpha 4, on c_attn"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // The checkpoint's adapters exported as PEFT are the run's; merged, they are its model.
    let exported = dir.join("exported");
    let merged = dir.join("merged");
    let o = ferrotron(&[
        "checkpoint",
        "export",
        path(&ck),
        "--adapter",
        path(&exported),
        "--hf",
        path(&merged),
        "--merge",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(read_f32(&exported.join("adapter_model.safetensors")), peft);
    assert_eq!(
        read_f32(&merged.join("model.safetensors")),
        read_f32(&run.join("model").join("model.safetensors"))
    );
    // A LoRA checkpoint is not a model: exporting it as one says what to do instead.
    let o = ferrotron(&[
        "checkpoint",
        "export",
        path(&ck),
        "--hf",
        path(&dir.join("x")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("holds LoRA adapters") && stderr(&o).contains("--merge"));
}

#[test]
fn plan_prices_lora_on_the_named_targets() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "plan",
            "--model",
            "llama2-7b",
            "--cluster",
            "dgx-a100-80g",
            "--seq",
            "2048",
            "--global-batch",
            "8",
            "--layout",
            "tp=2,mbs=1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = ferrotron(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let full = json(&[]);
    let all = json(&["--lora-rank", "8"]);
    let qv = json(&["--lora-rank", "8", "--lora-targets", "q_proj,v_proj"]);
    let grads = |v: &serde_json::Value| v["memory_bytes"]["gradients"].as_f64().unwrap();
    // Llama-2-7B, rank 8 on every projection: 20.0M adapter parameters; on q and v: 4.2M. Each
    // target keeps one half whole and shards the other over tp=2.
    assert!(grads(&all) < grads(&full) / 100.0);
    assert!(grads(&qv) < grads(&all) / 3.0);
    let weights = |v: &serde_json::Value| v["memory_bytes"]["weights"].as_f64().unwrap();
    assert!(
        weights(&all) > weights(&full),
        "the frozen base stays whole, the adapters come on top"
    );
}

#[test]
fn bad_lora_input_is_refused_by_name() {
    let dir = temp_dir("lora-bad");
    let fails = |args: &[&str]| -> String {
        let o = ferrotron(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        stderr(&o)
    };
    let model = fixture("llama_tiny");
    let out_dir = dir.join("run");
    let base = [
        "train",
        "--model",
        path(&model),
        "--steps",
        "1",
        "--out-dir",
        path(&out_dir),
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let run = |extra: &[&str]| {
        let args = with(extra);
        fails(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    assert!(run(&["--lora-rank", "0"]).contains("lora_rank"));
    assert!(run(&["--lora-alpha", "4"]).contains("give `lora_rank`"));
    assert!(run(&["--lora-rank", "4", "--lora-targets", "c_attn"]).contains("`c_attn`"));
    assert!(run(&["--lora-rank", "4", "--lora-alpha", "-1"]).contains("lora_alpha"));
    assert!(run(&["--adapter", path(&dir.join("none"))]).contains("adapter_config.json"));
    // A PEFT adapter with dropout, and one with a tensor that is not an adapter.
    let peft = dir.join("peft");
    std::fs::create_dir_all(&peft).unwrap();
    let src = fixture("lora").join("llama_tiny");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        peft.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    config["lora_dropout"] = 0.05.into();
    std::fs::write(peft.join("adapter_config.json"), config.to_string()).unwrap();
    let e = run(&["--adapter", path(&peft)]);
    assert!(
        e.contains("adapter_config.json") && e.contains("lora_dropout"),
        "{e}"
    );
    config["lora_dropout"] = 0.0.into();
    config["target_modules"] = serde_json::json!(["q_proj"]);
    std::fs::write(peft.join("adapter_config.json"), config.to_string()).unwrap();
    let e = run(&["--adapter", path(&peft)]);
    assert!(
        e.contains("not a LoRA adapter of the configured targets (q_proj)"),
        "{e}"
    );
    // An adapter and a flag that contradicts it.
    let e = run(&["--adapter", path(&src), "--lora-rank", "8"]);
    assert!(e.contains("--lora-rank 8") && e.contains("rank 4"), "{e}");
    // grads with an adapter of another model.
    let e = fails(&[
        "grads",
        "--model",
        path(&model),
        "--adapter",
        path(&fixture("lora").join("gpt2_tiny")),
        "--tokens",
        path(&model.join("reference_grads.safetensors")),
        "--out",
        path(&dir.join("g.safetensors")),
    ]);
    assert!(e.contains("is not a projection of a Llama model"), "{e}");
}

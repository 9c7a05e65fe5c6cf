//! QLoRA from the command line: `grads --adapter --quantize-base nf4` against PEFT with
//! bitsandbytes, `train --quantize-base nf4` whose checkpoint exports the run's merged model,
//! `plan --quantize-base nf4` pricing the base at its 4-bit bytes, and bad input refused by name.

mod common;

use common::*;

#[test]
fn grads_on_a_4bit_base_equal_peft_with_bitsandbytes() {
    for (model, layout) in [
        ("llama_tiny", "tp=2,pp=2,mbs=2"),
        ("gpt2_tiny", "dp=3,zero=3,mbs=1"),
    ] {
        let dir = temp_dir(&format!("qlora-grads-{model}"));
        let out = dir.join("grads.safetensors");
        let adapter = fixture("qlora").join(model);
        let refs = adapter.join("qlora_reference.safetensors");
        let o = ferrotron(&[
            "grads",
            "--model",
            path(&fixture(model)),
            "--adapter",
            path(&adapter),
            "--quantize-base",
            "nf4",
            "--tokens",
            path(&refs),
            "--layout",
            layout,
            "--out",
            path(&out),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_adapter_grads(&out, &refs, &format!("{model} {layout}"));
    }
}

#[test]
fn a_qlora_run_exports_the_merged_model_it_trained() {
    let dir = temp_dir("qlora-train");
    let run = dir.join("run");
    let o = ferrotron(&[
        "train",
        "--model",
        path(&fixture("gpt2_tiny")),
        "--lora-rank",
        "2",
        "--quantize-base",
        "nf4",
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
    assert!(
        stderr(&o).contains("frozen (projections in nf4)"),
        "{}",
        stderr(&o)
    );
    let ck = run.join("checkpoints");
    let o = ferrotron(&["checkpoint", "inspect", path(&ck)]);
    let shown = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        shown.contains("its projections quantized to nf4"),
        "{shown}"
    );
    // Merged from the checkpoint, the base is quantized again as the run quantized it: the model
    // is the run's, bit for bit.
    let merged = dir.join("merged");
    let o = ferrotron(&[
        "checkpoint",
        "export",
        path(&ck),
        "--hf",
        path(&merged),
        "--merge",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        read_f32(&merged.join("model.safetensors")),
        read_f32(&run.join("model").join("model.safetensors"))
    );
}

#[test]
fn plan_prices_the_4bit_base_and_says_when_it_is_what_fits() {
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "llama3-70b",
            "--cluster",
            "dgx-h100-80g,devices_per_node=1",
            "--precision",
            "bf16",
            "--seq",
            "512",
            "--global-batch",
            "8",
            "--lora-rank",
            "16",
        ];
        args.extend_from_slice(extra);
        ferrotron(&args)
    };
    // 70B in bf16 needs 141 GB of weights: no layout of one 80 GB device fits. In NF4 it does.
    let o = plan(&[]);
    assert!(!o.status.success());
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &stderr(&o);
    assert!(
        text.contains("--quantize-base nf4") && text.contains("makes the run fit without a split"),
        "{text}"
    );
    let o = plan(&["--quantize-base", "nf4", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let weights = v["candidates"][0]["memory_bytes"]["weights"]
        .as_f64()
        .unwrap();
    // 68.4e9 projection parameters at ~0.516 bytes (35.3 GB), the embeddings (2.1e9) in bf16, the
    // adapters' compute copy.
    assert!(weights > 37e9 && weights < 42e9, "{weights}");
}

#[test]
fn bad_qlora_input_is_refused_by_name() {
    let dir = temp_dir("qlora-bad");
    let model = fixture("llama_tiny");
    let fails = |args: &[&str]| -> String {
        let o = ferrotron(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        stderr(&o)
    };
    let out = dir.join("run");
    let e = fails(&[
        "train",
        "--model",
        path(&model),
        "--quantize-base",
        "nf8",
        "--out-dir",
        path(&out),
    ]);
    assert!(e.contains("`nf8`") && e.contains("nf4"), "{e}");
    let e = fails(&[
        "train",
        "--model",
        path(&model),
        "--quantize-base",
        "nf4",
        "--out-dir",
        path(&out),
    ]);
    assert!(
        e.contains("quantize_base") && e.contains("lora_rank"),
        "{e}"
    );
    let e = fails(&[
        "grads",
        "--model",
        path(&model),
        "--quantize-base",
        "nf4",
        "--tokens",
        path(&fixture("llama_tiny").join("reference_grads.safetensors")),
        "--out",
        path(&dir.join("g.safetensors")),
    ]);
    assert!(
        e.contains("--quantize-base nf4") && e.contains("--adapter"),
        "{e}"
    );
    let e = fails(&[
        "plan",
        "--model",
        "llama-small",
        "--global-batch",
        "8",
        "--quantize-base",
        "nf4",
    ]);
    assert!(
        e.contains("--quantize-base") && e.contains("--lora-rank"),
        "{e}"
    );
}

//! 16,384 tokens per sequence on devices of 100 MB: one device is refused with the measured
//! per-term breakdown beside the planner's prediction, and cp=4 trains — as `plan` predicted for
//! both (the guide `docs/long-sequences.md` shows these runs; its commands run in `readme.rs`).

mod common;

use common::{ferrotron, fixture, temp_dir};

/// `ferrotron ARGS…`: whether it succeeded, and what it printed.
fn run(args: &[&str]) -> (bool, String) {
    let out = ferrotron(args);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &common::stderr(&out);
    (out.status.success(), text)
}

#[test]
fn sixteen_thousand_tokens_fit_over_cp4_and_not_on_one_device() {
    let model = fixture("llama_long");
    let model = model.to_str().unwrap();
    let plan = |layout: &str| {
        run(&[
            "plan",
            "--model",
            model,
            "--seq",
            "16384",
            "--global-batch",
            "1",
            "--cluster",
            "this-machine,devices_per_node=4,memory_gib=0.1",
            "--precision",
            "weights=fp32,grads=fp32,master=fp32,optimizer=fp32",
            "--layout",
            layout,
        ])
    };
    let (ok, one) = plan("mbs=1");
    assert!(
        ok && one.contains("DOES NOT FIT") && one.contains("largest term activations"),
        "{one}"
    );
    let (ok, four) = plan("cp=4,mbs=1");
    assert!(
        ok && four.contains("— fits") && four.contains("context parallel cp=4"),
        "{four}"
    );

    let dir = temp_dir("long");
    let train = |layout: &str, out: &str| {
        let out = dir.join(out);
        run(&[
            "train",
            "--model",
            model,
            "--data",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/gnu-manuals.txt"),
            "--seq-len",
            "16384",
            "--batch-size",
            "1",
            "--steps",
            "1",
            "--eval-every",
            "0",
            "--device-memory",
            "100MB",
            "--layout",
            layout,
            "--out-dir",
            out.to_str().unwrap(),
        ])
    };
    let (ok, refused) = train("", "one");
    assert!(
        !ok && refused.contains("device 0 is out of memory")
            && refused.contains("activations")
            && refused.contains("the planner predicted for this layout"),
        "{refused}"
    );
    let (ok, trained) = train("cp=4", "cp4");
    assert!(ok, "{trained}");
}

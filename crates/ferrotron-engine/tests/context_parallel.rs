//! Context parallelism at long sequences: the unsplit engine against PyTorch on a 1032-token
//! reference (`tests/fixtures/llama_long`, made by `make_reference.py --max-positions 2048 --seq
//! 1032`), and every context-parallel layout against the unsplit model on the same batch: the
//! loss and every gradient within 1e-5.

mod common;

use common::*;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::LoraConfig;
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::hf;
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::parallel::{pipeline_step, pipeline_steps_of};
use ferrotron_engine::transformer::Trained;
use std::time::Duration;

const TOL: f64 = 1e-5;

#[test]
fn the_unsplit_model_matches_pytorch_at_1032_tokens() {
    let (cfg, params) = hf::load_model(&fixture("llama_long")).unwrap();
    let reference = Reference::load("llama_long");
    assert!(reference.batch.seq >= 1024);
    let (loss, grads) = unsplit(&cfg, &params, &reference.batch);
    let want = reference.get("loss_f32")[0] as f64;
    let loss_err = (loss - want).abs() / want;
    assert!(loss_err <= 1e-6, "loss {loss} vs {want}: {loss_err:.2e}");
    let (name, worst) = worst_grad_err(&grads, &reference);
    println!("llama_long: loss rel {loss_err:.2e}, worst gradient {name} {worst:.2e}");
    assert!(worst <= TOL, "{name}: {worst:.3e}");
}

/// Every layout the issue names, each against the unsplit model (and so, through the test above,
/// against PyTorch) on the 1032-token batch.
#[test]
fn every_context_parallel_layout_equals_the_unsplit_model_at_1032_tokens() {
    let (cfg, params) = hf::load_model(&fixture("llama_long")).unwrap();
    let batch = Reference::load("llama_long").batch;
    let (want_loss, want) = unsplit(&cfg, &params, &batch);
    for spec in [
        "cp=2,mbs=2",
        "cp=3,mbs=2",
        "cp=4,mbs=1",
        "cp=2,cp_comm=a2a,mbs=2",
        "cp=2,tp=2,sp=true,mbs=2",
        "cp=2,pp=2,schedule=1f1b,mbs=1",
        "cp=2,pp=2,schedule=zbh1,mbs=1",
        "dp=2,cp=2,zero=3,mbs=1",
    ] {
        let l = LayoutSpec::parse(spec).unwrap().layout;
        let part = StagePartition::for_layout(&cfg, &l).unwrap();
        let run = pipeline_step(&cfg, &params, &batch, &l, &part, Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        let loss_err = (run.loss - want_loss).abs() / want_loss;
        let (mut worst, mut at) = (loss_err, "loss".to_string());
        for (s, (g, w)) in run
            .grads
            .specs
            .iter()
            .zip(run.grads.tensors.iter().zip(&want.tensors))
        {
            let e = rel_err(g, w);
            if e > worst {
                (worst, at) = (e, s.name.clone());
            }
        }
        println!("{spec}: worst {at} {worst:.2e}");
        assert!(worst <= TOL, "{spec}: {at} relative error {worst:.3e}");
    }
}

/// LoRA adapters on the frozen base, over cp=2: the adapters' gradients equal the unsplit ones.
#[test]
fn lora_over_context_parallelism_equals_the_unsplit_adapters() {
    let (cfg, params) = hf::load_model(&fixture("llama_long")).unwrap();
    let batch = Reference::load("llama_long").batch;
    let lora = LoraConfig::new(&cfg, 4, 8.0, &[]).unwrap();
    let adapters = Adapters::init(&cfg, lora.clone(), 3);
    let run = |spec: &str| {
        let l = LayoutSpec::parse(spec).unwrap().layout;
        let part = StagePartition::for_layout(&cfg, &l).unwrap();
        let trained = Trained::lora(&params, &lora, &adapters.params);
        pipeline_steps_of(
            &cfg,
            trained,
            &batch,
            &l,
            &part,
            Duration::from_secs(120),
            0,
        )
        .unwrap()
    };
    let (want, got) = (run("mbs=2"), run("cp=2,mbs=2"));
    let (at, worst) = worst_run_err(&got, &want);
    assert!(worst <= TOL, "{at}: {worst:.3e}");
}

/// Sequences that do not split into 2·cp chunks, and all-to-all over heads that do not divide,
/// are refused naming the rule.
#[test]
fn splits_that_cannot_be_made_are_refused_by_rule() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = random_batch(cfg.vocab_size, 2, 30, 1);
    let err = |spec: &str, batch: &ferrotron_engine::transformer::TokenBatch| {
        let l = LayoutSpec::parse(spec).unwrap().layout;
        let part = StagePartition::for_layout(&cfg, &l).unwrap();
        match pipeline_step(&cfg, &params, batch, &l, &part, Duration::from_secs(30)) {
            Ok(_) => panic!("{spec} ran"),
            Err(e) => e.to_string(),
        }
    };
    let e = err("cp=4", &batch);
    assert!(
        e.contains("cp=4") && e.contains("30 tokens") && e.contains("multiple of 8"),
        "{e}"
    );
    // llama_tiny has 4 query heads and 2 KV heads: a2a over 8 devices cannot split them.
    let e = err("cp=8,cp_comm=a2a", &random_batch(cfg.vocab_size, 2, 32, 1));
    assert!(
        e.contains("cp_comm=a2a") && e.contains("query heads (4") && e.contains("ring"),
        "{e}"
    );
}

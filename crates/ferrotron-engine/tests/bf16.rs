//! bf16 compute: the single-device step against PyTorch's f64 reference, and every layout up to 8
//! devices against the unsplit bf16 step, within tolerances derived from bf16's rounding (and a
//! deliberately wrong split outside them).

mod common;

use common::*;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::comm::ThreadWorld;
use ferrotron_engine::hf;
use ferrotron_engine::parallel::{MeshStep, PipelineRun};
use ferrotron_engine::transformer::{ParamStore, TokenBatch};
use std::time::Duration;

/// bf16's unit roundoff: 8 significant bits, rounding to nearest.
const U: f64 = 1.0 / 256.0;

/// One bf16 step of `spec` (bf16 weights, activations and gradients, bf16 products): the mean loss
/// and every gradient, gathered.
fn bf16_step(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    spec: &str,
) -> PipelineRun {
    let l = LayoutSpec::parse(spec).unwrap().layout;
    let part = StagePartition::for_model(cfg, l.pp * l.vpp).unwrap();
    let step = MeshStep::new(cfg, params, batch, &l, &part)
        .unwrap()
        .with_precision(MixedPrecision::Bf16);
    let results = ThreadWorld::new(step.world())
        .timeout(Duration::from_secs(60))
        .run(|c| step.run_device(c, 0));
    let results = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    step.combine(results, 0.0).unwrap()
}

/// The rounding stages a gradient of `spec` passes beyond the unsplit step's, and the unsplit
/// step's own, on a model of `layers` blocks: the tolerance of the comparison is `√D · u`.
///
/// Both runs round the same values at the same places (weights once from the same master; the
/// activation stash; the GEMM operands), but a split sums in another order in f32, so a value that
/// lies within ~2⁻²⁴ of a rounding boundary can round the other way: each such stage can differ
/// by one rounding, at most `u` relative, and the roundings are independent and unbiased, so over
/// `D` stages the norm-wise relative difference of a tensor grows like `√D · u` (a random walk),
/// not `D · u` (which no element reaches). The stages on a gradient's path: per block, forward and
/// backward, the stashed input of its matmuls, the projections' operands and attention's operands
/// (Q·Kᵀ and P·V, and their gradients', on the bf16 instructions: 3 each way); and what a
/// split adds: a tensor-parallel block sends its partial sums in bf16 (2 reductions each way), a
/// pipeline boundary crosses in bf16 (each way), micro-batches accumulate in bf16 storage (one
/// rounding each), the replicas' ring (dp × cp: context-parallel devices' gradients are partial
/// sums too) rounds after each of its `replicas − 1` additions. Context parallelism's attention
/// messages are f32 and its blocks merge in f32: no rounding of their own.
fn tolerance(layers: usize, spec: &str) -> f64 {
    let l = LayoutSpec::parse(spec).unwrap().layout;
    let micro_batches = 8 / (l.micro_batch_size * l.dp);
    let per_block = 2 * 3 + if l.tp > 1 { 2 * 2 } else { 0 };
    let stages = layers * per_block + 2 * (l.pp - 1) + micro_batches + (l.replicas() - 1) + 1;
    (stages as f64).sqrt() * U
}

/// Loss and every gradient of `got` within `tol` (norm-wise relative) of `want`.
fn within(got: &PipelineRun, want: &PipelineRun, tol: f64) -> Result<f64, String> {
    let loss_err = (got.loss - want.loss).abs() / want.loss.abs();
    if loss_err > tol {
        return Err(format!(
            "loss {} vs {} ({loss_err:.2e})",
            got.loss, want.loss
        ));
    }
    let mut worst = loss_err;
    for (s, (g, w)) in got
        .grads
        .specs
        .iter()
        .zip(got.grads.tensors.iter().zip(&want.grads.tensors))
    {
        let e = rel_err(g, w);
        if e > tol {
            return Err(format!("{}: {e:.2e} > {tol:.2e}", s.name));
        }
        worst = worst.max(e);
    }
    Ok(worst)
}

/// The single-device bf16 step against PyTorch in f64. The bf16 step rounds the weights, each
/// block's stashed activations, its projections' and attention's operands, and the gradients once
/// each: with the same `√D · u` growth over those stages (6 per block, forward and backward, and the
/// weights' and the gradients' own), every gradient and the loss lie within `√D · u` of the exact
/// values.
#[test]
fn the_bf16_step_matches_pytorch_f64_within_the_bf16_bound() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let reference = Reference::load(model);
        let mbs = format!("mbs={}", reference.batch.batch);
        let run = bf16_step(&cfg, &params, &reference.batch, &mbs);
        let stages = cfg.num_layers * 2 * 3 + 2;
        let tol = (stages as f64).sqrt() * U;
        let want = reference.get_f64(model, "loss_f64")[0];
        let loss_err = (run.loss - want).abs() / want;
        println!(
            "{model}: bf16 loss {} vs f64 {want} ({loss_err:.2e}), bound {tol:.2e}",
            run.loss
        );
        assert!(loss_err <= tol, "{model}: loss {loss_err:.3e} > {tol:.3e}");
        for (s, g) in run.grads.specs.iter().zip(&run.grads.tensors) {
            let e = rel_err_f64(
                g,
                &reference.get_f64(model, &format!("grad_f64.{}", s.name)),
            );
            println!("  {:45} {e:.2e}", s.name);
            assert!(e <= tol, "{model}: {} {e:.3e} > {tol:.3e}", s.name);
        }
    }
}

/// Every family of layout on up to 8 devices, each against the unsplit bf16 step.
const LAYOUTS: &[&str] = &[
    "tp=2,mbs=8",
    "tp=4,mbs=8",
    "tp=2,sp=true,mbs=8",
    "tp=4,sp=true,mbs=4",
    "pp=2,mbs=2",
    "pp=4,mbs=1",
    "pp=2,schedule=gpipe,mbs=2",
    "pp=2,schedule=zbh1,mbs=2",
    "pp=2,vpp=2,schedule=interleaved,mbs=1",
    "dp=2,mbs=4",
    "dp=4,zero=1,mbs=2",
    "dp=8,zero=2,mbs=1",
    "dp=2,zero=3,mbs=2",
    "dp=2,tp=2,mbs=2",
    "tp=2,pp=2,mbs=2",
    "dp=2,pp=2,zero=2,mbs=2",
    "dp=2,tp=2,pp=2,mbs=1",
    "dp=2,tp=2,pp=2,zero=1,mbs=1",
    "dp=2,tp=2,pp=2,zero=3,mbs=1",
    "dp=2,tp=2,pp=2,sp=true,recompute=full,mbs=1",
    "tp=2,pp=2,recompute=selective,mbs=2",
    "cp=2,mbs=8",
    "cp=4,mbs=8",
    "cp=4,cp_comm=a2a,mbs=8",
    "dp=2,cp=2,tp=2,zero=1,mbs=4",
];

#[test]
fn every_layout_up_to_8_devices_matches_the_unsplit_bf16_step() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = random_batch(cfg.vocab_size, 8, 16, 11);
        let unsplit = bf16_step(&cfg, &params, &batch, "mbs=8");
        for spec in LAYOUTS {
            let tol = tolerance(cfg.num_layers, spec);
            let got = bf16_step(&cfg, &params, &batch, spec);
            match within(&got, &unsplit, tol) {
                Ok(worst) => println!("{model} {spec}: worst {worst:.2e} (tolerance {tol:.2e})"),
                Err(e) => panic!("{model} {spec}: {e}"),
            }
        }
    }
}

/// The comparison catches a wrong split: a row-parallel layer whose bias each of its two shards
/// adds (so twice) is far outside the tolerance.
#[test]
fn a_split_that_adds_a_shards_bias_twice_fails_the_bf16_tolerance() {
    let (cfg, mut params) = hf::load_model(&fixture("gpt2_tiny")).unwrap();
    let batch = random_batch(cfg.vocab_size, 8, 16, 11);
    // The fixture's biases are zero (as Hugging Face initialises them): give this one values.
    let i = params
        .specs
        .iter()
        .position(|s| s.name == "transformer.h.0.mlp.c_proj.bias")
        .unwrap();
    let bias: Vec<f32> = (0..params.tensors[i].len())
        .map(|j| 0.05 * (j as f32).sin())
        .collect();
    params.tensors[i] = bias;
    let unsplit = bf16_step(&cfg, &params, &batch, "mbs=8");
    let spec = "tp=2,mbs=8";
    let tol = tolerance(cfg.num_layers, spec);
    assert!(within(&bf16_step(&cfg, &params, &batch, spec), &unsplit, tol).is_ok());
    // Both shards adding the row-parallel bias after the reduction computes what doubling it does.
    let mut wrong = params.clone();
    wrong.tensors[i].iter_mut().for_each(|b| *b *= 2.0);
    let err = within(&bf16_step(&cfg, &wrong, &batch, spec), &unsplit, tol)
        .expect_err("a doubled bias is outside the bf16 tolerance");
    println!("wrong split: {err}");
}

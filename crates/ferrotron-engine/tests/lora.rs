//! LoRA against PEFT: the loss and every adapter gradient of the tiny Llama and GPT-2 models with
//! PEFT's own adapters (rank 4, alpha 8, random `B`), on one device and on every split — tensor
//! parallelism with and without sequence parallelism, pipelines under every schedule, data
//! parallelism under ZeRO 0–3 and a 3D mesh of 8 devices.

mod common;

use common::*;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::{ModelConfig, PEFT_PREFIX};
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::runtime::layout_step_of;
use ferrotron_engine::transformer::{ParamStore, Trained};

/// f32 tolerance, as for the model's own gradients: PEFT's f32 and f64 adapter gradients differ
/// by ~3e-6 per tensor, and an independent f32 implementation sums in other orders.
const GRAD_TOL: f64 = 1e-5;
const LOSS_TOL: f64 = 1e-6;

struct Case {
    cfg: ModelConfig,
    base: ParamStore,
    adapters: Adapters,
    reference: Reference,
}

fn case(model: &str) -> Case {
    let (cfg, base) = hf::load_model(&fixture(model)).unwrap();
    let adapters = Adapters::load_peft(&fixture("lora").join(model), &cfg).unwrap();
    Case {
        cfg,
        base,
        adapters,
        reference: Reference::lora(model),
    }
}

/// The loss and adapter gradients of `layout` against PEFT's f32 reference; returns the worst
/// relative gradient error.
fn check(c: &Case, model: &str, layout: &str) -> f64 {
    let layout = LayoutSpec::parse(layout).unwrap().layout;
    let trained = Trained::lora(&c.base, &c.adapters.config, &c.adapters.params);
    let (loss, grads, _) = layout_step_of(
        &c.cfg,
        trained,
        &c.reference.batch,
        &layout,
        &CpuBackend::default(),
    )
    .unwrap_or_else(|e| panic!("{model} {layout}: {e}"));
    let want = c.reference.get("loss_f32")[0] as f64;
    let loss_err = (loss - want).abs() / want;
    assert!(
        loss_err <= LOSS_TOL,
        "{model} {layout}: loss {loss} vs PEFT {want} ({loss_err:.2e})"
    );
    assert_eq!(grads.specs.len(), c.adapters.params.specs.len());
    let mut worst = 0f64;
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        let name = format!("grad_f32.{PEFT_PREFIX}{}", spec.name);
        let e = rel_err(g, c.reference.get(&name));
        assert!(
            e <= GRAD_TOL,
            "{model} {layout}: {} rel err {e:.3e}",
            spec.name
        );
        worst = worst.max(e);
    }
    println!("{model} {layout}: loss rel {loss_err:.1e}, worst adapter gradient {worst:.1e}");
    worst
}

#[test]
fn one_device_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        check(&c, model, "");
        // Against the f64 reference too: the bound holds against the exact gradients.
        let trained = Trained::lora(&c.base, &c.adapters.config, &c.adapters.params);
        let (_, grads, _) = layout_step_of(
            &c.cfg,
            trained,
            &c.reference.batch,
            &Default::default(),
            &CpuBackend::default(),
        )
        .unwrap();
        for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
            let name = format!("grad_f64.{PEFT_PREFIX}{}", spec.name);
            let e = rel_err_f64(g, &c.reference.get_f64(model, &name));
            assert!(e <= GRAD_TOL, "{model}: {} vs f64 {e:.3e}", spec.name);
        }
    }
}

#[test]
fn tensor_parallel_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in ["tp=2", "tp=2,sp=true", "tp=4", "tp=4,sp=true"] {
            check(&c, model, layout);
        }
    }
}

#[test]
fn pipelines_match_peft_under_every_schedule() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in [
            "pp=2,mbs=1,schedule=gpipe",
            "pp=2,mbs=1,schedule=1f1b",
            "pp=2,mbs=1,schedule=zbh1",
            "pp=2,vpp=2,mbs=1,schedule=interleaved",
            "pp=4,mbs=1,schedule=gpipe",
            "pp=4,mbs=1,schedule=1f1b",
            "pp=4,mbs=1,schedule=zbh1",
            "pp=2,mbs=1,recompute=full",
            "pp=2,mbs=1,recompute=selective,schedule=zbh1",
        ] {
            check(&c, model, layout);
        }
    }
}

#[test]
fn data_parallel_matches_peft_under_every_zero_stage() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for zero in 0..=3 {
            check(&c, model, &format!("dp=2,mbs=1,zero={zero}"));
        }
    }
}

#[test]
fn a_3d_mesh_of_8_devices_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for zero in [1, 3] {
            check(&c, model, &format!("dp=2,tp=2,pp=2,mbs=1,zero={zero}"));
        }
        check(&c, model, "dp=2,tp=2,pp=2,mbs=1,sp=true,schedule=zbh1");
    }
}

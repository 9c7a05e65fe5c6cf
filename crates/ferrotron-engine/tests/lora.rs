//! LoRA against PEFT: the loss and every adapter gradient of the tiny Llama and GPT-2 models with
//! PEFT's own adapters (rank 4, alpha 8, random `B`), on one device and on every split — tensor
//! parallelism with and without sequence parallelism, pipelines under every schedule, data
//! parallelism under ZeRO 0–3 and a 3D mesh of 8 devices.

mod common;

use common::*;
use ferrotron_engine::hf;
use ferrotron_engine::lora::Adapters;

fn case(model: &str) -> LoraCase {
    let (cfg, base) = hf::load_model(&fixture(model)).unwrap();
    let adapters = Adapters::load_peft(&fixture("lora").join(model), &cfg).unwrap();
    LoraCase {
        cfg,
        base,
        adapters,
        reference: Reference::lora(model),
    }
}

#[test]
fn one_device_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        check_lora(&c, model, "");
        check_lora_f64(&c, model);
    }
}

#[test]
fn tensor_parallel_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in ["tp=2", "tp=2,sp=true", "tp=4", "tp=4,sp=true"] {
            check_lora(&c, model, layout);
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
            check_lora(&c, model, layout);
        }
    }
}

#[test]
fn data_parallel_matches_peft_under_every_zero_stage() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for zero in 0..=3 {
            check_lora(&c, model, &format!("dp=2,mbs=1,zero={zero}"));
        }
    }
}

#[test]
fn a_3d_mesh_of_8_devices_matches_peft() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for zero in [1, 3] {
            check_lora(&c, model, &format!("dp=2,tp=2,pp=2,mbs=1,zero={zero}"));
        }
        check_lora(&c, model, "dp=2,tp=2,pp=2,mbs=1,sp=true,schedule=zbh1");
    }
}

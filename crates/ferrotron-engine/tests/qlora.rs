//! QLoRA against PEFT with bitsandbytes: the tiny Llama and GPT-2 with their projections quantized
//! to NF4 (double quantization, as transformers' 4-bit loading does it) and PEFT's adapters
//! (rank 4, alpha 8, random `B`) beside them. The quantized storage and every dequantized weight
//! equal bitsandbytes' bit for bit; the loss and every adapter gradient equal PEFT's on one device
//! and on every split. The reference (`tests/fixtures/qlora/`, `make_qlora_reference.py`) runs
//! bitsandbytes' PyTorch path, which follows the NF4 definition.

mod common;

use common::*;
use ferrotron_core::precision::BaseQuantization;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::nf4::{dynamic_map, NF4_CODE};
use ferrotron_engine::lora::Adapters;
use ferrotron_engine::memory;
use ferrotron_engine::storage::Location;

fn case(model: &str) -> LoraCase {
    // The references' PyTorch summed in 8 lanes (an AVX2 machine; tests/fixtures/README.md).
    ferrotron_engine::kernels::nf4::reproduce_torch_lanes(8);
    let cfg = hf::read_config(&fixture(model)).unwrap();
    let base = hf::load_params_as(
        &Location::Local(fixture(model)),
        &cfg,
        Some(BaseQuantization::Nf4),
    )
    .unwrap();
    let dir = fixture("qlora").join(model);
    let adapters = Adapters::load_peft(&dir, &cfg).unwrap();
    let reference = Reference::from_file(dir.join("qlora_reference.safetensors"));
    LoraCase {
        cfg,
        base,
        adapters,
        reference,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn quantized_storage_and_dequantized_weights_equal_bitsandbytes_bit_for_bit() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        let r = &c.reference;
        assert_eq!(
            bits(&dynamic_map()),
            bits(r.get("dynamic_map")),
            "{model}: code book"
        );
        assert_eq!(
            bits(&NF4_CODE),
            bits(r.get("nf4_code")),
            "{model}: NF4 values"
        );
        let mut quantized = 0;
        for (spec, m) in c.base.specs.iter().zip(&c.base.nf4) {
            let Some(m) = m else { continue };
            let module = spec.name.strip_suffix(".weight").unwrap();
            let (codes, absmax_q, scales, offset) = m.storage();
            let as_f32 = |v: &[u8]| v.iter().map(|&b| b as f32).collect::<Vec<_>>();
            let want = |k: &str| r.get(&format!("nf4.{module}.{k}"));
            assert_eq!(as_f32(codes), want("codes"), "{model} {module}: codes");
            assert_eq!(
                as_f32(absmax_q),
                want("absmax_q"),
                "{model} {module}: absmax codes"
            );
            assert_eq!(
                bits(scales),
                bits(want("absmax2")),
                "{model} {module}: scales"
            );
            assert_eq!(
                offset.to_bits(),
                want("offset")[0].to_bits(),
                "{model} {module}: offset"
            );
            let deq = r.get(&format!("dequant.{}", spec.name));
            assert_eq!(bits(&m.dequantized()), bits(deq), "{model} {}", spec.name);
            quantized += 1;
        }
        // Every projection, nothing else: 7 a layer in Llama, 4 in GPT-2.
        assert_eq!(
            quantized,
            if model == "llama_tiny" { 28 } else { 16 },
            "{model}"
        );
        // Quantized after loading, the same base.
        let (_, mut after) = hf::load_model(&fixture(model)).unwrap();
        after.quantize_nf4(&c.cfg);
        assert!(
            after == c.base,
            "{model}: quantized as read or after, the same base"
        );
        for (spec, (t, m)) in c
            .base
            .specs
            .iter()
            .zip(c.base.tensors.iter().zip(&c.base.nf4))
        {
            assert_eq!(
                m.is_some(),
                t.is_empty(),
                "{}: no f32 copy beside the codes",
                spec.name
            );
        }
    }
}

#[test]
fn one_device_matches_peft_on_bitsandbytes() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        check_lora(&c, model, "");
        // Against the f64 reference (the same adapters on the dequantized base).
        check_lora_f64(&c, model);
    }
}

#[test]
fn tensor_parallel_matches_peft_on_bitsandbytes() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in ["tp=2", "tp=2,sp=true"] {
            check_lora(&c, model, layout);
        }
    }
}

#[test]
fn pipelines_match_peft_on_bitsandbytes() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in ["pp=3,mbs=2,schedule=1f1b", "pp=3,mbs=2,schedule=zbh1"] {
            check_lora(&c, model, layout);
        }
    }
}

#[test]
fn data_parallel_matches_peft_on_bitsandbytes_under_zero_2_and_3() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for zero in [2, 3] {
            check_lora(&c, model, &format!("dp=3,mbs=1,zero={zero}"));
        }
    }
}

#[test]
fn a_3d_mesh_matches_peft_on_bitsandbytes() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        check_lora(
            &c,
            model,
            "dp=3,tp=2,pp=2,mbs=1,zero=3,sp=true,schedule=zbh1",
        );
    }
}

#[test]
fn context_parallel_matches_peft_on_bitsandbytes() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let c = case(model);
        for layout in ["cp=2", "cp=2,tp=2,sp=true"] {
            check_lora(&c, model, layout);
        }
    }
}

#[test]
fn a_quantized_base_loads_without_an_f32_copy_of_the_model() {
    let (dir, device) = (fixture("llama_tiny"), 43);
    let cfg = hf::read_config(&dir).unwrap();
    memory::set_device(device);
    memory::reset_peaks(device);
    let base = hf::load_params_as(
        &Location::Local(dir.clone()),
        &cfg,
        Some(BaseQuantization::Nf4),
    )
    .unwrap();
    let peak = memory::device_memory(device).peak_total as f64;
    memory::clear_device();
    let f32_bytes = 4.0 * cfg.num_params() as f64;
    // The embeddings and the head stay f32 (262 KB of llama_tiny's 1 MB); the projections are read
    // one at a time, each quantized before the next.
    println!("loading peak {peak} bytes against {f32_bytes} in f32");
    assert!(
        peak < 0.5 * f32_bytes,
        "loading peak {peak} bytes, the f32 model {f32_bytes}"
    );
    assert!(base.is_quantized());
}

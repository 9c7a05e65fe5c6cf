//! `bench qlora`: LoRA on an NF4 base against LoRA on the 16- or 32-bit base, side by side in one
//! run, through the training loop on one device: tokens/s, the weights term measured by the
//! tracking allocator beside the planner's, and the base's bytes per quantized parameter.

use super::bench_lora::{setup, LoraBenchArgs, Measured, Numerics};
use anyhow::Result;
use ferrotron_core::precision::{BaseQuantization, MixedPrecision};
use ferrotron_engine::memory::format_bytes;
use ferrotron_engine::transformer::Trained;

pub fn run(a: LoraBenchArgs) -> Result<()> {
    let s = setup(&a)?;
    let (cfg, lora, threads) = (&s.cfg, &s.lora, s.threads);
    let mut quantized = s.base.clone();
    quantized.quantize_nf4(cfg);
    let (bytes, params) = quantized
        .nf4
        .iter()
        .zip(&quantized.specs)
        .filter_map(|(q, s)| q.as_ref().map(|q| (q.bytes(), s.numel())))
        .fold((0, 0), |(b, n), (qb, qn)| (b + qb, n + qn));
    println!(
        "ferrotron bench qlora: {} ({:.2}M parameters; {:.2}M in projections, quantized), batch {} x \
         seq {} in micro-batches of {}, AdamW, {threads} threads, one device through the training \
         loop; LoRA rank {}, alpha {} on {}",
        a.model,
        cfg.num_params() as f64 / 1e6,
        params as f64 / 1e6,
        a.batch,
        a.seq,
        a.mbs,
        lora.rank,
        lora.alpha,
        lora.targets.join(", ")
    );
    println!(
        "NF4 projections hold {} for {params} parameters: {:.4} bytes a parameter (codes, 8-bit \
         absmax a block of 64, f32 scale a group of 256 blocks)\n",
        format_bytes(bytes as u64),
        bytes as f64 / params as f64
    );
    println!(
        "| precision | base | tokens/s | NF4 / unquantized | weights measured / predicted | total measured / predicted |"
    );
    println!("|---|---|---|---|---|---|");
    let tokens = (a.batch * a.seq) as f64;
    for precision in [MixedPrecision::Bf16, MixedPrecision::F32] {
        let run = |store, q: Option<BaseQuantization>| {
            let trained = Trained::lora(store, lora, &s.adapters.params);
            let numerics = Numerics {
                precision,
                quantized: q,
            };
            s.measure(trained, Some(lora), numerics)
        };
        let plain = run(&s.base, None)?;
        let nf4 = run(&quantized, Some(BaseQuantization::Nf4))?;
        let row = |name: &str, m: &Measured, ratio: String| {
            println!(
                "| {} | {name} | {:.1} | {ratio} | {} / {} | {} / {} |",
                precision.name(),
                tokens / m.step_s,
                format_bytes(m.memory.weights),
                format_bytes(m.predicted.weights),
                format_bytes(m.memory.total),
                format_bytes(m.predicted.total)
            )
        };
        let unquantized = match precision {
            MixedPrecision::F32 => "f32",
            _ => "bf16",
        };
        row(unquantized, &plain, String::new());
        row("nf4", &nf4, format!("{:.3}", plain.step_s / nf4.step_s));
    }
    Ok(())
}

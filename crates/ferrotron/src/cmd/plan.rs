use anyhow::Result;
use clap::Args;
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::plan::{
    self, search_notes, ActivationModel, OptimizerKind, Plan, PlanInput, PlanModel, Precision,
};
use ferrotron_core::topology::Cluster;
use serde_json::json;

#[derive(Args)]
pub struct PlanArgs {
    /// A config.json (or its directory), a preset (gpt3-175b, llama2-7b, llama3-70b, …), an inline
    /// shape `arch=gpt,layers=96,hidden=12288,heads=96,kv_heads=96,ffn=49152,vocab=51200`, or `params=7.5e9`.
    #[arg(long)]
    model: String,
    /// A preset (dgx-a100-80g, dgx-h100-80g, this-machine), optionally with overrides
    /// (`dgx-a100-80g,nodes=4`), or inline keys `nodes,devices_per_node,memory_gib,peak_tflops,intra_gbs,inter_gbs`.
    #[arg(long, default_value = "this-machine")]
    cluster: String,
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    #[arg(long)]
    global_batch: usize,
    /// Evaluate this layout; without it (or with `auto` values) search.
    #[arg(long)]
    layout: Option<String>,
    /// Storage dtypes: weights=bf16,grads=bf16,master=fp32,optimizer=fp32 (the default).
    #[arg(long, default_value = "")]
    precision: String,
    #[arg(long, default_value = "adam")]
    optimizer: String,
    #[arg(long, default_value = "ferrotron")]
    activation_model: String,
    /// LoRA rank: frozen base weights, trainable state for the adapters only.
    #[arg(long)]
    lora_rank: Option<usize>,
    /// Fraction of device memory kept free.
    #[arg(long, default_value_t = 0.1)]
    reserve: f64,
    /// Allow tensor-parallel groups across nodes (priced on the slow link).
    #[arg(long)]
    force_cross_node_tp: bool,
    /// How many candidates a search prints.
    #[arg(long, default_value_t = 5)]
    top: usize,
    #[arg(long)]
    json: bool,
    /// Also write the predicted pictures (timeline, memory per stage) and an HTML report of the
    /// evaluated layout (or the search's best) into this directory.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn plan_json(p: &Plan) -> serde_json::Value {
    let l = &p.layout;
    json!({
        "layout": {
            "dp": l.dp, "tp": l.tp, "pp": l.pp, "vpp": l.vpp, "zero": l.zero,
            "micro_batch_size": l.micro_batch_size, "num_micro_batches": p.num_micro_batches,
            "schedule": l.schedule.name(), "recompute": l.recompute.name(), "sequence_parallel": l.sequence_parallel,
            "spec": l.to_string(),
        },
        "memory_bytes": p.memory_bytes,
        "memory_bytes_per_stage": p.memory_bytes_per_stage,
        "capacity_bytes": p.capacity_bytes,
        "usable_bytes": p.usable_bytes,
        "comm_bytes_per_step": p.comm_bytes_per_step,
        "bubble_fraction": p.bubble_fraction,
        "compute_time_s": p.compute_time_s,
        "dp_comm_time_s": p.dp_comm_time_s,
        "step_time_s": p.step_time_s,
        "tokens_per_s": p.tokens_per_s,
        "tflops_per_device": p.tflops_per_device,
        "mfu": p.mfu,
        "fits": p.fits,
        "explain": p.explain,
    })
}

fn gb(b: u64) -> String {
    format!("{:.2}", b as f64 / 1e9)
}

/// One bar per stage, a letter per term, scaled to the device's capacity.
fn memory_bars(p: &Plan) -> String {
    const WIDTH: f64 = 50.0;
    let mut out = String::from("memory per device (W weights, G gradients, M master, O optimizer, A activations, C comm; | = usable limit)\n");
    let scale = WIDTH / p.capacity_bytes as f64;
    let limit = (p.usable_bytes as f64 * scale).round() as usize;
    for (s, m) in p.memory_bytes_per_stage.iter().enumerate() {
        let mut bar = String::new();
        for ((_, bytes), ch) in m.terms().iter().zip(['W', 'G', 'M', 'O', 'A', 'C']) {
            bar.extend(std::iter::repeat_n(
                ch,
                (*bytes as f64 * scale).round() as usize,
            ));
        }
        let mut cells: Vec<char> = bar.chars().collect();
        if cells.len() < limit {
            cells.resize(limit, '.');
        }
        cells.insert(limit.min(cells.len()), '|');
        out.push_str(&format!(
            "  stage {s:>3} {} {} GB\n",
            cells.into_iter().collect::<String>(),
            gb(m.total)
        ));
    }
    out
}

fn print_plan(p: &Plan) {
    println!(
        "layout {}  ({} micro-batches) — {}",
        p.layout,
        p.num_micro_batches,
        if p.fits { "fits" } else { "DOES NOT FIT" }
    );
    print!("{}", memory_bars(p));
    println!("| stage | weights | gradients | master | optimizer | activations | comm | total (GB) |\n|---|---|---|---|---|---|---|---|");
    for (s, m) in p.memory_bytes_per_stage.iter().enumerate() {
        println!(
            "| {s} | {} | {} | {} | {} | {} | {} | {} |",
            gb(m.weights),
            gb(m.gradients),
            gb(m.master_weights),
            gb(m.optimizer_states),
            gb(m.activations),
            gb(m.comm_buffers),
            gb(m.total)
        );
    }
    let c = &p.comm_bytes_per_step;
    println!(
        "bytes per step per device: tp {:.3} GB, pp {:.3} GB, dp {:.3} GB | bubble {:.1}% | step {:.4} s | {:.0} tokens/s | {:.2} TFLOP/s per device | MFU {:.1}%",
        c.tp / 1e9,
        c.pp / 1e9,
        c.dp / 1e9,
        p.bubble_fraction * 100.0,
        p.step_time_s,
        p.tokens_per_s,
        p.tflops_per_device,
        p.mfu * 100.0
    );
    for line in &p.explain {
        println!("  - {line}");
    }
}

/// True when `l` agrees with every key the user gave explicitly (not `auto`).
fn matches_given(spec: &LayoutSpec, l: &Layout) -> bool {
    let want = &spec.layout;
    spec.given_keys
        .iter()
        .filter(|k| !spec.auto_keys.contains(k))
        .all(|k| match k.as_str() {
            "dp" => l.dp == want.dp,
            "tp" => l.tp == want.tp,
            "pp" => l.pp == want.pp,
            "vpp" => l.vpp == want.vpp,
            "zero" => l.zero == want.zero,
            "mbs" => l.micro_batch_size == want.micro_batch_size,
            "schedule" => l.schedule == want.schedule,
            "sp" => l.sequence_parallel == want.sequence_parallel,
            "recompute" => l.recompute == want.recompute,
            _ => true,
        })
}

pub fn input_from(
    model: &str,
    cluster: &str,
    seq: usize,
    global_batch: usize,
    precision: &str,
    optimizer: &str,
    activation_model: &str,
) -> Result<PlanInput> {
    Ok(PlanInput {
        model: PlanModel::parse(model)?,
        cluster: Cluster::parse(cluster)?,
        seq,
        global_batch,
        precision: Precision::parse(precision)?,
        optimizer: OptimizerKind::parse(optimizer)?,
        activation_model: ActivationModel::parse(activation_model)?,
        lora_rank: None,
        memory_reserve: 0.1,
        force_cross_node_tp: false,
    })
}

pub fn run(a: PlanArgs) -> Result<()> {
    if !(0.0..1.0).contains(&a.reserve) {
        anyhow::bail!("--reserve: {} is not a fraction in [0, 1)", a.reserve);
    }
    let mut input = input_from(
        &a.model,
        &a.cluster,
        a.seq,
        a.global_batch,
        &a.precision,
        &a.optimizer,
        &a.activation_model,
    )?;
    input.lora_rank = a.lora_rank;
    input.memory_reserve = a.reserve;
    input.force_cross_node_tp = a.force_cross_node_tp;
    let spec = a.layout.as_deref().map(LayoutSpec::parse).transpose()?;
    match spec {
        Some(spec) if spec.auto_keys.is_empty() => {
            let p = plan::evaluate(&input, &spec.layout)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&plan_json(&p))?);
            } else {
                print_plan(&p);
            }
            if let Some(dir) = &a.out {
                write_pictures(dir, &input, &p)?;
            }
        }
        spec => {
            let mut plans = plan::search(&input)?;
            if let Some(spec) = &spec {
                plans.retain(|p| matches_given(spec, &p.layout));
            }
            let notes = search_notes(&input, plans.first());
            if a.json {
                let c: Vec<_> = plans.iter().take(a.top.max(1)).map(plan_json).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({ "candidates": c, "explain": notes }))?
                );
            } else {
                println!("why:");
                for n in &notes {
                    println!("  {n}");
                }
                for (i, p) in plans.iter().take(a.top).enumerate() {
                    println!("\n#{} ", i + 1);
                    print_plan(p);
                }
                if plans.is_empty() {
                    anyhow::bail!("no layout fits this model on this cluster");
                }
            }
            if let (Some(dir), Some(best)) = (&a.out, plans.first()) {
                write_pictures(dir, &input, best)?;
            }
        }
    }
    Ok(())
}

/// The predicted pictures and a report page of `p`, into `dir`.
fn write_pictures(dir: &std::path::Path, input: &plan::PlanInput, p: &plan::Plan) -> Result<()> {
    let (timeline, memory) = crate::report::predicted_pictures(input, p)?;
    std::fs::create_dir_all(dir)?;
    let mut sections = vec![("plan", serde_json::to_string_pretty(&plan_json(p))?)];
    if let Some(t) = &timeline {
        std::fs::write(dir.join("timeline_predicted.svg"), t)?;
        sections.push(("timeline: predicted", t.clone()));
    }
    std::fs::write(dir.join("memory_predicted.svg"), &memory)?;
    sections.push(("memory: predicted", memory));
    let html = crate::report::html_report(&format!("ferrotron plan: {}", p.layout), &sections);
    std::fs::write(dir.join("report.html"), html)?;
    println!(
        "pictures written to {}: timeline_predicted.svg, memory_predicted.svg, report.html",
        dir.display()
    );
    Ok(())
}

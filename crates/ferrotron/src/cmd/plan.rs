use crate::report::plan::PlanPage;
use anyhow::Result;
use clap::Args;
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::plan::{
    self, search_notes, ActivationModel, AttentionKernel, OptimizerKind, Plan, PlanInput,
    PlanModel, StateDtypes,
};
use ferrotron_core::topology::Cluster;
use ferrotron_engine::memory::format_bytes;
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
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Sequences per optimizer step (the effective batch, whatever the layout).
    #[arg(long)]
    global_batch: usize,
    /// Evaluate this layout; without it (or with `auto` values) search.
    #[arg(long)]
    layout: Option<String>,
    /// Storage dtypes: weights=bf16,grads=bf16,master=fp32,optimizer=fp32 (the default).
    #[arg(long, default_value = "")]
    precision: String,
    /// adam (2 states), sgd (momentum: 1) or adam8bit (2 one-byte states).
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// ferrotron (what the engine's kernels stash) or megatron (Korthikanti et al. 2022).
    #[arg(long, default_value = "ferrotron")]
    activation_model: String,
    /// What attention keeps for backward: flash (memory-efficient, the engine's kernel: one
    /// log-sum-exp per query) or materialized (every head's T×T probabilities, as the published
    /// Megatron figures assume).
    #[arg(long, default_value = "flash")]
    attention: String,
    /// LoRA rank: frozen base weights, trainable state for the adapters only.
    #[arg(long)]
    lora_rank: Option<usize>,
    /// With --lora-rank: the projections the adapters target, comma-separated (default: every
    /// projection: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or GPT-2's
    /// c_attn,c_proj,c_fc).
    #[arg(long, default_value = "")]
    lora_targets: String,
    /// With --lora-rank: the frozen base's projections quantized, `nf4` (QLoRA: about 0.52 bytes a
    /// parameter, constants included).
    #[arg(long)]
    quantize_base: Option<ferrotron_core::precision::BaseQuantization>,
    /// Fraction of device memory kept free.
    #[arg(long, default_value_t = 0.1)]
    reserve: f64,
    /// Allow tensor-parallel groups across nodes (priced on the slow link).
    #[arg(long)]
    force_cross_node_tp: bool,
    /// Let the search consider the asynchronous schedules (PipeDream, PipeDream-2BW), which train
    /// on delayed weights: a change of the optimizer's semantics, so never chosen unasked.
    #[arg(long)]
    allow_async: bool,
    /// How many candidates a search prints.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Print JSON (the fields are a stable interface) instead of tables.
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
        "checkpoint_snapshot_bytes_per_stage": p.checkpoint_snapshot_bytes,
        "capacity_bytes": p.capacity_bytes,
        "usable_bytes": p.usable_bytes,
        "comm_bytes_per_step": p.comm_bytes_per_step,
        "bubble_fraction": p.bubble_fraction,
        "compute_time_s": p.compute_time_s,
        "dp_comm_time_s": p.dp_comm_time_s,
        "optimizer_time_s": p.optimizer_time_s,
        "grad_zeroing_time_s": p.grad_zeroing_time_s,
        "grad_norm_time_s": p.grad_norm_time_s,
        "step_time_s": p.step_time_s,
        "tokens_per_s": p.tokens_per_s,
        "tflops_per_device": p.tflops_per_device,
        "mfu": p.mfu,
        "fits": p.fits,
        "explain": p.explain,
    })
}

/// One unit for a whole table, chosen from its largest figure, so small models do not print 0.00.
fn unit_for(largest: u64) -> (&'static str, f64) {
    [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)]
        .into_iter()
        .find(|&(_, d)| largest as f64 >= d)
        .unwrap_or(("B", 1.0))
}

/// Stages drawn one per line; beyond this the rest are summarised.
const MAX_DRAWN_STAGES: usize = 16;

/// Which stages a picture or table shows: all of them up to [`MAX_DRAWN_STAGES`], otherwise the
/// first and last few and the worst, with how many were left out.
fn shown_stages(p: &Plan) -> (Vec<usize>, usize) {
    let n = p.memory_bytes_per_stage.len();
    if n <= MAX_DRAWN_STAGES {
        return ((0..n).collect(), 0);
    }
    let worst = (0..n)
        .max_by_key(|&s| p.memory_bytes_per_stage[s].total)
        .unwrap_or(0);
    let half = MAX_DRAWN_STAGES / 2;
    let mut shown: Vec<usize> = (0..half).chain(n - half..n).collect();
    if !shown.contains(&worst) {
        shown.push(worst);
        shown.sort_unstable();
    }
    let left_out = n - shown.len();
    (shown, left_out)
}

/// One bar per stage, a letter per term, of a fixed width: scaled to the capacity, or to the
/// largest stage when that is over it, so any size draws in the same 50 columns.
fn memory_bars(p: &Plan, unit: (&str, f64)) -> String {
    const WIDTH: f64 = 50.0;
    let mut out = String::from("memory per device (W weights, G gradients, M master, O optimizer, A activations, C comm; | = usable limit)\n");
    let largest = p
        .memory_bytes_per_stage
        .iter()
        .map(|m| m.total)
        .max()
        .unwrap_or(0);
    let scale = WIDTH / (p.capacity_bytes.max(largest).max(1) as f64);
    let limit = (p.usable_bytes as f64 * scale).round() as usize;
    let (shown, left_out) = shown_stages(p);
    for s in shown {
        let m = &p.memory_bytes_per_stage[s];
        let mut cells: Vec<char> = Vec::new();
        for ((_, bytes), ch) in m.terms().iter().zip(['W', 'G', 'M', 'O', 'A', 'C']) {
            let n = (*bytes as f64 * scale).round().min(WIDTH) as usize;
            cells.extend(std::iter::repeat_n(ch, n));
        }
        cells.truncate(WIDTH as usize);
        if cells.len() < limit {
            cells.resize(limit, '.');
        }
        cells.insert(limit.min(cells.len()), '|');
        out.push_str(&format!(
            "  stage {s:>3} {} {:.2} {}\n",
            cells.into_iter().collect::<String>(),
            m.total as f64 / unit.1,
            unit.0
        ));
    }
    if left_out > 0 {
        out.push_str(&format!(
            "  ({left_out} more stages not drawn; every stage is in --json)\n"
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
    let largest = p.memory_bytes_per_stage.iter().map(|m| m.total).max();
    let unit = unit_for(largest.unwrap_or(0));
    print!("{}", memory_bars(p, unit));
    let (shown, left_out) = shown_stages(p);
    let mut table = crate::report::plan::stage_table(p, &shown);
    table.caption.clear();
    print!("{}", table.markdown());
    if left_out > 0 {
        println!("| … {left_out} more stages | | | | | | | |");
    }
    let c = &p.comm_bytes_per_step;
    let mut cp = if p.layout.cp > 1 {
        format!(", cp {}", format_bytes(c.cp as u64))
    } else {
        String::new()
    };
    if p.layout.ep > 1 {
        cp.push_str(&format!(", ep {}", format_bytes(c.ep as u64)));
    }
    println!(
        "bytes per step per device: tp {}, pp {}, dp {}{cp} | bubble {:.1}% | step {:.4} s | {:.0} tokens/s | {:.2} TFLOP/s per device | MFU {:.1}%",
        format_bytes(c.tp as u64),
        format_bytes(c.pp as u64),
        format_bytes(c.dp as u64),
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
        precision: StateDtypes::parse(precision)?,
        optimizer: OptimizerKind::parse(optimizer)?,
        activation_model: ActivationModel::parse(activation_model)?,
        ..PlanInput::new(
            plan_model(model)?,
            Cluster::parse(cluster)?,
            seq,
            global_batch,
        )
    })
}

/// What `--model` names: a preset, a shape, a model directory, or an `s3://` prefix holding one
/// (whose `config.json` is read from the store: the planner itself touches no network).
fn plan_model(model: &str) -> Result<PlanModel> {
    if ferrotron_engine::storage::is_remote(model) {
        let at = ferrotron_engine::storage::Location::parse(model)?;
        at.check_reachable()?;
        return Ok(PlanModel::Shape(ferrotron_engine::hf::read_config_at(&at)?));
    }
    Ok(PlanModel::parse(model)?)
}

/// The LoRA configuration `--lora-rank` and `--lora-targets` describe (the alpha does not change
/// memory or time: the rank is used for it).
fn lora_for(
    model: &PlanModel,
    rank: Option<usize>,
    targets: &str,
) -> Result<Option<ferrotron_core::model::LoraConfig>> {
    let Some(rank) = rank else {
        if !targets.is_empty() {
            anyhow::bail!("--lora-targets needs --lora-rank");
        }
        return Ok(None);
    };
    let PlanModel::Shape(cfg) = model else {
        anyhow::bail!(
            "--lora-rank: LoRA adapters are sized by the model's projections: give a model \
             shape, not params=N"
        );
    };
    let targets: Vec<String> = targets
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.trim().to_string())
        .collect();
    Ok(Some(
        ferrotron_core::model::LoraConfig::new(cfg, rank, rank as f64, &targets)
            .map_err(|e| anyhow::anyhow!("--lora-rank: {e}"))?,
    ))
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
    input.lora = lora_for(&input.model, a.lora_rank, &a.lora_targets)?;
    input.quantize_base = a.quantize_base;
    input.attention = AttentionKernel::parse(&a.attention)?;
    input.memory_reserve = a.reserve;
    input.force_cross_node_tp = a.force_cross_node_tp;
    input.allow_async = a.allow_async;
    let spec = a.layout.as_deref().map(LayoutSpec::parse).transpose()?;
    if !a.json {
        println!("{}", precision_note(&input.precision));
    }
    match spec {
        Some(spec) if spec.auto_keys.is_empty() => {
            let p = plan::evaluate(&input, &spec.layout)?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&plan_json(&p))?);
            } else {
                print_plan(&p);
            }
            if let Some(dir) = &a.out {
                let why = search_notes(&input, Some(&p));
                write_pictures(
                    dir,
                    &PlanPage {
                        input: &input,
                        model: &a.model,
                        chosen: &p,
                        candidates: std::slice::from_ref(&p),
                        shapes: 1,
                        why: &why,
                    },
                )?;
            }
        }
        spec => {
            let mut plans = plan::search(&input)?;
            if let Some(spec) = &spec {
                plans.retain(|p| spec.admits(&p.layout));
            }
            let notes = search_notes(&input, plans.first());
            if a.json {
                let c: Vec<_> = plans
                    .iter()
                    .take(a.top.max(1))
                    .enumerate()
                    .map(|(i, p)| {
                        let mut j = plan_json(p);
                        j["within_error_of_best"] = (i > 0
                            && plan::within_error_of_best(&input, &plans[0], p).is_some())
                        .into();
                        j
                    })
                    .collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({ "candidates": c, "explain": notes }))?
                );
            } else {
                println!("why:");
                for n in &notes {
                    println!("  {n}");
                }
                println!("  {}", plan::ranking_note(&input));
                for (i, p) in plans.iter().take(a.top).enumerate() {
                    println!("\n#{} ", i + 1);
                    if let Some(note) = (i > 0)
                        .then(|| plan::within_error_of_best(&input, &plans[0], p))
                        .flatten()
                    {
                        println!("{note}");
                    }
                    print_plan(p);
                }
                if plans.is_empty() {
                    anyhow::bail!("no layout fits this model on this cluster");
                }
            }
            if let (Some(dir), Some(best)) = (&a.out, plans.first()) {
                write_pictures(
                    dir,
                    &PlanPage {
                        input: &input,
                        model: &a.model,
                        chosen: best,
                        candidates: &plans,
                        shapes: a.top,
                        why: &notes,
                    },
                )?;
            }
        }
    }
    Ok(())
}

/// What the plan is priced in, and what `train` runs unless told: the two defaults differ (a GPU
/// run is planned in mixed bf16; ferrotron trains in f32), so that a prediction for `train` needs
/// the same `--precision` on both.
fn precision_note(p: &ferrotron_core::precision::StateDtypes) -> String {
    format!(
        "priced in weights {}, gradients {}, master {}, optimizer {} (`--precision`; `train` trains \
         in f32 unless its own `--precision` says otherwise)",
        p.weights.name(),
        p.grads.name(),
        if p.master_bytes() > 0.0 {
            p.master.name()
        } else {
            "none"
        },
        p.optimizer.name()
    )
}

/// The predicted pictures and a report page of the chosen layout (with the candidates compared),
/// into `dir`.
fn write_pictures(dir: &std::path::Path, page: &PlanPage) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let files = crate::report::plan::plan_files(page)?;
    for (name, body) in &files {
        std::fs::write(dir.join(name), body)?;
    }
    let names: Vec<&str> = files.iter().map(|f| f.0).collect();
    println!(
        "pictures written to {}: {}",
        dir.display(),
        names.join(", ")
    );
    Ok(())
}

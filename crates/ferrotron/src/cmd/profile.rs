//! `ferrotron profile`: run a few steps of a layout and put every measured figure beside the planner's
//! prediction for the same layout, with a verdict where they disagree; write the trace, the pictures
//! and an HTML report.

use crate::report::profile::ProfileFacts;
use crate::report::Table;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotron_core::plan::simulated_timeline;
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::comm::{Comm, ThreadWorld};
use ferrotron_engine::memory::{self, format_bytes};
use ferrotron_engine::optim::{AdamWConfig, LrSchedule};
use ferrotron_engine::parallel::{MeshStep, StepReport, Training};
use ferrotron_engine::runtime::{plan_input, resolve_model, TrainConfig};
use ferrotron_engine::transformer::TokenBatch;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct ProfileArgs {
    /// A preset or a Hugging Face model directory.
    #[arg(long, default_value = "llama-small")]
    model: String,
    /// The layout to profile (every key given, or `auto` for the planner's choice).
    #[arg(long)]
    layout: ferrotron_core::layout::LayoutSpec,
    /// Sequences per step (the global batch).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Steps to run; of those after the first (which warms up), the one of median step time is
    /// reported.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// The cluster the devices stand for (placement and predictions).
    #[arg(long, default_value = "this-machine")]
    cluster: String,
    /// Each device's memory (default: the cluster's).
    #[arg(long)]
    device_memory: Option<String>,
    /// Where the trace, the pictures and the report go.
    #[arg(long, default_value = "runs/profile")]
    out: PathBuf,
    /// A measured figure further than this from the prediction gets a verdict (idle: absolute; bytes
    /// and memory: relative).
    #[arg(long, default_value_t = 0.15)]
    threshold: f64,
    /// A device computing this fraction above its stage's median is a straggler.
    #[arg(long, default_value_t = 0.5)]
    straggler_threshold: f64,
    /// Drills: make this device compute --slow-device-ms longer per action.
    #[arg(long)]
    slow_device: Option<usize>,
    #[arg(long, default_value_t = 10.0)]
    slow_device_ms: f64,
    /// Print one JSON object (layout, step time measured and predicted, its parts, the verdicts)
    /// instead of the tables.
    #[arg(long)]
    json: bool,
}

/// What one device measured in the reported step.
struct Measured {
    report: StepReport,
}

/// The step to report: of the steps after the first (which pays for first touches of memory), the
/// one whose step time (the slowest device's) is the median. One step's device time moves by tens
/// of percent on a shared machine; the median of several does not.
fn median_step(per_device: &[Vec<StepReport>]) -> usize {
    let steps = per_device.iter().map(Vec::len).min().unwrap_or(0);
    let span = |k: usize| per_device.iter().map(|d| d[k].span_s).fold(0.0, f64::max);
    let mut candidates: Vec<usize> = (steps.min(1)..steps).collect();
    candidates.sort_by(|&a, &b| span(a).total_cmp(&span(b)));
    candidates.get(candidates.len() / 2).copied().unwrap_or(0)
}

pub fn run(a: ProfileArgs) -> Result<()> {
    if a.steps == 0 || a.batch == 0 || a.seq < 2 {
        bail!("--steps and --batch must be positive and --seq at least 2");
    }
    let cfg = TrainConfig {
        model: a.model.clone(),
        batch_size: a.batch,
        seq_len: a.seq,
        steps: a.steps,
        cluster: a.cluster.clone(),
        device_memory: a.device_memory.clone(),
        layout: a.layout.clone(),
        ..TrainConfig::default()
    };
    let (model, params, _) = resolve_model(&a.model, 0)?;
    if a.seq > model.max_sequence_length() {
        bail!(
            "--seq {} exceeds the model's max_position_embeddings {}",
            a.seq,
            model.max_position_embeddings
        );
    }
    let input = plan_input(&cfg, &model, None)?;
    let plan = ferrotron_engine::runtime::resolve_layout(&a.layout, &input)?.swap_remove(0);
    let layout = plan.layout;
    if let Some(d) = a.slow_device {
        if d >= layout.world_size() {
            bail!(
                "--slow-device {d}: layout `{layout}` has {} devices",
                layout.world_size()
            );
        }
    }
    if !(a.slow_device_ms.is_finite() && a.slow_device_ms >= 0.0 && a.threshold >= 0.0) {
        bail!("--slow-device-ms and --threshold must be non-negative numbers");
    }
    let predicted_timeline = simulated_timeline(&input, &layout)?;
    // The planner's idle fraction of each stage: its simulated schedule's gaps.
    let predicted_idle: Vec<f64> = (0..layout.pp)
        .map(|s| {
            predicted_timeline
                .as_ref()
                .map_or(plan.bubble_fraction, |tl| {
                    1.0 - tl.busy[s] / tl.makespan.max(1e-12)
                })
        })
        .collect();
    let partition = StagePartition::for_layout(&model, &layout)?;
    // Deterministic token batches over the model's vocabulary.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let batches: Vec<TokenBatch> = (0..a.steps)
        .map(|_| TokenBatch {
            ids: (0..a.batch * a.seq)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % model.vocab_size as u64) as u32
                })
                .collect(),
            batch: a.batch,
            seq: a.seq,
        })
        .collect();
    let world = layout.world_size();
    let accounts = memory::Accounts::claim(world);
    let capacity = cfg
        .device_memory
        .as_deref()
        .map(ferrotron_engine::runtime::parse_bytes)
        .transpose()?;
    let lr = LrSchedule {
        peak_lr: 1e-4,
        min_lr: 1e-4,
        warmup_steps: 0,
        total_steps: a.steps,
    };
    let slow = a.slow_device.map(|d| (d, a.slow_device_ms / 1e3));
    let results = ThreadWorld::new(world)
        .timeout(Duration::from_secs(600))
        .run(|c| -> ferrotron_engine::Result<Vec<StepReport>> {
            memory::set_capacity(accounts.base + c.rank(), capacity);
            let mut step = MeshStep::new(&model, &params, &batches[0], &layout, &partition)?
                .with_account_base(accounts.base)
                .with_slow_device(slow);
            let mut reports = Vec::new();
            step.train_device(
                c,
                &Training {
                    steps: a.steps,
                    batch_of: &|k| batches[k].clone(),
                    adam: AdamWConfig::default(),
                    lr: &lr,
                    clip: 1.0,
                },
                &mut |_, _, _, r| {
                    reports.push(r.clone());
                    Ok(())
                },
            )?;
            memory::set_capacity(accounts.base + c.rank(), None);
            Ok(reports)
        });
    let mut per_device = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        per_device.push(
            res.map_err(|e| anyhow::anyhow!("device {r}: {e}"))?
                .map_err(|e| anyhow::anyhow!("device {r}: {e}"))?,
        );
    }
    let reported = median_step(&per_device);
    let devices: Vec<Measured> = per_device
        .into_iter()
        .map(|mut steps| Measured {
            report: steps.swap_remove(reported),
        })
        .collect();
    let mesh =
        ferrotron_engine::comm::DeviceMesh::new(layout.tp, layout.dp, layout.pp, world, world)?;
    let coords: Vec<(usize, usize, usize)> = (0..world).map(|r| mesh.coords(r)).collect();

    let tables = Tables::of(&input, &layout, &plan, &devices, &coords, &predicted_idle);
    let times = StepTimes::of(&devices, &plan, predicted_timeline.as_ref(), layout.pp);
    let mut verdicts = times.verdicts(a.threshold);
    verdicts.extend(self::verdicts(
        &a,
        &devices,
        &coords,
        &plan,
        &predicted_idle,
    ));
    let record = serde_json::json!({
        "model": a.model,
        "layout": layout.to_string(),
        "seq": a.seq,
        "global_batch": a.batch,
        "cluster": a.cluster,
        "precision": input.precision.spec(),
        // The reported step (1-based): the median by time of those after the first.
        "step": devices[0].report.step + 1,
        "steps": a.steps,
        "step_time_s": times.step.json(),
        "forward_s": times.forward.json(),
        "backward_s": times.backward.json(),
        "forward_comm_s": times.forward_comm.json(),
        "backward_comm_s": times.backward_comm.json(),
        "reduce_s": times.reduce.json(),
        "optimizer_s": times.optimizer.json(),
        "verdicts": verdicts,
    });
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("{}: cannot create", a.out.display()))?;
    let record_path = a.out.join("profile.json");
    std::fs::write(&record_path, serde_json::to_string_pretty(&record)?)
        .with_context(|| format!("{}: cannot write", record_path.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    }
    let quiet = a.json;
    macro_rules! say {
        ($($t:tt)*) => { if !quiet { println!($($t)*) } };
    }
    say!(
        "ferrotron profile: {} on {world} devices, layout {layout}, batch {} x {} tokens, step {} of {} \
         (the median step by time; device time; the planner's prediction for the same layout beside \
         each figure)\n",
        a.model,
        a.batch,
        a.seq,
        devices[0].report.step + 1,
        a.steps
    );
    for t in [
        &times.table(),
        &tables.devices,
        &tables.links,
        &tables.memory,
    ] {
        say!("{}", t.markdown());
    }
    say!("verdicts:");
    for v in &verdicts {
        say!("- {v}");
    }

    // The trace, the pictures and the report.
    let names: Vec<String> = coords
        .iter()
        .enumerate()
        .map(|(d, (t, dp, s))| format!("dev {d} s{s} d{dp} t{t}"))
        .collect();
    let links = ferrotron_core::plan::links(&input.cluster, &layout);
    let mut files = crate::report::profile::profile_files(ProfileFacts {
        layout: layout.to_string(),
        devices: names
            .iter()
            .cloned()
            .zip(devices.iter().map(|m| &m.report))
            .collect(),
        plan: &plan,
        predicted: crate::report::plan::predicted_panel(&input, &plan)?,
        capacity: input.cluster.device_memory_bytes,
        links: vec![
            ("tp", links.tp.bandwidth_bytes_per_s, vec!["tp"]),
            ("dp", links.dp.bandwidth_bytes_per_s, vec!["dp"]),
            ("pp", links.pp.bandwidth_bytes_per_s, vec!["p2p", "pp"]),
        ],
        device_table: tables.devices,
        link_table: tables.links,
        memory_table: tables.memory,
        verdicts,
    });
    files.push((
        "trace.json",
        serde_json::to_string(&trace(&devices, &names))?,
    ));
    let written: Vec<&str> = files.iter().map(|f| f.0).collect();
    for (name, body) in &files {
        let path = a.out.join(name);
        std::fs::write(&path, body).with_context(|| format!("{}: cannot write", path.display()))?;
    }
    say!(
        "\nwritten to {}: {} (trace.json opens in Perfetto)",
        a.out.display(),
        written.join(", ")
    );
    Ok(())
}

/// A figure measured in the profiled step (device time) and the planner's prediction of it.
#[derive(Clone, Copy)]
struct Pair {
    measured: f64,
    predicted: f64,
}

impl Pair {
    fn json(self) -> serde_json::Value {
        serde_json::json!({"measured": self.measured, "predicted": self.predicted})
    }
    fn ratio(self) -> f64 {
        self.measured / self.predicted.max(1e-12)
    }
    /// The ratio for a table: none where nothing was predicted.
    fn ratio_text(self) -> String {
        if self.predicted > 0.0 {
            format!("{:.2}", self.ratio())
        } else {
            "—".into()
        }
    }
}

/// What the step's time is made of, measured and predicted: the step, the forward and backward
/// actions (per device, summed over the step), the gradient reduction after them, the optimizer step.
struct StepTimes {
    step: Pair,
    forward: Pair,
    backward: Pair,
    /// The communication inside the forward and backward actions (tensor-parallel collectives,
    /// ZeRO-3 gathers): the actions' spans less their compute.
    forward_comm: Pair,
    backward_comm: Pair,
    reduce: Pair,
    optimizer: Pair,
}

impl StepTimes {
    fn of(
        devices: &[Measured],
        plan: &ferrotron_core::plan::Plan,
        predicted: Option<&ferrotron_core::schedule::Timeline>,
        stages: usize,
    ) -> StepTimes {
        use ferrotron_core::schedule::Action;
        let is_forward = |a: &Action| matches!(a, Action::Forward { .. });
        let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let measured_kind = |forward: bool| {
            mean(
                devices
                    .iter()
                    .map(|m| {
                        m.report
                            .timeline
                            .iter()
                            .filter(|(a, _, _)| is_forward(a) == forward)
                            .map(|(_, t0, t1)| t1 - t0)
                            .sum()
                    })
                    .collect(),
            )
        };
        let measured_comm = |forward: bool| {
            mean(
                devices
                    .iter()
                    .map(|m| {
                        let r = &m.report;
                        r.timeline
                            .iter()
                            .zip(&r.action_compute_s)
                            .filter(|((a, _, _), _)| is_forward(a) == forward)
                            .map(|((_, t0, t1), compute)| (t1 - t0 - compute).max(0.0))
                            .sum()
                    })
                    .collect(),
            )
        };
        let predicted_kind = |forward: bool| {
            predicted.map_or(0.0, |tl| {
                tl.events
                    .iter()
                    .filter(|e| is_forward(&e.action) == forward)
                    .map(|e| e.end - e.start)
                    .sum::<f64>()
                    / stages.max(1) as f64
            })
        };
        let longest = |f: &dyn Fn(&StepReport) -> f64| {
            devices.iter().map(|m| f(&m.report)).fold(0.0, f64::max)
        };
        StepTimes {
            step: Pair {
                measured: longest(&|r| r.span_s),
                predicted: plan.step_time_s,
            },
            forward: Pair {
                measured: measured_kind(true),
                predicted: predicted_kind(true),
            },
            backward: Pair {
                measured: measured_kind(false),
                predicted: predicted_kind(false),
            },
            forward_comm: Pair {
                measured: measured_comm(true),
                predicted: plan.action_comm_time_s.0,
            },
            backward_comm: Pair {
                measured: measured_comm(false),
                predicted: plan.action_comm_time_s.1,
            },
            // The device whose actions end last is on the critical path: the others' reduction
            // intervals also hold their wait for it (which the prediction counts as bubble).
            reduce: Pair {
                measured: devices
                    .iter()
                    .map(|m| &m.report)
                    .max_by(|a, b| a.reduce_s.0.total_cmp(&b.reduce_s.0))
                    .map_or(0.0, |r| r.reduce_s.1 - r.reduce_s.0),
                predicted: plan.dp_comm_time_s,
            },
            optimizer: Pair {
                measured: longest(&|r| r.update_s.1 - r.update_s.0),
                predicted: plan.optimizer_time_s,
            },
        }
    }

    fn parts(&self) -> [(&'static str, Pair); 7] {
        [
            ("step", self.step),
            ("forward actions per device", self.forward),
            ("communication inside forward actions", self.forward_comm),
            ("backward actions per device", self.backward),
            ("communication inside backward actions", self.backward_comm),
            ("gradient reduction", self.reduce),
            ("optimizer step", self.optimizer),
        ]
    }

    fn table(&self) -> Table {
        let mut t = Table::new(
            "step time, measured (device time) and predicted",
            &[
                "part",
                "measured (ms)",
                "predicted (ms)",
                "measured / predicted",
            ],
        );
        for (name, p) in self.parts() {
            t.row(vec![
                name.to_string(),
                format!("{:.2}", p.measured * 1e3),
                format!("{:.2}", p.predicted * 1e3),
                p.ratio_text(),
            ]);
        }
        t
    }

    /// The step time's verdict, and one for each part off by more than `threshold` (relative).
    fn verdicts(&self, threshold: f64) -> Vec<String> {
        let off = |p: Pair| (p.ratio() - 1.0).abs() > threshold;
        let ms = |s: f64| format!("{:.1} ms", s * 1e3);
        let mut out = Vec::new();
        if off(self.step) {
            out.push(format!(
                "step time {} measured vs {} predicted ({:.2}×): the cluster's time constants do not \
                 describe these devices — `ferrotron calibrate --this-machine` measures this machine, \
                 `ferrotron calibrate --profile DIR…` fits them to profiles like this one",
                ms(self.step.measured),
                ms(self.step.predicted),
                self.step.ratio()
            ));
        } else {
            out.push(format!(
                "step time {} measured vs {} predicted: within {:.0}%",
                ms(self.step.measured),
                ms(self.step.predicted),
                100.0 * threshold
            ));
        }
        // Parts off by more than the threshold, also when the step agrees (errors can cancel);
        // parts under 5% of the step are left out.
        for (name, p) in self.parts().into_iter().skip(1) {
            if off(p) && p.measured.max(p.predicted) > 0.05 * self.step.measured {
                out.push(format!(
                    "{name}: {} measured vs {} predicted ({}×)",
                    ms(p.measured),
                    ms(p.predicted),
                    p.ratio_text()
                ));
            }
        }
        out
    }
}

/// The profile's tables, printed as markdown and shown in the page.
struct Tables {
    devices: Table,
    links: Table,
    memory: Table,
}

impl Tables {
    fn of(
        input: &ferrotron_core::plan::PlanInput,
        layout: &ferrotron_core::layout::Layout,
        plan: &ferrotron_core::plan::Plan,
        devices: &[Measured],
        coords: &[(usize, usize, usize)],
        predicted_idle: &[f64],
    ) -> Tables {
        let blocked = |r: &StepReport, kind: &str| -> f64 {
            r.stats
                .by_op
                .iter()
                .filter(|(k, _)| k.split('/').next() == Some(kind))
                .map(|(_, s)| s.time_blocked_s + s.time_transfer_s)
                .sum()
        };
        let sent = |r: &StepReport, kinds: &[&str]| -> u64 {
            kinds.iter().map(|k| r.stats.bytes_sent_by_group(k)).sum()
        };
        let received = |r: &StepReport, kinds: &[&str]| -> u64 {
            r.stats
                .by_op
                .iter()
                .filter(|(k, _)| kinds.contains(&k.split('/').next().unwrap_or("")))
                .map(|(_, o)| o.bytes_received)
                .sum()
        };
        let ms = |s: f64| format!("{:.2}", s * 1e3);
        let traffic = &plan.comm_bytes_per_step;
        let mut table = Table::new(
            "per device, the step measured (device time) and predicted",
            &[
                "device",
                "stage",
                "dp",
                "tp",
                "computing (ms)",
                "blocked in tp (ms)",
                "blocked in dp (ms)",
                "blocked in world (ms)",
                "waiting on neighbours (ms)",
                "idle (%)",
                "predicted idle (%)",
                "sent tp / dp / pp",
                "predicted tp / dp / pp",
                "received",
            ],
        );
        for (d, m) in devices.iter().enumerate() {
            let r = &m.report;
            let (t, dp, s) = coords[d];
            let idle = if r.span_s > 0.0 {
                1.0 - r.busy_s / r.span_s
            } else {
                0.0
            };
            table.row(vec![
                d.to_string(),
                s.to_string(),
                dp.to_string(),
                t.to_string(),
                ms(r.busy_s),
                ms(blocked(r, "tp")),
                ms(blocked(r, "dp")),
                ms(blocked(r, "world")),
                ms(blocked(r, "p2p")),
                format!("{:.1}", 100.0 * idle),
                format!("{:.1}", 100.0 * predicted_idle[s]),
                format!(
                    "{} / {} / {}",
                    format_bytes(sent(r, &["tp"])),
                    format_bytes(sent(r, &["dp"])),
                    format_bytes(sent(r, &["p2p", "pp"]))
                ),
                format!(
                    "{} / {} / {}",
                    format_bytes(traffic.tp as u64),
                    format_bytes(traffic.dp as u64),
                    format_bytes(traffic.pp as u64)
                ),
                format_bytes(r.stats.total().bytes_received),
            ]);
        }
        let links = ferrotron_core::plan::links(&input.cluster, layout);
        let bw = |l: &ferrotron_core::topology::Link| l.bandwidth_bytes_per_s.max(1.0);
        let mut link_table = Table::new(
            format!(
                "bytes per group and what they take on the cluster's links ({}/s tp, {}/s dp, {}/s pp)",
                format_bytes(links.tp.bandwidth_bytes_per_s as u64),
                format_bytes(links.dp.bandwidth_bytes_per_s as u64),
                format_bytes(links.pp.bandwidth_bytes_per_s as u64),
            ),
            &[
                "device", "stage", "dp", "tp", "sent tp / dp / pp", "received tp / dp / pp",
                "on the tp link (ms)", "on the dp link (ms)", "on the pp link (ms)",
            ],
        );
        for (d, m) in devices.iter().enumerate() {
            let r = &m.report;
            let (t, dp, s) = coords[d];
            let (tp_b, dp_b, pp_b) = (sent(r, &["tp"]), sent(r, &["dp"]), sent(r, &["p2p", "pp"]));
            link_table.row(vec![
                d.to_string(),
                s.to_string(),
                dp.to_string(),
                t.to_string(),
                format!(
                    "{} / {} / {}",
                    format_bytes(tp_b),
                    format_bytes(dp_b),
                    format_bytes(pp_b)
                ),
                format!(
                    "{} / {} / {}",
                    format_bytes(received(r, &["tp"])),
                    format_bytes(received(r, &["dp"])),
                    format_bytes(received(r, &["p2p", "pp"]))
                ),
                ms(tp_b as f64 / bw(&links.tp)),
                ms(dp_b as f64 / bw(&links.dp)),
                ms(pp_b as f64 / bw(&links.pp)),
            ]);
        }
        let mut memory = Table::new(
            "peak memory per term, measured / predicted (MB)",
            &[
                "device",
                "weights (MB)",
                "gradients (MB)",
                "master (MB)",
                "optimizer (MB)",
                "activations (MB)",
                "comm (MB)",
                "total (MB)",
                "measured / predicted",
            ],
        );
        let mb = |a: u64, b: u64| format!("{:.2} / {:.2}", a as f64 / 1e6, b as f64 / 1e6);
        for (d, m) in devices.iter().enumerate() {
            let (got, want) = (
                m.report.memory.peak_terms(),
                plan.memory_bytes_per_stage[coords[d].2],
            );
            let mut row = vec![d.to_string()];
            row.extend(
                got.terms()
                    .iter()
                    .zip(want.terms())
                    .map(|(g, w)| mb(g.1, w.1)),
            );
            row.push(mb(got.total, want.total));
            row.push(format!(
                "{:.2}",
                got.total as f64 / want.total.max(1) as f64
            ));
            memory.row(row);
        }
        Tables {
            devices: table,
            links: link_table,
            memory,
        }
    }
}

/// Chrome trace-event JSON: one track per device, one event per action (device time, µs), and the
/// step's remainder after the last action (optimizer step and reductions) as one event.
fn trace(devices: &[Measured], names: &[String]) -> serde_json::Value {
    let mut events = Vec::new();
    for (d, m) in devices.iter().enumerate() {
        events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": names[d]}}));
        for &(a, t0, t1) in &m.report.timeline {
            events.push(ferrotron_engine::parallel::action_event(&a, d, t0, t1));
        }
        let r = &m.report;
        let mut extra: Vec<(&str, &str, f64, f64)> = r
            .transfers
            .iter()
            .map(|(what, t0, t1)| (what.as_str(), "pipeline transfer", *t0, *t1))
            .collect();
        extra.push((
            "gradient reductions + global norm",
            "collective",
            r.reduce_s.0,
            r.reduce_s.1,
        ));
        extra.push(("optimizer step", "optimizer", r.update_s.0, r.update_s.1));
        for (name, cat, t0, t1) in extra {
            events.push(serde_json::json!({
                "name": name, "cat": cat, "ph": "X", "pid": 0, "tid": d,
                "ts": t0 * 1e6, "dur": ((t1 - t0) * 1e6).max(0.0),
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// A line for every measured figure further from its prediction than the threshold, with the likely
/// cause; or one line saying that everything is within it.
fn verdicts(
    a: &ProfileArgs,
    devices: &[Measured],
    coords: &[(usize, usize, usize)],
    plan: &ferrotron_core::plan::Plan,
    predicted_idle: &[f64],
) -> Vec<String> {
    let th = a.threshold;
    let stages = predicted_idle.len();
    let mut out = Vec::new();
    let busy: Vec<f64> = devices.iter().map(|m| m.report.busy_s).collect();
    // A device computing well above the others of its stage (which do the same work): a straggler.
    // The worst of them (by its ratio to the median) is the one the others wait on.
    let mut worst_straggler: Option<(f64, String)> = None;
    for (d, &b) in busy.iter().enumerate() {
        let (t, dp, s) = coords[d];
        let mut peers: Vec<f64> = (0..devices.len())
            .filter(|&e| coords[e].2 == s)
            .map(|e| busy[e])
            .collect();
        if peers.len() < 2 {
            continue;
        }
        peers.sort_by(f64::total_cmp);
        let median = peers[peers.len() / 2];
        if median > 0.0 && b > median * (1.0 + a.straggler_threshold) {
            let ratio = b / median;
            if worst_straggler.as_ref().is_none_or(|w| ratio > w.0) {
                worst_straggler = Some((
                    ratio,
                    format!("device {d} (stage {s}, dp rank {dp}, tp rank {t})"),
                ));
            }
            out.push(format!(
                "device {d} (stage {s}, dp rank {dp}, tp rank {t}) computes {:.2}× its stage's median \
                 ({b:.4} s vs {median:.4} s): a straggler",
                b / median
            ));
        }
    }
    // Per stage: idle against the predicted bubble, and stage balance.
    let stage_busy: Vec<f64> = (0..stages)
        .map(|s| {
            let v: Vec<f64> = (0..devices.len())
                .filter(|&d| coords[d].2 == s)
                .map(|d| busy[d])
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        })
        .collect();
    let (cheap, dear) = (
        (0..stages)
            .min_by(|&x, &y| stage_busy[x].total_cmp(&stage_busy[y]))
            .unwrap_or(0),
        (0..stages)
            .max_by(|&x, &y| stage_busy[x].total_cmp(&stage_busy[y]))
            .unwrap_or(0),
    );
    let mut idle_ok = Vec::new();
    for (s, &want) in predicted_idle.iter().enumerate() {
        let ids: Vec<usize> = (0..devices.len()).filter(|&d| coords[d].2 == s).collect();
        let idle: f64 = ids
            .iter()
            .map(|&d| {
                let r = &devices[d].report;
                if r.span_s > 0.0 {
                    1.0 - r.busy_s / r.span_s
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / ids.len().max(1) as f64;
        if (idle - want).abs() > th {
            let why = if let Some((_, straggler)) = &worst_straggler {
                format!("waiting on the straggler, {straggler}")
            } else if stage_busy[cheap] > 0.0 && stage_busy[dear] / stage_busy[cheap] > 1.0 + th {
                format!(
                    "stages unbalanced — stage {dear} costs {:.2}× stage {cheap}",
                    stage_busy[dear] / stage_busy[cheap]
                )
            } else {
                "time blocked in collectives or on neighbours beyond the model".to_string()
            };
            out.push(format!(
                "stage {s} idle {:.0}% vs predicted {:.0}%: {why}",
                100.0 * idle,
                100.0 * want
            ));
        } else {
            idle_ok.push(format!(
                "stage {s} idle {:.0}% vs {:.0}%",
                100.0 * idle,
                100.0 * want
            ));
        }
    }
    // Bytes per group against the planner's traffic (the busiest device of each).
    let mut bytes_ok = Vec::new();
    let traffic = &plan.comm_bytes_per_step;
    for (group, kinds, want) in [
        ("tp", vec!["tp"], traffic.tp),
        ("dp", vec!["dp"], traffic.dp),
        ("pp", vec!["p2p", "pp"], traffic.pp),
    ] {
        let got = devices
            .iter()
            .map(|m| {
                kinds
                    .iter()
                    .map(|k| m.report.stats.bytes_sent_by_group(k))
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0) as f64;
        if want == 0.0 && got == 0.0 {
            continue;
        }
        let ratio = got / want.max(1.0);
        if (ratio - 1.0).abs() > th {
            out.push(format!(
                "{group} bytes {} vs predicted {} ({ratio:.2}×)",
                format_bytes(got as u64),
                format_bytes(want as u64)
            ));
        } else {
            bytes_ok.push(format!("{group} bytes {ratio:.2}× the prediction"));
        }
    }
    // What agrees is said too, so that a reader of a report with some figures off still sees which
    // were measured to match.
    let agreeing: Vec<String> = idle_ok.into_iter().chain(bytes_ok).collect();
    if out.is_empty() {
        out.push(format!(
            "every measured idle fraction and byte count is within {:.0}% of the prediction: {}",
            100.0 * th,
            agreeing.join(", ")
        ));
    } else if !agreeing.is_empty() {
        out.push(format!(
            "within {:.0}% of the prediction: {}",
            100.0 * th,
            agreeing.join(", ")
        ));
    }
    out
}

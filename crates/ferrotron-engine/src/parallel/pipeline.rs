//! Pipeline parallelism: each stage (a device thread) holds a contiguous range of layers and executes
//! its schedule's action list — the same lists the planner simulates — receiving activations from the
//! previous stage and gradients from the next, stashing each in-flight micro-batch's activations until
//! its backward is done, and accumulating weight gradients over the whole batch.

use crate::comm::{Comm, CommStats, Group, ReduceOp, ThreadWorld};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::transformer::{
    ForwardState, ParamStore, StageInput, TokenBatch, Transformer, WeightGrads,
};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::{build, Action, StagePartition};
use std::collections::HashMap;
use std::time::Duration;

/// The result of one pipelined forward/backward over a batch.
pub struct PipelineRun {
    /// Mean loss over every predicted token of the batch.
    pub loss: f64,
    /// Every parameter's gradient, gathered from the stages that hold it.
    pub grads: ParamStore,
    /// Per stage: communication accounting and device clocks.
    pub stats: Vec<CommStats>,
    /// Per stage: the most micro-batches whose activations were stashed at once, and the most bytes
    /// the stash (and deferred weight-gradient work) held.
    pub peak_stashed: Vec<usize>,
    pub peak_stash_bytes: Vec<usize>,
    /// Per stage: device time at the end of the step, and the part of it spent computing.
    pub device_time_s: Vec<f64>,
    pub compute_time_s: Vec<f64>,
    /// Wall-clock time of the whole step.
    pub wall_time_s: f64,
    /// Per stage: every action with its start and end in device time (the time its inputs arrived
    /// counts as waiting, not as the action).
    pub timeline: Vec<Vec<(Action, f64, f64)>>,
}

impl PipelineRun {
    /// The schedule's duration in device time: from the first action's start on any stage to the
    /// last action's end (stage set-up and the final gradient exchange excluded).
    pub fn step_time_s(&self) -> f64 {
        let start = self
            .timeline
            .iter()
            .filter_map(|t| t.first())
            .map(|a| a.1)
            .fold(f64::INFINITY, f64::min);
        let end = self
            .timeline
            .iter()
            .filter_map(|t| t.last())
            .map(|a| a.2)
            .fold(0.0, f64::max);
        (end - start).max(0.0)
    }
    /// Time stage `s` spent computing its actions.
    pub fn busy_s(&self, s: usize) -> f64 {
        self.timeline[s].iter().map(|a| a.2 - a.1).sum()
    }
    /// The share of the step stage `s` spent not computing: waiting on neighbours and in the bubble.
    pub fn idle_fraction(&self, s: usize) -> f64 {
        1.0 - self.busy_s(s) / self.step_time_s()
    }
    /// The timeline as Chrome trace-event JSON (opens in Perfetto): one track per stage, one complete
    /// event per action, in device time (microseconds).
    pub fn chrome_trace(&self) -> serde_json::Value {
        let mut events = Vec::new();
        for (s, actions) in self.timeline.iter().enumerate() {
            events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": format!("stage {s}")}}));
            for (a, t0, t1) in actions {
                let cat = match a {
                    Action::Forward { .. } => "forward",
                    Action::Backward { .. } => "backward",
                    Action::BackwardInput { .. } => "backward_input",
                    Action::BackwardWeight { .. } => "backward_weight",
                };
                events.push(serde_json::json!({
                    "name": a.to_string(),
                    "cat": cat,
                    "ph": "X",
                    "pid": 0,
                    "tid": s,
                    "ts": t0 * 1e6,
                    "dur": (t1 - t0) * 1e6,
                    "args": {"micro_batch": a.mb(), "chunk": a.chunk()},
                }));
            }
        }
        serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// The worst stage's idle fraction.
    pub fn bubble_fraction(&self) -> f64 {
        (0..self.device_time_s.len())
            .map(|s| self.idle_fraction(s))
            .fold(0.0, f64::max)
    }
}

/// What one stage reports back.
struct StageResult {
    loss: f64,
    grads: ParamStore,
    stats: CommStats,
    peak: usize,
    peak_bytes: usize,
    end: f64,
    timeline: Vec<(Action, f64, f64)>,
}

const FORWARD: u64 = 0;
const BACKWARD: u64 = 1;

/// A message's tag names the micro-batch, the virtual stage it is addressed to and the direction, so
/// activations and gradients on one link can never be confused.
fn tag(mb: usize, vs: usize, dir: u64) -> u64 {
    ((mb as u64) << 32 | (vs as u64) << 1) | dir
}

/// One forward and backward of `batch` through a pipeline of `partition.stages()` stages, in
/// micro-batches of `layout.micro_batch_size` sequences, on the threads backend.
pub fn pipeline_step(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    partition: &StagePartition,
    timeout: Duration,
) -> Result<PipelineRun> {
    pipeline_steps(cfg, params, batch, layout, partition, timeout, 0)
}

/// As [`pipeline_step`], after running the same step `warmup` times on the same stages (discarded):
/// what a profile measures, with first-touch allocation out of the way.
#[allow(clippy::too_many_arguments)]
pub fn pipeline_steps(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    partition: &StagePartition,
    timeout: Duration,
    warmup: usize,
) -> Result<PipelineRun> {
    let mbs = layout.micro_batch_size.max(1);
    if !batch.batch.is_multiple_of(mbs) {
        return Err(EngineError::Invalid(format!(
            "batch size {} is not divisible by the micro-batch size {mbs}",
            batch.batch
        )));
    }
    let (p, v) = (layout.pp.max(1), layout.vpp.max(1));
    if partition.stages() != p * v {
        return Err(EngineError::Invalid(format!(
            "the partition has {} ranges, the layout needs pp·vpp = {} (one per model chunk)",
            partition.stages(),
            p * v
        )));
    }
    let m = batch.batch / mbs;
    let schedule = build(layout.schedule, p, m, v)?;
    let nv = p * v;
    let micro: Vec<TokenBatch> = batch
        .ids
        .chunks(mbs * batch.seq)
        .map(|ids| TokenBatch {
            ids: ids.to_vec(),
            batch: mbs,
            seq: batch.seq,
        })
        .collect();
    let scale = 1.0 / batch.predicted_tokens().max(1) as f32;
    let (h, seq) = (cfg.hidden_size, batch.seq);

    let wall = std::time::Instant::now();
    let results = ThreadWorld::new(p)
        .timeout(timeout)
        .run(|c| -> Result<StageResult> {
            let s = c.rank();
            // Chunk k of this device is virtual stage k·p + s (Megatron's interleaving).
            let ranges: Vec<_> = (0..v)
                .map(|k| partition.layers[k * p + s].clone())
                .collect();
            let store = params.subset(|n| ranges.iter().any(|r| cfg.stage_owns(n, r)));
            let chunks: Vec<Transformer> = ranges
                .iter()
                .map(|r| {
                    Transformer::stage(cfg, &store, r.clone()).with_recompute(layout.recompute)
                })
                .collect();
            let mut grads = store.zeros_like();
            // Touch the gradient buffers now, not in the first backward (whose time would look like work).
            grads.tensors.iter_mut().for_each(|t| t.fill(0.0));
            // Each device computes on its own thread (its clock is that thread's CPU time).
            let be = CpuBackend::single_threaded();
            let mut stash: HashMap<(usize, usize), ForwardState> = HashMap::new();
            // Zero-bubble schedules: weight gradients waiting for their W action.
            let mut deferred: HashMap<(usize, usize), WeightGrads> = HashMap::new();
            let (mut loss, mut peak, mut peak_bytes) = (0.0, 0, 0);
            let stash_bytes = |stash: &HashMap<(usize, usize), ForwardState>, deferred: &HashMap<(usize, usize), WeightGrads>| {
                stash.values().map(ForwardState::stashed_bytes).sum::<usize>() + deferred.values().map(WeightGrads::bytes).sum::<usize>()
            };
            let mut timeline = Vec::new();
            let mut measured_from = c.stats().clone();
            for pass in 0..=warmup {
                if pass > 0 {
                    // Only the last pass counts.
                    grads.tensors.iter_mut().for_each(|t| t.fill(0.0));
                    (loss, peak, peak_bytes) = (0.0, 0, 0);
                    timeline.clear();
                    measured_from = c.stats().clone();
                }
                for action in &schedule.actions[s] {
                    let started;
                    match *action {
                        Action::Forward { mb, chunk } => {
                            let vs = chunk * p + s;
                            let input = if vs == 0 {
                                StageInput::Tokens(&micro[mb])
                            } else {
                                let mut x = vec![0f32; mbs * seq * h];
                                c.recv((vs - 1) % p, &mut x, tag(mb, vs, FORWARD))?;
                                StageInput::Hidden { x, batch: mbs, seq }
                            };
                            started = c.device_time();
                            let mut state = chunks[chunk].forward_stage(&be, &store, input);
                            timeline.push((*action, started, c.device_time()));
                            if vs + 1 < nv {
                                let out = std::mem::take(&mut state.output);
                                c.send((vs + 1) % p, &out, tag(mb, vs + 1, FORWARD))?;
                            }
                            stash.insert((mb, chunk), state);
                            peak = peak.max(stash.len() + deferred.len());
                            peak_bytes = peak_bytes.max(stash_bytes(&stash, &deferred));
                        }
                        Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                            let split = matches!(action, Action::BackwardInput { .. });
                            let vs = chunk * p + s;
                            let state = stash.remove(&(mb, chunk)).ok_or_else(|| {
                                EngineError::Invalid(format!(
                                    "stage {s}: backward of micro-batch {mb} before its forward"
                                ))
                            })?;
                            let dout = if vs + 1 < nv {
                                let mut d = vec![0f32; mbs * seq * h];
                                c.recv((vs + 1) % p, &mut d, tag(mb, vs, BACKWARD))?;
                                Some(d)
                            } else {
                                None
                            };
                            started = c.device_time();
                            let targets = micro[mb].targets();
                            let (l, dx) = if split {
                                let (l, dx, w) = chunks[chunk].backward_stage_input(&be, &store, state, dout, &targets, scale);
                                deferred.insert((mb, chunk), w);
                                (l, dx)
                            } else {
                                chunks[chunk].backward_stage(&be, &store, &mut grads, state, dout, &targets, scale)
                            };
                            loss += l;
                            timeline.push((*action, started, c.device_time()));
                            peak = peak.max(stash.len() + deferred.len());
                            peak_bytes = peak_bytes.max(stash_bytes(&stash, &deferred));
                            if let Some(dx) = dx {
                                c.send((vs - 1) % p, &dx, tag(mb, vs - 1, BACKWARD))?;
                            }
                        }
                        Action::BackwardWeight { mb, chunk } => {
                            let w = deferred.remove(&(mb, chunk)).ok_or_else(|| {
                                EngineError::Invalid(format!("stage {s}: weight gradient of micro-batch {mb} before its input gradient"))
                            })?;
                            started = c.device_time();
                            w.apply(&be, &mut grads);
                            timeline.push((*action, started, c.device_time()));
                        }
                    }
                }
            }
            // A tied output layer is the first stage's embedding copied to the last: their gradients sum.
            // (The last virtual stage, nv − 1, is on device p − 1.)
            if cfg.tie_word_embeddings && p > 1 && (s == 0 || s == p - 1) {
                let g = Group::new("pp", vec![0, p - 1]);
                let id = grads
                    .id(cfg.embedding_name())
                    .expect("tied embedding on the first and last stage");
                c.all_reduce(&g, &mut grads.tensors[id], ReduceOp::Sum)?;
            }
            let end = c.device_time();
            Ok(StageResult {
                loss,
                grads,
                stats: c.stats().since(&measured_from),
                peak,
                peak_bytes,
                end,
                timeline,
            })
        });
    let wall_time_s = wall.elapsed().as_secs_f64();

    let mut full = params.zeros_like();
    let mut timelines = Vec::new();
    let mut peak_bytes_all = Vec::new();
    let (mut loss, mut stats, mut peaks, mut ends, mut compute) =
        (0.0, Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (s, r) in results.into_iter().enumerate() {
        let StageResult {
            loss: l,
            grads: g,
            stats: st,
            peak,
            peak_bytes,
            end,
            timeline: tl,
        } = r.map_err(|e| EngineError::Invalid(format!("pipeline stage {s}: {e}")))??;
        timelines.push(tl);
        ends.push(end);
        compute.push(st.compute_time_s);
        loss += l;
        for (spec, t) in g.specs.iter().zip(g.tensors) {
            let id = full
                .id(&spec.name)
                .expect("stage parameters are model parameters");
            full.tensors[id] = t;
        }
        stats.push(st);
        peaks.push(peak);
        peak_bytes_all.push(peak_bytes);
    }
    Ok(PipelineRun {
        loss: loss / batch.predicted_tokens().max(1) as f64,
        grads: full,
        stats,
        peak_stashed: peaks,
        peak_stash_bytes: peak_bytes_all,
        device_time_s: ends,
        compute_time_s: compute,
        wall_time_s,
        timeline: timelines,
    })
}

//! Pipeline parallelism over a pp × tp mesh: each stage holds a contiguous range of layers and executes
//! its schedule's action list — the same lists the planner simulates — receiving activations from the
//! previous stage and gradients from the next, stashing each in-flight micro-batch's activations until
//! its backward is done, and accumulating weight gradients over the whole batch. Each stage is a
//! tensor-parallel group of `tp` devices (one device when tp = 1), each holding its shard.

use super::tensor::{finish_grads, gather_tensor, TpGroup, TpShard};
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
    /// Per device, in rank order (`rank = tp_rank + tp · stage`; with tp = 1, rank = stage), here and
    /// in every per-device field below: communication accounting and device clocks.
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
    /// Pipeline stages (devices are `stages · tp`).
    pub stages: usize,
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
        let tp = self.timeline.len() / self.stages.max(1);
        for (s, actions) in self.timeline.iter().enumerate() {
            let name = if tp > 1 {
                format!("stage {} tp {}", s / tp, s % tp)
            } else {
                format!("stage {s}")
            };
            events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": name}}));
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

/// What one device reports back.
pub struct DeviceResult {
    /// Loss summed over the micro-batches this device finished (0 off the last stage and off
    /// tensor-parallel rank 0, so that summing over devices counts every token once).
    pub loss: f64,
    /// This device's shard of the gradients of the parameters it holds.
    pub grads: ParamStore,
    pub stats: CommStats,
    pub peak: usize,
    pub peak_bytes: usize,
    pub end: f64,
    pub timeline: Vec<(Action, f64, f64)>,
}

const FORWARD: u64 = 0;
const BACKWARD: u64 = 1;

/// A message's tag names the micro-batch, the virtual stage it is addressed to and the direction, so
/// activations and gradients on one link can never be confused.
fn tag(mb: usize, vs: usize, dir: u64) -> u64 {
    ((mb as u64) << 32 | (vs as u64) << 1) | dir
}

/// Everything every device of one step shares: the model, the batch in micro-batches, the layout
/// and its schedule.
pub struct MeshStep<'a> {
    cfg: &'a ModelConfig,
    params: &'a ParamStore,
    layout: &'a Layout,
    partition: &'a StagePartition,
    schedule: ferrotron_core::schedule::PipelineSchedule,
    micro: Vec<TokenBatch>,
    scale: f32,
    total_tokens: usize,
}

impl<'a> MeshStep<'a> {
    /// Checks the batch against the layout and builds the schedule.
    pub fn new(
        cfg: &'a ModelConfig,
        params: &'a ParamStore,
        batch: &TokenBatch,
        layout: &'a Layout,
        partition: &'a StagePartition,
    ) -> Result<Self> {
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
        TpShard::check(cfg, layout.tp)?;
        let rows = mbs * batch.seq;
        if layout.sequence_parallel && layout.tp > 1 && !rows.is_multiple_of(layout.tp) {
            return Err(EngineError::Invalid(format!(
                "sequence parallelism: a micro-batch's {rows} tokens do not split over tp={}",
                layout.tp
            )));
        }
        let m = batch.batch / mbs;
        let schedule = build(layout.schedule, p, m, v)?;
        let micro = batch
            .ids
            .chunks(rows)
            .map(|ids| TokenBatch {
                ids: ids.to_vec(),
                batch: mbs,
                seq: batch.seq,
            })
            .collect();
        Ok(Self {
            cfg,
            params,
            layout,
            partition,
            schedule,
            micro,
            scale: 1.0 / batch.predicted_tokens().max(1) as f32,
            total_tokens: batch.predicted_tokens().max(1),
        })
    }

    /// Devices the step runs on.
    pub fn world(&self) -> usize {
        self.layout.pp.max(1) * self.layout.tp.max(1)
    }

    /// Runs device `c.rank()`'s part of the step `1 + warmup` times (only the last counts).
    pub fn run_device<C: Comm>(&self, c: &mut C, warmup: usize) -> Result<DeviceResult> {
        let (cfg, layout) = (self.cfg, self.layout);
        let (p, v, tp) = (layout.pp.max(1), layout.vpp.max(1), layout.tp.max(1));
        let nv = p * v;
        let (s, t) = (c.rank() / tp, c.rank() % tp);
        let device = |stage: usize| stage * tp + t;
        let shard = TpShard::new(cfg, tp, t, layout.sequence_parallel)?;
        let local = shard.local_config(cfg);
        // Chunk k of this device is virtual stage k·p + s (Megatron's interleaving).
        let ranges: Vec<_> = (0..v)
            .map(|k| self.partition.layers[k * p + s].clone())
            .collect();
        let store = shard.shard_store(
            cfg,
            &self
                .params
                .subset(|n| ranges.iter().any(|r| cfg.stage_owns(n, r))),
        )?;
        let chunks: Vec<Transformer> = ranges
            .iter()
            .map(|r| {
                Transformer::stage(&local, &store, r.clone())
                    .with_recompute(layout.recompute)
                    .with_vocab_slice(shard.vocab_slice(cfg))
            })
            .collect();
        let mut grads = store.zeros_like();
        // Touch the gradient buffers now, not in the first backward (whose time would look like work).
        grads.tensors.iter_mut().for_each(|t| t.fill(0.0));
        let group = Group::new("tp", (0..tp).map(|k| s * tp + k).collect());
        let tpg = TpGroup::new(c, group.clone(), shard);
        // Each device computes on its own thread (its clock is that thread's CPU time).
        let be = CpuBackend::single_threaded();
        let (mbs, seq, h) = (
            layout.micro_batch_size.max(1),
            self.micro[0].seq,
            cfg.hidden_size,
        );
        // The hidden states between stages: this device's rows under sequence parallelism.
        let boundary = mbs * seq * h / if shard.sequence_parallel { tp } else { 1 };
        let mut stash: HashMap<(usize, usize), ForwardState> = HashMap::new();
        // Zero-bubble schedules: weight gradients waiting for their W action.
        let mut deferred: HashMap<(usize, usize), WeightGrads> = HashMap::new();
        let (mut loss, mut peak, mut peak_bytes) = (0.0, 0, 0);
        let stash_bytes =
            |stash: &HashMap<(usize, usize), ForwardState>,
             deferred: &HashMap<(usize, usize), WeightGrads>| {
                stash
                    .values()
                    .map(ForwardState::stashed_bytes)
                    .sum::<usize>()
                    + deferred.values().map(WeightGrads::bytes).sum::<usize>()
            };
        let mut timeline = Vec::new();
        let mut measured_from = tpg.comm().stats().clone();
        for pass in 0..=warmup {
            if pass > 0 {
                // Only the last pass counts.
                grads.tensors.iter_mut().for_each(|t| t.fill(0.0));
                (loss, peak, peak_bytes) = (0.0, 0, 0);
                timeline.clear();
                measured_from = tpg.comm().stats().clone();
            }
            for action in &self.schedule.actions[s] {
                let started;
                match *action {
                    Action::Forward { mb, chunk } => {
                        let vs = chunk * p + s;
                        let input = if vs == 0 {
                            StageInput::Tokens(&self.micro[mb])
                        } else {
                            let mut x = vec![0f32; boundary];
                            tpg.comm()
                                .recv(device((vs - 1) % p), &mut x, tag(mb, vs, FORWARD))?;
                            StageInput::Hidden { x, batch: mbs, seq }
                        };
                        started = tpg.comm().device_time();
                        let mut state = chunks[chunk].forward_stage(&be, &tpg, &store, input);
                        tpg.result()?;
                        timeline.push((*action, started, tpg.comm().device_time()));
                        if vs + 1 < nv {
                            let out = std::mem::take(&mut state.output);
                            tpg.comm().send(
                                device((vs + 1) % p),
                                &out,
                                tag(mb, vs + 1, FORWARD),
                            )?;
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
                            let mut d = vec![0f32; boundary];
                            tpg.comm()
                                .recv(device((vs + 1) % p), &mut d, tag(mb, vs, BACKWARD))?;
                            Some(d)
                        } else {
                            None
                        };
                        started = tpg.comm().device_time();
                        let targets = self.micro[mb].targets();
                        let chunk_tf = &chunks[chunk];
                        let (l, dx) = if split {
                            let (l, dx, w) = chunk_tf.backward_stage_input(
                                &be, &tpg, &store, state, dout, &targets, self.scale,
                            );
                            deferred.insert((mb, chunk), w);
                            (l, dx)
                        } else {
                            chunk_tf.backward_stage(
                                &be, &tpg, &store, &mut grads, state, dout, &targets, self.scale,
                            )
                        };
                        tpg.result()?;
                        if t == 0 {
                            loss += l;
                        }
                        timeline.push((*action, started, tpg.comm().device_time()));
                        peak = peak.max(stash.len() + deferred.len());
                        peak_bytes = peak_bytes.max(stash_bytes(&stash, &deferred));
                        if let Some(dx) = dx {
                            tpg.comm().send(
                                device((vs - 1) % p),
                                &dx,
                                tag(mb, vs - 1, BACKWARD),
                            )?;
                        }
                    }
                    Action::BackwardWeight { mb, chunk } => {
                        let w = deferred.remove(&(mb, chunk)).ok_or_else(|| {
                            EngineError::Invalid(format!(
                                "stage {s}: weight gradient of micro-batch {mb} before its input gradient"
                            ))
                        })?;
                        started = tpg.comm().device_time();
                        w.apply(&be, &mut grads);
                        timeline.push((*action, started, tpg.comm().device_time()));
                    }
                }
            }
        }
        drop(tpg);
        // A tied output layer is the first stage's embedding copied to the last: their gradients sum.
        // (The last virtual stage, nv − 1, is on stage p − 1.)
        if cfg.tie_word_embeddings && p > 1 && (s == 0 || s == p - 1) {
            let g = Group::new("pp", vec![device(0), device(p - 1)]);
            let id = grads
                .id(cfg.embedding_name())
                .expect("tied embedding on the first and last stage");
            c.all_reduce(&g, &mut grads.tensors[id], ReduceOp::Sum)?;
        }
        finish_grads(c, cfg, &shard, &group, &mut grads)?;
        let end = c.device_time();
        Ok(DeviceResult {
            loss,
            grads,
            stats: c.stats().since(&measured_from),
            peak,
            peak_bytes,
            end,
            timeline,
        })
    }

    /// The parameters device `rank` holds, as its shard names and shapes them (in store order).
    pub fn device_specs(&self, rank: usize) -> Result<Vec<ferrotron_core::model::ParamSpec>> {
        let (p, v, tp) = (
            self.layout.pp.max(1),
            self.layout.vpp.max(1),
            self.layout.tp.max(1),
        );
        let (s, t) = (rank / tp, rank % tp);
        let local = TpShard::new(self.cfg, tp, t, false)?.local_config(self.cfg);
        let ranges: Vec<_> = (0..v)
            .map(|k| self.partition.layers[k * p + s].clone())
            .collect();
        Ok(local
            .param_specs()
            .into_iter()
            .filter(|spec| ranges.iter().any(|r| self.cfg.stage_owns(&spec.name, r)))
            .collect())
    }

    /// Runs this process's device of the step and collects every device's loss and gradient
    /// shards on rank 0, which returns the combined run (every other rank returns `None`). The
    /// entry for backends with one device per process (MPI); other ranks' communication
    /// statistics stay with them.
    pub fn run_collected<C: Comm>(&self, c: &mut C) -> Result<Option<PipelineRun>> {
        if c.world_size() != self.world() {
            return Err(EngineError::Invalid(format!(
                "layout `{}` needs {} devices, the job has {} ranks",
                self.layout,
                self.world(),
                c.world_size()
            )));
        }
        let wall = std::time::Instant::now();
        let mine = self.run_device(c, 0)?;
        // Tags above any pipeline tag (those fit in 48 bits).
        const COLLECT: u64 = 1 << 60;
        if c.rank() != 0 {
            let head = [
                mine.loss,
                mine.end,
                mine.stats.compute_time_s,
                mine.peak as f64,
                mine.peak_bytes as f64,
            ];
            c.send(0, &head, COLLECT)?;
            for (i, t) in mine.grads.tensors.iter().enumerate() {
                c.send(0, t, COLLECT + 1 + i as u64)?;
            }
            return Ok(None);
        }
        let mut results = vec![mine];
        for r in 1..self.world() {
            let mut head = [0f64; 5];
            c.recv(r, &mut head, COLLECT)?;
            let mut grads = ParamStore::zeros(self.device_specs(r)?);
            for (i, t) in grads.tensors.iter_mut().enumerate() {
                c.recv(r, t, COLLECT + 1 + i as u64)?;
            }
            results.push(DeviceResult {
                loss: head[0],
                grads,
                stats: CommStats {
                    rank: r,
                    compute_time_s: head[2],
                    ..CommStats::default()
                },
                peak: head[3] as usize,
                peak_bytes: head[4] as usize,
                end: head[1],
                timeline: Vec::new(),
            });
        }
        self.combine(results, wall.elapsed().as_secs_f64())
            .map(Some)
    }

    /// Combines every device's result (in rank order) into the step's loss and full gradients.
    pub fn combine(&self, results: Vec<DeviceResult>, wall_time_s: f64) -> Result<PipelineRun> {
        let tp = self.layout.tp.max(1);
        let mut full = self.params.zeros_like();
        let mut run = PipelineRun {
            loss: 0.0,
            grads: ParamStore::zeros(Vec::new()),
            stats: Vec::new(),
            peak_stashed: Vec::new(),
            peak_stash_bytes: Vec::new(),
            device_time_s: Vec::new(),
            compute_time_s: Vec::new(),
            wall_time_s,
            timeline: Vec::new(),
            stages: self.layout.pp.max(1),
        };
        for stage in results.chunks(tp) {
            // Each parameter from the devices of the stage that holds it.
            for spec in &stage[0].grads.specs {
                let shards: Vec<&[f32]> = stage
                    .iter()
                    .map(|r| {
                        r.grads
                            .get(&spec.name)
                            .expect("every device of a stage holds its parameters")
                    })
                    .collect();
                let id = full
                    .id(&spec.name)
                    .expect("stage parameters are model parameters");
                full.tensors[id] = gather_tensor(self.cfg, &full.specs[id], &shards)?;
            }
        }
        for r in results {
            run.loss += r.loss;
            run.compute_time_s.push(r.stats.compute_time_s);
            run.stats.push(r.stats);
            run.peak_stashed.push(r.peak);
            run.peak_stash_bytes.push(r.peak_bytes);
            run.device_time_s.push(r.end);
            run.timeline.push(r.timeline);
        }
        run.loss /= self.total_tokens as f64;
        run.grads = full;
        Ok(run)
    }
}

/// One forward and backward of `batch` through a pipeline of `partition.stages()` stages (each a
/// tensor-parallel group of `layout.tp` devices), in micro-batches of `layout.micro_batch_size`
/// sequences, on the threads backend.
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
    let step = MeshStep::new(cfg, params, batch, layout, partition)?;
    let wall = std::time::Instant::now();
    let results = ThreadWorld::new(step.world())
        .timeout(timeout)
        .run(|c| step.run_device(c, warmup));
    let wall_time_s = wall.elapsed().as_secs_f64();
    let results = results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            res.map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))?
                .map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    step.combine(results, wall_time_s)
}

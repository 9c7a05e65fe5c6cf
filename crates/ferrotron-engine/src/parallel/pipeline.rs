//! Pipeline parallelism: one device executes its stage's action list — the same lists the planner
//! simulates — receiving activations from the previous stage and gradients from the next, stashing
//! each in-flight micro-batch's activations until its backward is done, and accumulating weight
//! gradients over its micro-batches. The mesh around it (tensor-parallel groups, data-parallel
//! replicas) and the runners of a whole step are in `mesh/`.

use super::data::GroupedZero;
use super::tensor::TpGroup;
use crate::comm::{Comm, CommStats};
use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::transformer::{
    ForwardState, ParamStore, StageInput, TokenBatch, Transformer, WeightGrads,
};
use ferrotron_core::schedule::{Action, PipelineSchedule};
use std::collections::HashMap;

/// The result of one pipelined forward/backward over a batch.
pub struct PipelineRun {
    /// Mean loss over every predicted token of the batch.
    pub loss: f64,
    /// Every parameter's gradient, gathered from the stages that hold it.
    pub grads: ParamStore,
    /// Per device, in rank order (`grid`'s), here and in every per-device field below:
    /// communication accounting and device clocks.
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
    /// The run's ranks: which (tp, dp, stage) each device index is.
    pub grid: ferrotron_core::rank::RankGrid,
    /// Per device: memory during the step, measured by term.
    pub memory: Vec<crate::memory::DeviceMemory>,
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
            let at = self.grid.coords(s);
            let mut name = format!("stage {}", at.pp);
            for (size, what, i) in [
                (self.grid.dp, "dp", at.dp),
                (self.grid.cp, "cp", at.cp),
                (self.grid.tp, "tp", at.tp),
            ] {
                if size > 1 {
                    name.push_str(&format!(" {what} {i}"));
                }
            }
            events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": name}}));
            for &(a, t0, t1) in actions {
                events.push(action_event(&a, s, t0, t1));
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

/// One action as a Chrome trace event on track `tid` (device time in seconds; the trace is in µs).
pub fn action_event(a: &Action, tid: usize, t0: f64, t1: f64) -> serde_json::Value {
    serde_json::json!({
        "name": a.to_string(),
        "cat": a.kind(),
        "ph": "X",
        "pid": 0,
        "tid": tid,
        "ts": t0 * 1e6,
        "dur": (t1 - t0) * 1e6,
        "args": {"micro_batch": a.mb(), "chunk": a.chunk()},
    })
}

/// What one device reports back.
pub struct DeviceResult {
    /// Loss summed over the micro-batches this device finished (0 off the last stage and off
    /// tensor-parallel rank 0, so that summing over devices counts every token once).
    pub loss: f64,
    /// This device's shard of the gradients of the parameters it holds, reduced over data-parallel
    /// replicas.
    pub grads: ParamStore,
    pub stats: CommStats,
    pub peak: usize,
    pub peak_bytes: usize,
    pub end: f64,
    pub timeline: Vec<(Action, f64, f64)>,
    /// Memory during the measured pass, by term.
    pub memory: crate::memory::DeviceMemory,
}

/// The device's clock and its compute time so far (what an action's compute is measured from).
pub(super) fn clocks<C: Comm>(tpg: &TpGroup<'_, C>) -> (f64, f64) {
    let mut c = tpg.comm();
    let now = c.device_time();
    (now, c.stats().compute_time_s)
}

const FORWARD: u64 = 0;
const BACKWARD: u64 = 1;

/// A message's tag names the micro-batch, the virtual stage it is addressed to and the direction, so
/// activations and gradients on one link can never be confused.
fn tag(mb: usize, vs: usize, dir: u64) -> u64 {
    ((mb as u64) << 32 | (vs as u64) << 1) | dir
}

/// The tag of the router statistics that travel beside a boundary tensor of tag `t`.
fn router_tag(t: u64) -> u64 {
    t | 1 << 47
}

/// One device's part of a pipelined step: where it sits and what it runs.
pub(crate) struct StageRun<'a> {
    pub schedule: &'a PipelineSchedule,
    /// This device's stage, the pipeline's stages and chunks per device.
    pub stage: usize,
    pub stages: usize,
    pub chunks_per_device: usize,
    /// The rank of the device of stage `s` in this device's pipeline.
    pub device_of: &'a dyn Fn(usize) -> usize,
    /// This device's micro-batches: its replica's, and under context parallelism its part of each
    /// sequence.
    pub micro: &'a [TokenBatch],
    /// Each micro-batch's next-token targets (of the whole sequences).
    pub targets: &'a [Vec<Option<u32>>],
    /// Elements of the hidden states sent between stages (this device's rows under SP).
    pub boundary: usize,
    pub scale: f32,
    /// Whether this device counts the loss (tensor-parallel rank 0).
    pub counts_loss: bool,
    /// This device's memory account.
    pub account: usize,
    /// Extra compute per action (device seconds): a device made slow on purpose (tests, profiling).
    pub extra_compute_s: f64,
    /// The run's precision: the products' arithmetic and the format the boundary tensors travel in.
    pub precision: ferrotron_core::precision::MixedPrecision,
    /// Kernel threads this device computes on (1 when devices share the process's cores).
    pub threads: usize,
    /// A mixture of experts on several replicas: the group over which each micro-batch's router
    /// statistics are summed before its backward (the load-balancing loss of the replicas'
    /// micro-batches together, as one device with all their tokens computes it).
    pub router_group: Option<&'a crate::comm::Group>,
}

/// What a device's pass over its action list measured.
#[derive(Default)]
pub(crate) struct StageOutcome {
    pub loss: f64,
    pub peak: usize,
    pub peak_bytes: usize,
    pub timeline: Vec<(Action, f64, f64)>,
    /// Each timeline action's compute time (its span less the collectives it waited in).
    pub action_compute_s: Vec<f64>,
    /// Transfers between stages: (what, start, end) in device time (a receive's interval is its
    /// wait for the neighbour).
    pub transfers: Vec<(String, f64, f64)>,
    /// The device's memory before the first action and after each one.
    pub memory: Vec<crate::memory::MemorySample>,
    /// The device went over its memory capacity: where it was first seen. The step still runs to
    /// its end so that its peers are not left waiting; the caller ends the run.
    pub over_capacity: Option<EngineError>,
    /// A mixture of experts: per layer of the model, the top-k places the router gave each expert
    /// in this device's micro-batches, then the places each dropped over its capacity (`2 ·
    /// experts` counts; empty rows for the layers elsewhere; empty for a dense model).
    pub expert_tokens: Vec<Vec<f64>>,
}

impl StageOutcome {
    fn add_expert_tokens(&mut self, layers: usize, tokens: &[(usize, Vec<f64>)]) {
        if tokens.is_empty() {
            return;
        }
        self.expert_tokens.resize(layers, Vec::new());
        for (layer, counts) in tokens {
            add_expert_counts(&mut self.expert_tokens, *layer, counts);
        }
    }
}

/// Adds `counts` into row `layer` of per-layer expert counts (rows as long as the longest added).
pub(super) fn add_expert_counts(rows: &mut Vec<Vec<f64>>, layer: usize, counts: &[f64]) {
    if rows.len() <= layer {
        rows.resize(layer + 1, Vec::new());
    }
    let row = &mut rows[layer];
    row.resize(row.len().max(counts.len()), 0.0);
    row.iter_mut().zip(counts).for_each(|(a, b)| *a += b);
}

/// What a pass over the action list holds between actions: the forward states waiting for their
/// backward, the weight gradients waiting for their W action (zero-bubble schedules), and what it
/// measured so far.
#[derive(Default)]
pub(super) struct Pass {
    pub stash: HashMap<(usize, usize), ForwardState>,
    pub deferred: HashMap<(usize, usize), WeightGrads>,
    pub out: StageOutcome,
}

impl Pass {
    /// Records the peak of what is held for later actions, in count and bytes.
    fn note_held(&mut self) {
        let bytes = self
            .stash
            .values()
            .map(ForwardState::stashed_bytes)
            .sum::<usize>()
            + self
                .deferred
                .values()
                .map(WeightGrads::bytes)
                .sum::<usize>();
        self.out.peak = self.out.peak.max(self.stash.len() + self.deferred.len());
        self.out.peak_bytes = self.out.peak_bytes.max(bytes);
    }
}

impl StageRun<'_> {
    /// Executes this device's action list once, its model chunks' parameters and gradients held by
    /// `zero`, collectives through `tpg`.
    pub fn execute<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        zero: &mut GroupedZero,
        chunks: &[Transformer],
    ) -> Result<StageOutcome> {
        // Several devices in one process compute on one thread each (a device's clock is its
        // thread's CPU time); a device with the process to itself uses its cores.
        let be = CpuBackend::with_threads(self.threads.max(1)).computing(self.precision.products());
        let mut pass = Pass::default();
        let now = tpg.comm().device_time();
        pass.out
            .memory
            .push(crate::memory::sample(self.account, now));
        for &action in &self.schedule.actions[self.stage] {
            self.check_capacity(&mut pass.out.over_capacity);
            match action {
                Action::Forward { mb, chunk } => {
                    let mut res = zero.residency(tpg);
                    self.forward(tpg, &mut res, &be, &chunks[chunk], &mut pass, (mb, chunk))?
                }
                Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                    let split = matches!(action, Action::BackwardInput { .. });
                    let at = (mb, chunk);
                    let mut res = zero.residency(tpg);
                    self.backward(tpg, &mut res, &be, &chunks[chunk], &mut pass, at, split)?
                }
                Action::Update { .. } => {
                    return Err(EngineError::Invalid(format!(
                        "stage {}: an update in a synchronous action list",
                        self.stage
                    )))
                }
                Action::BackwardWeight { mb, chunk } => {
                    let w = pass.deferred.remove(&(mb, chunk)).ok_or_else(|| {
                        EngineError::Invalid(format!(
                            "stage {}: weight gradient of micro-batch {mb} before its input gradient",
                            self.stage
                        ))
                    })?;
                    let started = clocks(tpg);
                    let touched = w.tensors();
                    tpg.with_comm(|c| zero.apply_deferred(c, &touched, |g| w.apply(&be, g)));
                    self.computed(tpg, action, started, &mut pass)?;
                }
            }
        }
        self.check_capacity(&mut pass.out.over_capacity);
        Ok(pass.out)
    }

    /// The forward of micro-batch `mb` through `chunk`: its input from the previous stage (or the
    /// tokens), its output to the next.
    pub(super) fn forward<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        res: &mut dyn crate::transformer::Residency,
        be: &CpuBackend,
        model: &Transformer,
        pass: &mut Pass,
        (mb, chunk): (usize, usize),
    ) -> Result<()> {
        let (p, vs) = (self.stages, chunk * self.stages + self.stage);
        let input = if vs == 0 {
            StageInput::Tokens(&self.micro[mb])
        } else {
            let from = (self.device_of)((vs - 1) % p);
            let x = self.receive(tpg, from, tag(mb, vs, FORWARD), format!("F{mb}"), pass)?;
            let (batch, seq) = (self.micro[0].batch, self.micro[0].seq);
            StageInput::Hidden { x, batch, seq }
        };
        // A mixture of experts: the router statistics of the stages before, which the last
        // stage's load-balancing loss takes over every layer.
        let earlier = match self.router_width(model) {
            Some(width) if vs > 0 => {
                let from = (self.device_of)((vs - 1) % p);
                Some(self.receive_router(tpg, from, router_tag(tag(mb, vs, FORWARD)), width)?)
            }
            _ => None,
        };
        let started = clocks(tpg);
        let mut state = model.forward_stage_in(be, tpg, res, input);
        self.computed(tpg, Action::Forward { mb, chunk }, started, pass)?;
        if let Some(v) = earlier {
            state.add_router_tally(&crate::transformer::RouterTally::from_vec(&v));
        }
        pass.out
            .add_expert_tokens(model.cfg.num_layers, state.expert_tokens());
        if vs + 1 < p * self.chunks_per_device {
            let out = std::mem::take(&mut state.output);
            let to = (self.device_of)((vs + 1) % p);
            self.send(
                tpg,
                to,
                &out,
                tag(mb, vs + 1, FORWARD),
                format!("F{mb}"),
                pass,
            )?;
            if let Some(width) = self.router_width(model) {
                let v = state.router_tally_vec(width, 0.0);
                self.send_router(tpg, to, router_tag(tag(mb, vs + 1, FORWARD)), &v)?;
            }
        }
        pass.stash.insert((mb, chunk), state);
        pass.note_held();
        Ok(())
    }

    /// The backward of micro-batch `mb` through `chunk` (only its input gradient when `split`):
    /// the output gradient from the next stage, the input gradient to the previous one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        res: &mut dyn crate::transformer::Residency,
        be: &CpuBackend,
        model: &Transformer,
        pass: &mut Pass,
        (mb, chunk): (usize, usize),
        split: bool,
    ) -> Result<()> {
        let (p, vs) = (self.stages, chunk * self.stages + self.stage);
        let state = pass.stash.remove(&(mb, chunk)).ok_or_else(|| {
            EngineError::Invalid(format!(
                "stage {}: backward of micro-batch {mb} before its forward",
                self.stage
            ))
        })?;
        let dout = if vs + 1 < p * self.chunks_per_device {
            let from = (self.device_of)((vs + 1) % p);
            Some(self.receive(tpg, from, tag(mb, vs, BACKWARD), format!("B{mb}"), pass)?)
        } else {
            None
        };
        let targets = &self.targets[mb];
        let mut state = state;
        // A mixture of experts: the last stage's tally is every layer's; summed over the
        // replicas it is the micro-batch step's, which travels back to every stage before (each
        // stage's layers take the load-balancing loss's gradient from it).
        let router = match self.router_width(model) {
            Some(width) if dout.is_some() => {
                let from = (self.device_of)((vs + 1) % p);
                let v = self.receive_router(tpg, from, router_tag(tag(mb, vs, BACKWARD)), width)?;
                state.set_router_tally(crate::transformer::RouterTally::from_vec(&v));
                Some(v)
            }
            Some(width) => {
                let predicted = targets.iter().filter(|t| t.is_some()).count() as f64;
                let mut v = state.router_tally_vec(width, predicted);
                if let Some(group) = self.router_group {
                    tpg.comm()
                        .all_reduce(group, &mut v, crate::comm::ReduceOp::Sum)
                        .map_err(EngineError::Comm)?;
                }
                state.set_router_tally(crate::transformer::RouterTally::from_vec(&v));
                Some(v)
            }
            None => None,
        };
        let started = clocks(tpg);
        let (loss, dx, w) =
            model.backward_stage_in(be, tpg, res, state, dout, targets, self.scale, split);
        let action = if split {
            Action::BackwardInput { mb, chunk }
        } else {
            Action::Backward { mb, chunk }
        };
        self.computed(tpg, action, started, pass)?;
        if let Some(w) = w {
            pass.deferred.insert((mb, chunk), w);
        }
        if self.counts_loss {
            pass.out.loss += loss;
        }
        pass.note_held();
        if let Some(dx) = dx {
            let to = (self.device_of)((vs - 1) % p);
            self.send(
                tpg,
                to,
                &dx,
                tag(mb, vs - 1, BACKWARD),
                format!("B{mb}"),
                pass,
            )?;
            if let Some(v) = router {
                self.send_router(tpg, to, router_tag(tag(mb, vs - 1, BACKWARD)), &v)?;
            }
        }
        Ok(())
    }

    /// A mixture of experts: the length of the router statistics a micro-batch carries.
    fn router_width(&self, model: &Transformer) -> Option<usize> {
        model.cfg.moe.as_ref().map(|m| 2 * m.num_experts + 2)
    }

    /// Router statistics to the device `to`.
    fn send_router<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        to: usize,
        tag: u64,
        v: &[f64],
    ) -> Result<()> {
        tpg.comm().send(to, v, tag).map_err(EngineError::Comm)
    }

    /// Router statistics (`width` numbers) from the device `from`.
    fn receive_router<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        from: usize,
        tag: u64,
        width: usize,
    ) -> Result<Vec<f64>> {
        let mut v = vec![0f64; width];
        tpg.comm()
            .recv(from, &mut v, tag)
            .map_err(EngineError::Comm)?;
        Ok(v)
    }

    /// Ends an action's compute: its collectives' errors, a drill's extra time, its timeline entry.
    pub(super) fn computed<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        action: Action,
        started: (f64, f64),
        pass: &mut Pass,
    ) -> Result<()> {
        tpg.result()?;
        if self.extra_compute_s > 0.0 {
            crate::comm::burn_cpu(self.extra_compute_s);
        }
        let (ended, computed) = clocks(tpg);
        pass.out.timeline.push((action, started.0, ended));
        pass.out.action_compute_s.push(computed - started.1);
        pass.out
            .memory
            .push(crate::memory::sample(self.account, ended));
        Ok(())
    }

    /// A boundary tensor from the device `from`, its wait recorded as a transfer.
    fn receive<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        from: usize,
        tag: u64,
        what: String,
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let mut x = vec![0f32; self.boundary];
        timed(tpg, pass, format!("recv {what} from {from}"), || {
            crate::half_storage::Wire::of(self.precision).recv(*tpg.comm(), from, &mut x, tag)
        })?;
        Ok(x)
    }

    /// A boundary tensor to the device `to`, recorded as a transfer.
    fn send<C: Comm>(
        &self,
        tpg: &TpGroup<'_, C>,
        to: usize,
        data: &[f32],
        tag: u64,
        what: String,
        pass: &mut Pass,
    ) -> Result<()> {
        timed(tpg, pass, format!("send {what} to {to}"), || {
            crate::half_storage::Wire::of(self.precision).send(*tpg.comm(), to, data, tag)
        })?;
        Ok(())
    }

    /// Notes the first moment this device is over its memory capacity.
    pub(super) fn check_capacity(&self, over: &mut Option<EngineError>) {
        if over.is_none() {
            if let Some(at) = crate::memory::over_capacity(self.account) {
                *over = Some(EngineError::OutOfMemory {
                    device: (self.device_of)(self.stage),
                    capacity: crate::memory::capacity(self.account).unwrap_or(0),
                    at: Box::new(at),
                });
            }
        }
    }
}

/// Runs a transfer between stages and records it, in device time, as `label`.
fn timed<C: Comm, E>(
    tpg: &TpGroup<'_, C>,
    pass: &mut Pass,
    label: String,
    transfer: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let t0 = tpg.comm().device_time();
    transfer()?;
    pass.out
        .transfers
        .push((label, t0, tpg.comm().device_time()));
    Ok(())
}

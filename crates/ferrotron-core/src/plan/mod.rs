//! The planner: memory per term per device, bytes moved per parallel dimension, compute and
//! communication time through the pipeline schedule's simulation, the rules a layout must keep, a
//! search over layouts, and an explanation in the order the source texts give: reduce, shard the
//! optimizer, tensor-parallel inside a node, pipeline across nodes.

pub mod calibrate;
mod cost;
mod explain;
mod memory;
mod search;
mod spec;

pub use crate::precision::{Dtype, StateDtypes};
pub use cost::{balanced_places, expert_all_to_all_bytes};
pub use cost::{
    gemm_time, layer_forward_flops, layer_gemm_shapes, layer_time, links, step_flops,
    tp_bytes_per_device, LayerTime, Links, Traffic,
};
pub use explain::{ranking_note, search_notes, within_error_of_best};
pub use memory::{
    largest_unit_params, layer_activation_bytes, padded_vocab, params_on_device,
    stage_activation_stash, stage_memory,
};
pub use search::{search, why_no_layout};
pub use spec::{ActivationModel, AttentionKernel, OptimizerKind, PlanModel, PLAN_MODEL_PRESETS};

use crate::error::{ConfigError, Result};
use crate::layout::{Layout, Schedule};
use crate::model::ModelConfig;
use crate::schedule::{build, simulate, StagePartition};
use crate::topology::Cluster;

/// Bytes per device by term, as the design names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryTerms {
    pub weights: u64,
    pub gradients: u64,
    pub master_weights: u64,
    pub optimizer_states: u64,
    pub activations: u64,
    pub comm_buffers: u64,
    pub total: u64,
}

impl MemoryTerms {
    pub fn with_total(mut self) -> Self {
        self.total = self.weights
            + self.gradients
            + self.master_weights
            + self.optimizer_states
            + self.activations
            + self.comm_buffers;
        self
    }
    /// (name, bytes) of the six terms, in the design's order.
    pub fn terms(&self) -> [(&'static str, u64); 6] {
        [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("master_weights", self.master_weights),
            ("optimizer_states", self.optimizer_states),
            ("activations", self.activations),
            ("comm_buffers", self.comm_buffers),
        ]
    }
    /// Each term's larger value of the two (a peak over steps), and the larger total.
    pub fn max_each(&self, o: &MemoryTerms) -> MemoryTerms {
        MemoryTerms {
            weights: self.weights.max(o.weights),
            gradients: self.gradients.max(o.gradients),
            master_weights: self.master_weights.max(o.master_weights),
            optimizer_states: self.optimizer_states.max(o.optimizer_states),
            activations: self.activations.max(o.activations),
            comm_buffers: self.comm_buffers.max(o.comm_buffers),
            total: self.total.max(o.total),
        }
    }
    pub fn largest(&self) -> (&'static str, u64) {
        self.terms()
            .into_iter()
            .max_by_key(|t| t.1)
            .expect("six terms")
    }
}

/// Everything the planner is asked about.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub model: PlanModel,
    pub cluster: Cluster,
    pub seq: usize,
    pub global_batch: usize,
    pub precision: StateDtypes,
    pub optimizer: OptimizerKind,
    pub activation_model: ActivationModel,
    /// What attention keeps for backward: the engine's memory-efficient kernel, or materialised
    /// probabilities (a T² term per head).
    pub attention: AttentionKernel,
    /// LoRA on a frozen base: gradients, master weights and optimizer state for the adapters only.
    pub lora: Option<crate::model::LoraConfig>,
    /// QLoRA: the frozen base's projections stored quantized (their real bytes, constants
    /// included); the embeddings, norms and head keep the weights' format.
    pub quantize_base: Option<crate::precision::BaseQuantization>,
    /// Fraction of device memory kept free (allocator fragmentation, framework, kernels' workspace).
    pub memory_reserve: f64,
    /// Allow a tensor-parallel group to span nodes (priced on the slow link).
    pub force_cross_node_tp: bool,
    /// Let the search consider the asynchronous schedules (PipeDream, PipeDream-2BW), which change
    /// the optimizer's semantics; a layout that names one is priced either way.
    pub allow_async: bool,
}

impl PlanInput {
    /// `model` on `cluster` at `seq` tokens × `global_batch` sequences, with the common choices:
    /// mixed precision (2 + 2 + 4 + 8 bytes per parameter), Adam, the ferrotron activation model,
    /// memory-efficient attention, no LoRA, 10% of memory in reserve, tensor parallelism inside nodes.
    pub fn new(model: PlanModel, cluster: Cluster, seq: usize, global_batch: usize) -> Self {
        Self {
            model,
            cluster,
            seq,
            global_batch,
            precision: StateDtypes::default(),
            optimizer: OptimizerKind::Adam,
            activation_model: ActivationModel::Ferrotron,
            attention: AttentionKernel::Flash,
            lora: None,
            quantize_base: None,
            memory_reserve: 0.1,
            force_cross_node_tp: false,
            allow_async: false,
        }
    }

    pub fn usable_memory(&self) -> u64 {
        (self.cluster.device_memory_bytes as f64 * (1.0 - self.memory_reserve)) as u64
    }

    /// What must hold whatever the layout: each failure names its flag.
    pub fn check(&self) -> Result<()> {
        let flag = |name: &str, msg: String| ConfigError::Invalid(format!("{name}: {msg}"));
        if self.seq == 0 {
            return Err(flag("--seq", "a sequence needs at least one token".into()));
        }
        if self.global_batch == 0 {
            return Err(flag(
                "--global-batch",
                "a step needs at least one sequence".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.memory_reserve) {
            return Err(flag(
                "--reserve",
                format!("{} is not a fraction in [0, 1)", self.memory_reserve),
            ));
        }
        if let (Some(q), None) = (self.quantize_base, &self.lora) {
            return Err(flag(
                "--quantize-base",
                format!("{q} quantizes a frozen base: give --lora-rank too"),
            ));
        }
        if let (Some(q), PlanModel::Shape(cfg)) = (self.quantize_base, &self.model) {
            crate::model::check_quantized_base(cfg)
                .map_err(|why| flag("--quantize-base", format!("{q}: {why}")))?;
        }
        if let Some(lora) = &self.lora {
            match &self.model {
                PlanModel::Shape(cfg) => lora
                    .validate(cfg)
                    .map_err(|e| flag("--lora-rank", e.to_string()))?,
                PlanModel::ParamsOnly(_) => {
                    return Err(flag(
                        "--lora-rank",
                        "LoRA adapters are sized by the model's projections: give a model shape,                          not params=N"
                            .into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The planner's verdict on one layout. Field names are a stable interface (`plan --json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub layout: Layout,
    pub num_micro_batches: usize,
    /// The device with the largest total.
    pub memory_bytes: MemoryTerms,
    pub memory_bytes_per_stage: Vec<MemoryTerms>,
    /// Per stage: the routed experts' part of `weights` (0 for a dense model).
    pub expert_weight_bytes_per_stage: Vec<u64>,
    /// Per stage: the host memory an asynchronous checkpoint's copy holds while it is written
    /// (`checkpoint_async`; not device memory).
    pub checkpoint_snapshot_bytes: Vec<u64>,
    /// Transformer layers on one device of each stage (its chunks together); uneven when pp·vpp does
    /// not divide the layers or the layout names the split.
    pub layers_per_stage: Vec<usize>,
    /// Per stage: time computing in one step, and the fraction of the step it is idle.
    pub compute_time_per_stage_s: Vec<f64>,
    pub bubble_fraction_per_stage: Vec<f64>,
    pub capacity_bytes: u64,
    pub usable_bytes: u64,
    pub comm_bytes_per_step: Traffic,
    pub compute_time_s: f64,
    pub dp_comm_time_s: f64,
    /// Communication inside the forward and the backward actions in one step (tensor-parallel
    /// collectives, ZeRO-3 gathers), per device, the mean over stages.
    pub action_comm_time_s: (f64, f64),
    /// The optimizer step (memory-bound) after the gradient reduction.
    pub optimizer_time_s: f64,
    /// Memory work on the gradients outside the actions: zeroed before the first micro-batch, and
    /// this device's share read for the global norm after the reduction.
    pub grad_zeroing_time_s: f64,
    pub grad_norm_time_s: f64,
    pub bubble_fraction: f64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub tflops_per_device: f64,
    /// Model FLOPs utilisation: the step's model FLOPs (forward and backward: 2 FLOP per matmul
    /// parameter and token, three times, plus attention's QKᵀ and PV over the whole T×T; no
    /// recompute; with LoRA two passes, the base's weight gradients left out) over the step time
    /// and the devices' peak.
    pub mfu: f64,
    pub fits: bool,
    pub explain: Vec<String>,
}

impl Plan {
    /// The MFU of this layout's step had it taken `step_s` (a measured step): the same model FLOPs
    /// and peak as [`Plan::mfu`], so the two differ exactly as the step times do.
    pub fn mfu_at(&self, step_s: f64) -> f64 {
        if step_s > 0.0 {
            self.mfu * self.step_time_s / step_s
        } else {
            0.0
        }
    }
}

fn rule(field: &str, msg: String) -> ConfigError {
    ConfigError::Field {
        file: "--layout".into(),
        field: field.into(),
        msg,
    }
}

/// The rules every layout must keep on this model and cluster; each failure names the key.
/// Tokens of each sequence one device holds: context parallelism splits every sequence over cp.
pub fn local_seq(input: &PlanInput, l: &Layout) -> usize {
    input.seq / l.cp.max(1)
}

pub fn check_layout(input: &PlanInput, l: &Layout) -> Result<()> {
    input.check()?;
    let c = &input.cluster;
    if l.world_size() > c.world_size() {
        // Blame the largest dimension: that is the one a user mistyped or must shrink.
        let blamed = [("pp", l.pp), ("tp", l.tp), ("cp", l.cp), ("dp", l.dp)]
            .into_iter()
            .max_by_key(|&(_, n)| n)
            .map_or("dp", |(k, _)| k);
        let product = if l.cp > 1 {
            format!("dp·cp·tp·pp = {}·{}·{}·{}", l.dp, l.cp, l.tp, l.pp)
        } else {
            format!("dp·tp·pp = {}·{}·{}", l.dp, l.tp, l.pp)
        };
        let devices = match l.world_size() {
            usize::MAX => "more than 2⁶⁴".to_string(),
            n => n.to_string(),
        };
        return Err(rule(
            blamed,
            format!(
                "{product} = {devices} devices, but the cluster has {}",
                c.world_size()
            ),
        ));
    }
    check_context(input, l)?;
    if !input.global_batch.is_multiple_of(l.dp) {
        return Err(rule(
            "dp",
            format!(
                "the global batch of {} sequences does not divide among dp={} replicas",
                input.global_batch, l.dp
            ),
        ));
    }
    if !input.global_batch.is_multiple_of(l.dp * l.micro_batch_size) {
        return Err(rule(
            "mbs",
            format!(
                "each replica's {} sequences are not divisible by mbs={}",
                input.global_batch / l.dp,
                l.micro_batch_size
            ),
        ));
    }
    if l.tp > c.devices_per_node && !input.force_cross_node_tp {
        return Err(rule("tp", format!("tp={} spans nodes of {} devices: tensor parallelism needs the intra-node link (force it to price the slow link)", l.tp, c.devices_per_node)));
    }
    if l.tp <= c.devices_per_node
        && !c.devices_per_node.is_multiple_of(l.tp)
        && !input.force_cross_node_tp
    {
        return Err(rule("tp", format!("tp={} does not divide the {} devices of a node, so some groups would span two nodes", l.tp, c.devices_per_node)));
    }
    if l.schedule.is_async() {
        if l.vpp > 1 {
            return Err(rule(
                "vpp",
                format!(
                    "schedule={} runs one chunk per stage (vpp=1)",
                    l.schedule.name()
                ),
            ));
        }
        if l.zero > 1 {
            return Err(rule(
                "zero",
                format!(
                    "schedule={} keeps whole weight versions and per-update gradients on each \
                     replica; ZeRO-{} would shard them (use zero=0 or 1)",
                    l.schedule.name(),
                    l.zero
                ),
            ));
        }
        if input.precision.weights == Dtype::Fp16 {
            return Err(rule(
                "schedule",
                format!(
                    "schedule={}: fp16's loss scaling skips the steps whose gradients overflow, \
                     and an asynchronous pipeline applies every update it has begun (use bf16)",
                    l.schedule.name()
                ),
            ));
        }
        let m = input.global_batch / (l.dp * l.micro_batch_size).max(1);
        if l.schedule == Schedule::TwoBw && m < l.pp {
            return Err(rule(
                "schedule",
                format!(
                    "schedule=2bw coalesces a step's {m} micro-batches into one update and needs \
                     at least pp={} of them",
                    l.pp
                ),
            ));
        }
    }
    if l.vpp > 1 && l.schedule != Schedule::Interleaved {
        return Err(rule(
            "vpp",
            format!("vpp={} needs schedule=interleaved", l.vpp),
        ));
    }
    if let PlanModel::Shape(cfg) = &input.model {
        check_model_rules(input, cfg, l)?;
    }
    Ok(())
}

/// Context parallelism's rules: sequences cut into 2·cp equal chunks; all-to-all inside a node
/// (four all-to-alls per layer want the fast link), over heads that divide (checked with the model).
fn check_context(input: &PlanInput, l: &Layout) -> Result<()> {
    if l.cp <= 1 {
        return Ok(());
    }
    if !input.seq.is_multiple_of(2 * l.cp) {
        return Err(rule(
            "cp",
            format!(
                "cp={} cuts each sequence into 2·cp = {} equal chunks (causal load balance), and \
                 {} tokens do not divide by {}",
                l.cp,
                2 * l.cp,
                input.seq,
                2 * l.cp
            ),
        ));
    }
    let grid = l.rank_grid(input.cluster.devices_per_node);
    if l.cp_comm == crate::layout::CpComm::A2a && !grid.within_nodes(crate::rank::Dim::Cp) {
        return Err(rule(
            "cp_comm",
            format!(
                "cp_comm=a2a over cp={} spans nodes of {} devices: its all-to-alls need the \
                 intra-node link (use cp_comm=ring across nodes)",
                l.cp, input.cluster.devices_per_node
            ),
        ));
    }
    Ok(())
}

/// The rules a layout keeps on a model given by its shape: the tensor-parallel split, enough layers
/// for the stages, learned positions for the sequence, interleaving's micro-batches.
fn check_model_rules(input: &PlanInput, cfg: &ModelConfig, l: &Layout) -> Result<()> {
    if let Err(why) = cfg.tensor_parallel_split(l.tp) {
        return Err(rule("tp", format!("tp={}: {why}", l.tp)));
    }
    if let Err((key, why)) = l.experts_fit(cfg) {
        return Err(rule(key, why));
    }
    if l.cp > 1 && l.cp_comm == crate::layout::CpComm::A2a {
        let heads = cfg.num_heads / l.tp;
        let kv = (cfg.num_kv_heads / l.tp).max(1);
        if !heads.is_multiple_of(l.cp) || !(kv.is_multiple_of(l.cp) || l.cp.is_multiple_of(kv)) {
            return Err(rule(
                "cp_comm",
                format!(
                    "cp_comm=a2a gives each of cp={} devices heads / cp query heads: {heads} query \
                     heads per device (after tp={}) must divide by cp, and {kv} KV heads must divide \
                     by cp or cp by them (use cp_comm=ring)",
                    l.cp, l.tp
                ),
            ));
        }
    }
    if l.pp * l.vpp > cfg.num_layers {
        return Err(rule(
            "pp",
            format!(
                "{} layers cannot fill pp·vpp = {} stages (each needs at least one layer)",
                cfg.num_layers,
                l.pp * l.vpp
            ),
        ));
    }
    // A split by compute exists once pp·vpp ≤ layers (checked above); a named one may not add up.
    if l.stages.is_some() {
        StagePartition::for_layout(cfg, l)?;
    }
    if input.seq > cfg.max_position_embeddings && cfg.arch == crate::model::Arch::Gpt2 {
        return Err(rule(
            "seq",
            format!(
                "sequence length {} exceeds the model's {} learned positions",
                input.seq, cfg.max_position_embeddings
            ),
        ));
    }
    let m = input.global_batch / (l.dp * l.micro_batch_size);
    if l.schedule == Schedule::Interleaved && l.vpp > 1 && !m.is_multiple_of(l.pp) {
        return Err(rule(
            "schedule",
            format!(
                "interleaving needs the {m} micro-batches per pipeline to be a multiple of pp={}",
                l.pp
            ),
        ));
    }
    Ok(())
}

/// Layers of each virtual stage, as the engine splits them (`StagePartition::for_layout`: the
/// layers the layout names, otherwise split by compute); empty for a split `check_layout` refuses.
pub fn chunk_layers(cfg: &ModelConfig, l: &Layout) -> std::rc::Rc<[usize]> {
    // Every stage's memory and costs ask for the same split; the search prices thousands of layouts
    // of deep models, so the last split is kept (per thread) and shared rather than recomputed or
    // copied per stage.
    type Key = (bool, [usize; 6], Option<crate::layout::NamedStages>);
    thread_local! {
        static LAST: std::cell::RefCell<Option<(Key, std::rc::Rc<[usize]>)>> = const { std::cell::RefCell::new(None) };
    }
    let key = (
        cfg.arch == crate::model::Arch::Llama,
        [
            cfg.num_layers,
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.intermediate_size,
            cfg.q_dim() * (1 << 20) + cfg.kv_dim(),
            l.pp * l.vpp,
        ],
    );
    LAST.with(|last| {
        // Compared in place: a named split is a large array, and copying it per call would cost
        // more than the cache saves.
        if let Some(((arch, shape, stages), v)) = &*last.borrow() {
            if (*arch, shape, stages) == (key.0, &key.1, &l.stages) {
                return v.clone();
            }
        }
        let v: std::rc::Rc<[usize]> = StagePartition::for_layout(cfg, l)
            .map(|p| p.counts())
            .unwrap_or_default()
            .into();
        *last.borrow_mut() = Some(((key.0, key.1, l.stages), v.clone()));
        v
    })
}

/// Layers on one device of pipeline stage `stage`: its chunks' layers.
pub fn stage_layers(cfg: &ModelConfig, l: &Layout, stage: usize) -> usize {
    chunk_layers(cfg, l)
        .iter()
        .skip(stage)
        .step_by(l.pp.max(1))
        .sum()
}

/// Blocks with experts on stage `stage` (over its chunks), a mixture of experts' or none.
pub fn stage_expert_layers(cfg: &ModelConfig, l: &Layout, stage: usize) -> usize {
    let Some(m) = &cfg.moe else { return 0 };
    let chunks = chunk_layers(cfg, l);
    let mut first = 0;
    let mut count = 0;
    for (vs, &n) in chunks.iter().enumerate() {
        if vs % l.pp.max(1) == stage {
            count += (first..first + n).filter(|&i| m.has_experts(i)).count();
        }
        first += n;
    }
    count
}

/// Peak chunk stashes of stage `s` in closed form (what the schedule simulation measures for these
/// schedules; an upper bound for ZB-H1, whose weight gradients may wait p − s − 1 slots).
pub fn in_flight(l: &Layout, m: usize, s: usize) -> usize {
    let p = l.pp;
    match l.schedule {
        Schedule::Gpipe => m * l.vpp,
        Schedule::OneFOneB => m.min(p - s),
        Schedule::Interleaved => (((p - s - 1) * 2 + (l.vpp - 1) * p) + 1).min(m * l.vpp),
        Schedule::Zbh1 => m.min(p - s) + m.min(p - s - 1),
        // No flush: 1F1B's steady state across steps.
        Schedule::PipeDream | Schedule::TwoBw => p - s,
    }
}

/// Steps an asynchronous schedule is simulated over to find its steady state.
const ASYNC_STEPS: usize = 4;

/// What simulating a layout's schedule gives the plan: the timeline (of one step, or of
/// [`ASYNC_STEPS`] steps without a flush), and per step the pipeline's time and each stage's busy
/// time (asynchronous: the steady state, the difference between runs of more and fewer steps, with
/// the updates inside).
struct Simulated {
    timeline: crate::schedule::Timeline,
    costs: cost::Costs,
    step_s: f64,
    busy: Vec<f64>,
}

/// The layout's pipeline schedule simulated with the planner's per-action costs, and the costs
/// (none for a model given only as a parameter count).
fn simulated(input: &PlanInput, l: &Layout) -> Result<Option<Simulated>> {
    let m = input.global_batch / (l.dp * l.micro_batch_size);
    let PlanModel::Shape(cfg) = &input.model else {
        return Ok(None);
    };
    let costs = cost::costs(input, cfg, l, params_on_device(cfg, l, 0));
    if !l.schedule.is_async() {
        let tl = simulate(&build(l.schedule, l.pp, m, l.vpp)?, &costs.actions)?;
        return Ok(Some(Simulated {
            step_s: tl.makespan,
            busy: tl.busy.clone(),
            timeline: tl,
            costs,
        }));
    }
    // Each update reduces its gradients over the replicas and steps the optimizer (PipeDream: per
    // micro-batch); both are inside the lists. Updates wait for every stage (global-norm clipping).
    let with_updates: Vec<crate::schedule::ActionCosts> = costs
        .actions
        .iter()
        .map(|a| crate::schedule::ActionCosts {
            update: costs.per_step_time(),
            ..*a
        })
        .collect();
    let run = |steps: usize| -> Result<crate::schedule::Timeline> {
        simulate(
            &crate::schedule::build_async(l.schedule, l.pp, m, steps, true)?,
            &with_updates,
        )
    };
    let (long, short) = (run(ASYNC_STEPS)?, run(ASYNC_STEPS - 2)?);
    let step_s = (long.makespan - short.makespan) / 2.0;
    let busy = long
        .busy
        .iter()
        .zip(&short.busy)
        .map(|(a, b)| (a - b) / 2.0)
        .collect();
    Ok(Some(Simulated {
        timeline: long,
        costs,
        step_s,
        busy,
    }))
}

/// The timeline the planner predicts for one step of `l` (stages × time, every action).
pub fn simulated_timeline(
    input: &PlanInput,
    l: &Layout,
) -> Result<Option<crate::schedule::Timeline>> {
    check_layout(input, l)?;
    Ok(simulated(input, l)?.map(|s| s.timeline))
}

/// Evaluates one layout completely, simulating its pipeline schedule.
pub fn evaluate(input: &PlanInput, l: &Layout) -> Result<Plan> {
    check_layout(input, l)?;
    let m = input.global_batch / (l.dp * l.micro_batch_size);
    let sim = simulated(input, l)?;
    let stages: Vec<MemoryTerms> = (0..l.pp)
        .map(|s| {
            let flight = sim.as_ref().map_or(0, |t| t.timeline.peak_in_flight[s]);
            let mut m = stage_memory(input, l, s, flight);
            // A split backward holds stashes and deferred weight-gradient jobs in the proportions
            // the simulation saw.
            let held = sim.as_ref().map_or(&[][..], |t| &t.timeline.held[s][..]);
            if let Some(a) = memory::split_backward_activations(input, l, s, held) {
                m.activations = a as u64;
                m = m.with_total();
            }
            m
        })
        .collect();
    let worst = *stages
        .iter()
        .max_by_key(|m| m.total)
        .expect("at least one stage");
    let usable = input.usable_memory();
    let mut plan = Plan {
        layout: *l,
        num_micro_batches: m,
        memory_bytes: worst,
        memory_bytes_per_stage: stages,
        expert_weight_bytes_per_stage: (0..l.pp)
            .map(|s| memory::expert_weight_bytes(input, l, s))
            .collect(),
        checkpoint_snapshot_bytes: (0..l.pp)
            .map(|s| memory::checkpoint_snapshot_bytes(input, l, s))
            .collect(),
        layers_per_stage: match &input.model {
            PlanModel::Shape(cfg) => (0..l.pp).map(|s| stage_layers(cfg, l, s)).collect(),
            PlanModel::ParamsOnly(_) => Vec::new(),
        },
        compute_time_per_stage_s: Vec::new(),
        bubble_fraction_per_stage: Vec::new(),
        capacity_bytes: input.cluster.device_memory_bytes,
        usable_bytes: usable,
        comm_bytes_per_step: sim.as_ref().map_or(Traffic::default(), |c| c.costs.traffic),
        compute_time_s: 0.0,
        dp_comm_time_s: 0.0,
        action_comm_time_s: (0.0, 0.0),
        optimizer_time_s: 0.0,
        grad_zeroing_time_s: 0.0,
        grad_norm_time_s: 0.0,
        bubble_fraction: 0.0,
        step_time_s: 0.0,
        tokens_per_s: 0.0,
        tflops_per_device: 0.0,
        mfu: 0.0,
        fits: worst.total <= usable,
        explain: Vec::new(),
    };
    if let (Some(sim), PlanModel::Shape(cfg)) = (sim, &input.model) {
        let (costs, busy) = (&sim.costs, &sim.busy);
        let world = l.world_size() as f64;
        // Asynchronous schedules hold their reductions and updates inside the lists.
        let step = if l.schedule.is_async() {
            sim.step_s
        } else {
            sim.step_s + costs.per_step_time()
        };
        let frozen = input.lora.is_some();
        let (model_flops, hw_flops) = step_flops(
            cfg,
            l,
            input.seq,
            input.global_batch,
            frozen,
            input.attention,
        );
        plan.compute_time_s = busy.iter().copied().fold(0.0, f64::max);
        plan.dp_comm_time_s = costs.dp_time;
        let per_device = |f: fn(&(f64, f64)) -> f64| {
            m as f64 * costs.action_comm.iter().map(f).sum::<f64>() / l.pp as f64
        };
        plan.action_comm_time_s = (per_device(|c| c.0), per_device(|c| c.1));
        plan.optimizer_time_s = costs.optimizer_time;
        plan.grad_zeroing_time_s = costs.grad_zeroing_time;
        plan.grad_norm_time_s = costs.grad_norm_time;
        let idle = |s: usize| (1.0 - busy[s] / sim.step_s.max(f64::MIN_POSITIVE)).max(0.0);
        plan.bubble_fraction_per_stage = (0..l.pp).map(idle).collect();
        plan.bubble_fraction = plan
            .bubble_fraction_per_stage
            .iter()
            .copied()
            .fold(0.0, f64::max);
        plan.compute_time_per_stage_s = busy.clone();
        plan.step_time_s = step;
        plan.tokens_per_s = (input.global_batch * input.seq) as f64 / step;
        plan.tflops_per_device = hw_flops / (step * world) / 1e12;
        plan.mfu = model_flops / (step * world * input.cluster.peak_flops);
    }
    plan.explain = explain::layout_notes(input, &plan);
    Ok(plan)
}
#[cfg(test)]
mod tests;

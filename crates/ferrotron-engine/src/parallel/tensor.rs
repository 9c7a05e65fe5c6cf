//! Tensor parallelism (Megatron's splits): which slice of every Hugging Face tensor a device of the
//! tensor-parallel group holds, the shard's own model shape, cutting a full tensor into a shard and
//! gathering shards back, and the group's collectives for the executor. One module, used by loading,
//! `grads`, `verify`, checkpoints and tests.
//!
//! - Attention: q/k/v column-parallel by heads, the output projection row-parallel. When tp exceeds
//!   the KV heads (tp a multiple of them), each KV head is replicated over the tp/kv devices whose query
//!   heads use it, and its gradient summed over them.
//! - MLP: gate/up (GPT-2 c_fc) column-parallel, down (c_proj) row-parallel; the intermediate size may
//!   split unevenly (the first devices take one more column).
//! - Embedding and output layer: vocab-parallel, the vocabulary padded to a multiple of tp; padding
//!   rows are zero, masked out of the loss, and dropped when gathering.
//! - Norms, row-parallel biases, GPT-2's position embedding: replicated. Without sequence parallelism
//!   their gradients are identical on every device by construction (every device sees every row);
//!   with it each device sees its rows only, so their gradients are summed over the group.

use super::context::{self, ContextShard};
use super::expert;
pub use super::slice::Slice;
pub(crate) use super::slice::{dims, one};
use super::weights::WeightSource;
use crate::comm::{Comm, CommError, Group, ReduceOp};
use crate::error::{EngineError, Result};
use crate::half_storage::Wire;
use crate::kernels::nf4::Nf4Matrix;
use crate::kernels::{AttnGradInputs, AttnShape, Backend, Qkv, QkvGrads};
use crate::transformer::{ParamStore, ShardCollectives, VocabSlice};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{
    adapter_parts, projection_split, AdapterHalf, Arch, ModelConfig, ParamSpec, TargetSplit,
    WeightLayout,
};
use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

/// One device's place in a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub size: usize,
    pub rank: usize,
    pub sequence_parallel: bool,
    /// `etp=1`: each routed expert whole on the one device of the group whose block of the
    /// experts holds it (`ExpertShard::block`), not cut by columns.
    pub experts_whole: bool,
}

/// `len` split into `parts` nearly equal pieces (the first `len % parts` one longer); piece `i`.
fn piece(len: usize, parts: usize, i: usize) -> Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

impl TpShard {
    /// Checks that `cfg` splits over `size` devices, with a clear error naming what does not divide.
    pub fn check(cfg: &ModelConfig, size: usize) -> Result<()> {
        let bad = |what: String| {
            Err(EngineError::Invalid(format!(
                "tensor parallelism tp={size}: {what}"
            )))
        };
        cfg.tensor_parallel_split(size).or_else(bad)
    }

    pub fn new(
        cfg: &ModelConfig,
        size: usize,
        rank: usize,
        sequence_parallel: bool,
    ) -> Result<Self> {
        Self::check(cfg, size)?;
        if rank >= size {
            return Err(EngineError::Invalid(format!(
                "tensor-parallel rank {rank} of {size}"
            )));
        }
        Ok(Self {
            size,
            rank,
            sequence_parallel: sequence_parallel && size > 1,
            experts_whole: false,
        })
    }

    /// Device `rank` of `layout`'s tensor-parallel group: its sequence parallelism and its
    /// experts' split (`etp`) as the layout says.
    pub fn of_layout(cfg: &ModelConfig, layout: &Layout, rank: usize) -> Result<Self> {
        let mut shard = Self::new(cfg, layout.tp.max(1), rank, layout.sequence_parallel)?;
        shard.experts_whole = layout.expert_blocks() > 1;
        Ok(shard)
    }

    /// Whether `name` is a routed expert's tensor (or adapter) that this device holds whole.
    fn is_whole_expert(&self, cfg: &ModelConfig, name: &str) -> bool {
        self.experts_whole && cfg.routed_expert_of(name).is_some()
    }

    /// KV heads this device holds and the first of them.
    fn kv_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let kv = cfg.num_kv_heads;
        if kv.is_multiple_of(self.size) {
            let n = kv / self.size;
            self.rank * n..(self.rank + 1) * n
        } else {
            // tp = k·kv: devices k·j .. k·j + k − 1 share KV head j.
            let j = self.rank / (self.size / kv);
            j..j + 1
        }
    }

    fn heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let n = cfg.num_heads / self.size;
        self.rank * n..(self.rank + 1) * n
    }

    fn ffn(&self, cfg: &ModelConfig) -> Range<usize> {
        piece(cfg.intermediate_size, self.size, self.rank)
    }

    /// Rows of the padded vocabulary per device.
    fn vocab_rows(&self, cfg: &ModelConfig) -> usize {
        cfg.vocab_size.div_ceil(self.size)
    }

    /// The ids this device's embedding and output rows stand for.
    pub fn vocab_slice(&self, cfg: &ModelConfig) -> VocabSlice {
        let rows = self.vocab_rows(cfg);
        let start = (self.rank * rows).min(cfg.vocab_size);
        VocabSlice {
            start,
            valid: rows.min(cfg.vocab_size - start),
            total: cfg.vocab_size,
        }
    }

    /// The shape of this device's part of the model: its heads, KV heads, MLP columns and vocabulary
    /// rows. Its [`ModelConfig::param_specs`] are the shard's tensors, by their Hugging Face names.
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        let moe = cfg.moe.as_ref().map(|m| {
            let expert_size = if self.experts_whole {
                m.expert_size
            } else {
                piece(m.expert_size, self.size, self.rank).len()
            };
            Box::new(ferrotron_core::model::MoeConfig {
                expert_size,
                shared_expert_size: piece(m.shared_expert_size, self.size, self.rank).len(),
                ..(**m).clone()
            })
        });
        ModelConfig {
            num_heads: cfg.num_heads / self.size,
            num_kv_heads: self.kv_heads(cfg).len(),
            intermediate_size: self.ffn(cfg).len(),
            vocab_size: self.vocab_rows(cfg),
            moe,
            ..cfg.clone()
        }
    }

    /// A mixture of experts' tensor `name` (see [`ModelConfig::is_expert_param`]): the router and
    /// the shared expert's gate replicated (every device routes every row alike); each expert's
    /// gate and up projections column-parallel and its down projection row-parallel over its
    /// columns, as the dense MLP's (the first devices take one more column when they do not
    /// divide).
    fn expert_slice(&self, cfg: &ModelConfig, spec: &ParamSpec) -> Slice {
        let name = &spec.name;
        let m = cfg.moe.as_ref().expect("an expert's tensor has experts");
        let columns = if name.contains(".shared_expert.") {
            m.shared_expert_size
        } else {
            m.expert_size
        };
        let mine = if self.is_whole_expert(cfg, name) {
            0..columns
        } else {
            piece(columns, self.size, self.rank)
        };
        let cut = |dim: usize| Slice {
            dim,
            ranges: one(mine.clone()),
            pad: 0,
        };
        if ["w2.weight", "down_proj.weight"]
            .iter()
            .any(|s| name.ends_with(s))
        {
            cut(1)
        } else if [
            "w1.weight",
            "w3.weight",
            "gate_proj.weight",
            "up_proj.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s))
        {
            cut(0)
        } else {
            Slice {
                dim: 0,
                ranges: one(0..spec.shape[0]),
                pad: 0,
            }
        }
    }

    /// Which part of parameter `name` (of the full model `cfg`) this device holds. A name without a
    /// tensor-parallel rule is an error, never replication.
    pub fn slice(&self, cfg: &ModelConfig, name: &str) -> Result<Slice> {
        if let Some((module, half)) = adapter_parts(name) {
            return self.adapter_slice(cfg, module, half);
        }
        let spec = cfg
            .param_specs()
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| {
                EngineError::Invalid(format!("`{name}` is not a parameter of this model"))
            })?;
        let hd = cfg.head_dim;
        let heads = self.heads(cfg);
        let (q, kv, ffn) = (
            heads.start * hd..heads.end * hd,
            self.kv_heads(cfg).start * hd..self.kv_heads(cfg).end * hd,
            self.ffn(cfg),
        );
        let whole = Slice {
            dim: 0,
            ranges: one(0..spec.shape[0]),
            pad: 0,
        };
        let cut = |dim: usize, ranges: Vec<Range<usize>>| Slice {
            dim,
            ranges,
            pad: 0,
        };
        if name == cfg.embedding_name() || name == "lm_head.weight" {
            let v = self.vocab_slice(cfg);
            return Ok(Slice {
                dim: 0,
                ranges: one(v.start..v.start + v.valid),
                pad: self.vocab_rows(cfg) - v.valid,
            });
        }
        let is = |suffix: &str| name.ends_with(suffix);
        if self.is_replicated(cfg, name) {
            return Ok(whole);
        }
        if cfg.is_expert_param(name) {
            return Ok(self.expert_slice(cfg, &spec));
        }
        let rule = match cfg.arch {
            // Column-parallel weights and their biases are cut along their outputs (dim 0).
            Arch::Llama if is("self_attn.q_proj.weight") || is("self_attn.q_proj.bias") => {
                Some(cut(0, vec![q]))
            }
            Arch::Llama if ["k_proj", "v_proj"].iter().any(|p| is_projection(name, p)) => {
                Some(cut(0, vec![kv]))
            }
            Arch::Llama if is("self_attn.o_proj.weight") => Some(cut(1, vec![q])),
            Arch::Llama
                if ["gate_proj", "up_proj"]
                    .iter()
                    .any(|p| is_projection(name, p)) =>
            {
                Some(cut(0, vec![ffn]))
            }
            Arch::Llama if is("mlp.down_proj.weight") => Some(cut(1, vec![ffn])),
            Arch::Gpt2 if is("attn.c_attn.weight") || is("attn.c_attn.bias") => {
                // Fused [q | k | v] columns: this device's heads of each.
                let h = cfg.hidden_size;
                let ranges = (0..3).map(|k| k * h + q.start..k * h + q.end).collect();
                Some(cut(if is("weight") { 1 } else { 0 }, ranges))
            }
            Arch::Gpt2 if is("attn.c_proj.weight") => Some(cut(0, vec![q])),
            Arch::Gpt2 if is("mlp.c_fc.weight") => Some(cut(1, vec![ffn])),
            Arch::Gpt2 if is("mlp.c_fc.bias") => Some(cut(0, vec![ffn])),
            Arch::Gpt2 if is("mlp.c_proj.weight") => Some(cut(0, vec![ffn])),
            _ => None,
        };
        rule.ok_or_else(|| {
            EngineError::Invalid(format!(
                "parameter `{name}` has no tensor-parallel implementation (refusing to replicate it)"
            ))
        })
    }

    /// A LoRA adapter half follows its base weight's split on one side only: a column-parallel base
    /// (cut along its outputs) cuts `B` (`[out, r]`) by the same output rows and keeps `A` whole; a
    /// row-parallel base (cut along its inputs) cuts `A` (`[r, in]`) by the same input columns and
    /// keeps `B` whole. The whole half is a replica whose gradient is a partial sum on each device
    /// ([`TpShard::partial_over_group`]).
    fn adapter_slice(&self, cfg: &ModelConfig, module: &str, half: AdapterHalf) -> Result<Slice> {
        let (split, spec) = adapter_base(cfg, module)?;
        let base = self.slice(cfg, &spec.name)?;
        // The base's output and input dimensions (`nn.Linear` [out, in]; GPT-2's Conv1D [in, out]).
        let (out_len, in_len) = match spec.layout {
            WeightLayout::InOut => (spec.shape[1], spec.shape[0]),
            _ => (spec.shape[0], spec.shape[1]),
        };
        let whole = |dim: usize, len: usize| Slice {
            dim,
            ranges: one(0..len),
            pad: 0,
        };
        Ok(match (half, split) {
            (AdapterHalf::B, TargetSplit::Column) => Slice { dim: 0, ..base },
            (AdapterHalf::A, TargetSplit::Row) => Slice { dim: 1, ..base },
            (AdapterHalf::A, TargetSplit::Column) => whole(1, in_len),
            (AdapterHalf::B, TargetSplit::Row) => whole(0, out_len),
        })
    }

    /// The shape of this device's shard of a tensor of global shape `shape` cut as `slice`.
    pub fn shard_shape(shape: &[usize], slice: &Slice) -> Vec<usize> {
        let mut out = shape.to_vec();
        out[slice.dim] = slice.ranges.iter().map(Range::len).sum::<usize>() + slice.pad;
        out
    }

    /// This device's shard of a full tensor.
    pub fn cut(&self, spec: &ParamSpec, slice: &Slice, full: &[f32]) -> Vec<f32> {
        slice
            .runs(&spec.shape)
            .iter()
            .flat_map(|(r, pad)| {
                full[r.clone()]
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(0.0, *pad))
            })
            .collect()
    }

    /// This device's shard of every tensor of `source` (parameters of the whole model, or its LoRA
    /// adapters) that `keep` names, by Hugging Face name, in the source's order; and the bytes
    /// reading them took from storage.
    pub fn shard_store(
        &self,
        cfg: &ModelConfig,
        source: &dyn WeightSource,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<(ParamStore, u64)> {
        let mut specs = Vec::new();
        let mut tensors = Vec::new();
        let mut quantized = Vec::new();
        let mut read = 0;
        for (i, spec) in source.specs().iter().enumerate() {
            if !keep(&spec.name) {
                continue;
            }
            let slice = self.slice(cfg, &spec.name)?;
            specs.push(ParamSpec {
                shape: Self::shard_shape(&spec.shape, &slice),
                ..spec.clone()
            });
            match source.nf4(i) {
                Some(q) => {
                    tensors.push(Vec::new());
                    quantized.push(Some(Arc::new(Self::cut_nf4(spec, &slice, q))));
                }
                None => {
                    let (values, bytes) = source.read_shard(i, &slice)?;
                    tensors.push(values);
                    quantized.push(None);
                    read += bytes;
                }
            }
        }
        let mut store = ParamStore::from_tensors(specs, tensors);
        store.nf4 = quantized;
        Ok((store, read))
    }

    /// This device's shard of a quantized projection: the same rows or columns as [`TpShard::cut`]
    /// keeps of the f32 weight, taken from the `[out, in]` NF4 matrix (a Conv1D weight's cut
    /// dimension is the other one there).
    fn cut_nf4(spec: &ParamSpec, slice: &Slice, q: &Nf4Matrix) -> Nf4Matrix {
        debug_assert_eq!(slice.pad, 0, "projections are never padded");
        let along_out = (slice.dim == 0) == (spec.layout != WeightLayout::InOut);
        if along_out {
            q.cut(&slice.ranges, 0..q.cols)
        } else {
            let [cols] = slice.ranges.as_slice() else {
                unreachable!("an input-dimension cut is one range")
            };
            q.cut(&one(0..q.rows), cols.clone())
        }
    }

    /// Whether parameter `name` is replicated whole on every device of the group (norms, row-parallel
    /// biases, GPT-2's position embedding).
    pub fn is_replicated(&self, cfg: &ModelConfig, name: &str) -> bool {
        if adapter_parts(name).is_some() {
            return self.is_whole_adapter(cfg, name);
        }
        let is = |suffix: &str| name.ends_with(suffix);
        // A mixture of experts' router and shared-expert gate: every device routes every row.
        let router =
            cfg.is_expert_param(name) && (is(".gate.weight") || is("shared_expert_gate.weight"));
        match cfg.arch {
            // Norms (the per-head q/k norms included) and the row-parallel layers' biases.
            Arch::Llama => is("norm.weight") || is("o_proj.bias") || is("down_proj.bias") || router,
            Arch::Gpt2 => {
                Some(name) == cfg.position_embedding_name()
                    || name.contains(".ln_")
                    || is("c_proj.bias")
            }
        }
    }

    /// Whether a replicated parameter's gradient is computed from this device's rows only under
    /// sequence parallelism (so the group must sum it): the norms and the position embedding.
    /// Row-parallel biases see every row (their gradient comes from the gathered output gradient),
    /// and so do a mixture of experts' router and shared-expert gate (the block's rows gathered).
    pub fn sums_over_group(&self, cfg: &ModelConfig, name: &str) -> bool {
        self.is_replicated(cfg, name) && !is_row_parallel_bias(name) && !cfg.is_router_param(name)
    }

    /// Whether parameter `name`'s gradient is a partial sum on each device of the group, so that
    /// the group must sum it after the step: replicated parameters under sequence parallelism, and
    /// always the replicated half of a LoRA adapter (its product with the sharded half is a partial
    /// sum on each device, with or without sequence parallelism).
    pub fn partial_over_group(&self, cfg: &ModelConfig, name: &str) -> bool {
        if self.size == 1 {
            return false;
        }
        if adapter_parts(name).is_some() {
            return self.is_whole_adapter(cfg, name);
        }
        // A head norm sees only this device's heads, with or without sequence parallelism.
        is_head_norm(name) || self.sequence_parallel && self.sums_over_group(cfg, name)
    }

    /// Whether adapter half `name` is kept whole on every device (the half its base's split does
    /// not cut).
    fn is_whole_adapter(&self, cfg: &ModelConfig, name: &str) -> bool {
        let Some((module, half)) = adapter_parts(name) else {
            return false;
        };
        // Under etp=1 a routed expert's adapters are whole on their one device: neither half is
        // a partial sum there, nor a copy elsewhere.
        if self.is_whole_expert(cfg, module) {
            return false;
        }
        matches!(
            (half, adapter_base(cfg, module).map(|b| b.0)),
            (AdapterHalf::A, Ok(TargetSplit::Column)) | (AdapterHalf::B, Ok(TargetSplit::Row))
        )
    }

    /// Whether `name` is a tensor of a KV head (the base k/v projection or its adapter's `B`), which
    /// tp greater than the KV heads replicates over several devices.
    fn is_kv_head_tensor(name: &str) -> bool {
        [
            "k_proj.weight",
            "v_proj.weight",
            "k_proj.bias",
            "v_proj.bias",
            "k_proj.lora_B.weight",
            "v_proj.lora_B.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s))
    }

    /// Whether this device counts parameter `name` in the global gradient norm: every sharded
    /// tensor; a replicated one on tensor-parallel rank 0 only; a shared KV head on its first holder.
    pub fn counts_in_norm(&self, cfg: &ModelConfig, name: &str) -> bool {
        if self.is_replicated(cfg, name) {
            return self.rank == 0;
        }
        if Self::is_kv_head_tensor(name) {
            return self.kv_replicas(cfg)[0] == self.rank;
        }
        true
    }

    /// The devices that hold the same KV heads as this one (more than one only when tp exceeds the KV
    /// heads); their k/v gradients are partial sums.
    pub fn kv_replicas(&self, cfg: &ModelConfig) -> Vec<usize> {
        let kv = cfg.num_kv_heads;
        if kv.is_multiple_of(self.size) {
            return vec![self.rank];
        }
        let k = self.size / kv;
        let j = self.rank / k;
        (j * k..(j + 1) * k).collect()
    }
}

/// Whether `name` is projection `proj`'s weight or bias (`…self_attn.k_proj.bias`).
fn is_projection(name: &str, proj: &str) -> bool {
    ["weight", "bias"]
        .iter()
        .any(|t| name.ends_with(&format!(".{proj}.{t}")))
}

/// The biases added after a row-parallel layer's reduction: every device sees every row of their
/// gradient, so they are replicated and never partial.
fn is_row_parallel_bias(name: &str) -> bool {
    ["c_proj.bias", "o_proj.bias", "down_proj.bias"]
        .iter()
        .any(|s| name.ends_with(s))
}

/// Qwen3's per-head q/k norms: replicated, but each device normalises only its own heads, so their
/// gradients are partial sums over the tensor-parallel group.
fn is_head_norm(name: &str) -> bool {
    name.ends_with("self_attn.q_norm.weight") || name.ends_with("self_attn.k_norm.weight")
}

/// The split and the parameter of the base projection `module` (`model.layers.0.self_attn.q_proj`)
/// that a LoRA adapter sits beside.
fn adapter_base(cfg: &ModelConfig, module: &str) -> Result<(TargetSplit, ParamSpec)> {
    let no = || {
        EngineError::Invalid(format!(
            "LoRA adapter of `{module}`: the model has no such projection"
        ))
    };
    let split = projection_split(cfg, module).ok_or_else(no)?;
    let name = format!("{module}.weight");
    let spec = cfg
        .param_specs()
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(no)?;
    Ok((split, spec))
}

/// Reassembles a full tensor from every device's shard (in group order). Replicated copies are
/// identical (see [`finish_grads`]); the first device's is taken. Padding is dropped.
pub fn gather_tensor(cfg: &ModelConfig, spec: &ParamSpec, shards: &[&[f32]]) -> Result<Vec<f32>> {
    let size = shards.len();
    let mut out = vec![0f32; spec.numel()];
    // Positions along the cut dimension already taken from an earlier device.
    let mut filled: Vec<bool> = Vec::new();
    for (rank, shard) in shards.iter().enumerate() {
        let tp = TpShard::new(cfg, size, rank, false)?;
        let slice = tp.slice(cfg, &spec.name)?;
        let (outer, len, inner) = dims(&spec.shape, slice.dim);
        filled.resize(len, false);
        let kept: usize = slice.ranges.iter().map(Range::len).sum::<usize>() + slice.pad;
        if shard.len() != outer * kept * inner {
            return Err(EngineError::Invalid(format!(
                "tensor-parallel rank {rank}: shard of `{}` has {} elements, expected {}",
                spec.name,
                shard.len(),
                outer * kept * inner
            )));
        }
        let mut src = 0;
        for o in 0..outer {
            for r in &slice.ranges {
                let n = r.len() * inner;
                if !filled[r.start] {
                    out[(o * len + r.start) * inner..][..n].copy_from_slice(&shard[src..src + n]);
                }
                src += n;
            }
            src += slice.pad * inner;
        }
        for r in &slice.ranges {
            filled[r.clone()].iter_mut().for_each(|f| *f = true);
        }
    }
    Ok(out)
}

/// Sums, over the group, the gradients that are partial on each device: replicated parameters under
/// sequence parallelism, and KV heads replicated over several devices. Afterwards every copy of a
/// parameter holds the same, complete gradient. `grads` are the tensors of `specs` (whole, or the
/// same piece of each on every device of the group).
pub fn finish_grads<C: Comm>(
    c: &mut C,
    cfg: &ModelConfig,
    tp: &TpShard,
    group: &Group,
    specs: &[ParamSpec],
    grads: &mut [&mut [f32]],
) -> Result<()> {
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        if tp.partial_over_group(cfg, name) {
            c.all_reduce(group, grads[i], ReduceOp::Sum)?;
        }
    }
    let replicas = tp.kv_replicas(cfg);
    if replicas.len() > 1 {
        let sub = Group::new("tp", replicas.iter().map(|&r| group.ranks[r]).collect());
        for (i, name) in names.iter().enumerate() {
            if TpShard::is_kv_head_tensor(name) {
                c.all_reduce(&sub, grads[i], ReduceOp::Sum)?;
            }
        }
    }
    Ok(())
}

/// The tensor-parallel group's collectives over a [`Comm`], for the executor. The executor cannot
/// stop midway, so the first failure is kept (and later calls do nothing); the caller collects it
/// with [`TpGroup::result`] after each forward or backward.
pub struct TpGroup<'a, C: Comm> {
    comm: RefCell<&'a mut C>,
    group: Group,
    shard: TpShard,
    error: RefCell<Option<CommError>>,
    /// The format activations travel in (16 bits under mixed precision).
    wire: Wire,
    /// Context parallelism: this device's part of each sequence and its group.
    context: Option<(ContextShard, Group)>,
    /// Expert parallelism: the expert-parallel group and this device's place in it.
    experts: Option<(Group, usize)>,
}

impl<'a, C: Comm> TpGroup<'a, C> {
    pub fn new(comm: &'a mut C, group: Group, shard: TpShard) -> Self {
        Self {
            comm: RefCell::new(comm),
            group,
            shard,
            error: RefCell::new(None),
            wire: Wire(None),
            context: None,
            experts: None,
        }
    }

    /// Experts divided over an expert-parallel group (of more than one device), this device the
    /// `index`-th.
    pub fn with_experts(mut self, group: Group, index: usize) -> Self {
        if group.size() > 1 {
            self.experts = Some((group, index));
        }
        self
    }

    /// Sequences split over a context-parallel group (of more than one device).
    pub fn with_context(mut self, shard: ContextShard, group: Group) -> Self {
        if shard.size > 1 {
            self.context = Some((shard, group));
        }
        self
    }

    /// Activations and their gradients travel as `wire` says.
    pub fn with_wire(mut self, wire: Wire) -> Self {
        self.wire = wire;
        self
    }

    /// The first communication failure since the last call, if any.
    pub fn result(&self) -> std::result::Result<(), CommError> {
        self.error.borrow_mut().take().map_or(Ok(()), Err)
    }

    fn run(&self, f: impl FnOnce(&mut C, &Group) -> std::result::Result<(), CommError>) {
        if self.error.borrow().is_some() {
            return;
        }
        if let Err(e) = f(&mut self.comm.borrow_mut(), &self.group) {
            *self.error.borrow_mut() = Some(e);
        }
    }

    /// Runs `f` on the communicator unless an earlier call failed; a failure is kept for
    /// [`TpGroup::result`] (for hooks the executor calls, which cannot return errors).
    pub fn with_comm(&self, f: impl FnOnce(&mut C) -> std::result::Result<(), CommError>) {
        if self.error.borrow().is_some() {
            return;
        }
        if let Err(e) = f(&mut self.comm.borrow_mut()) {
            *self.error.borrow_mut() = Some(e);
        }
    }

    /// Access to the communicator between executor calls (pipeline sends, the final reductions).
    pub fn comm(&self) -> std::cell::RefMut<'_, &'a mut C> {
        self.comm.borrow_mut()
    }
}

impl<C: Comm> ShardCollectives for TpGroup<'_, C> {
    fn size(&self) -> usize {
        self.shard.size
    }
    fn row_block(&self) -> (usize, usize) {
        if self.shard.sequence_parallel {
            (self.shard.rank, self.shard.size)
        } else {
            (0, 1)
        }
    }
    fn gather_rows(&self, x: &[f32]) -> Option<Vec<f32>> {
        if !self.shard.sequence_parallel {
            return None;
        }
        let mut out = vec![0f32; x.len() * self.shard.size];
        self.run(|c, g| self.wire.all_gather(c, g, x, &mut out));
        Some(out)
    }
    fn reduce(&self, mut x: Vec<f32>) -> Vec<f32> {
        if self.shard.size == 1 {
            return x;
        }
        if self.shard.sequence_parallel {
            let mut out = vec![0f32; x.len() / self.shard.size];
            self.run(|c, g| self.wire.reduce_scatter(c, g, &x, &mut out));
            return out;
        }
        self.run(|c, g| self.wire.all_reduce(c, g, &mut x));
        x
    }
    fn index(&self) -> usize {
        self.shard.rank
    }
    fn max(&self, x: &mut [f32]) {
        if self.shard.size == 1 {
            return;
        }
        // Gathered rather than reduced: the ring reduces sums only, and a row maximum is small.
        let mut all = vec![0f32; x.len() * self.shard.size];
        self.run(|c, g| c.all_gather(g, x, &mut all));
        for part in all.chunks_exact(x.len()) {
            x.iter_mut().zip(part).for_each(|(m, &v)| *m = m.max(v));
        }
    }
    fn sum(&self, x: &mut [f64]) {
        if self.shard.size > 1 {
            self.run(|c, g| c.all_reduce(g, x, ReduceOp::Sum));
        }
    }
    fn positions(&self, local: usize) -> Vec<u32> {
        match &self.context {
            Some((cx, _)) => cx.positions(local),
            None => (0..local as u32).collect(),
        }
    }
    fn sequence_length(&self, local: usize) -> usize {
        self.context
            .as_ref()
            .map_or(local, |(cx, _)| cx.sequence_length(local))
    }
    fn attention_forward(
        &self,
        be: &dyn Backend,
        s: AttnShape,
        x: Qkv,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        match &self.context {
            Some((cx, g)) => self.with_comm(|c| context::forward(c, g, cx, be, s, x, out, lse)),
            None => be.attention_forward(s, x, out, lse),
        }
    }
    fn attention_backward(
        &self,
        be: &dyn Backend,
        s: AttnShape,
        inputs: AttnGradInputs,
        grads: QkvGrads,
    ) {
        match &self.context {
            Some((cx, g)) => self.with_comm(|c| context::backward(c, g, cx, be, s, inputs, grads)),
            None => be.attention_backward(s, inputs, grads),
        }
    }
    fn expert_counts(&self, counts: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
        let Some((g, me)) = &self.experts else {
            return counts;
        };
        let per = counts.first().map_or(0, Vec::len);
        let mut out = vec![vec![0; per]; g.size()];
        self.with_comm(|c| {
            out = expert::exchange_counts(c, g, *me, counts)?;
            Ok(())
        });
        out
    }
    fn expert_exchange(&self, send: Vec<Vec<f32>>, lengths: &[usize]) -> Vec<Vec<f32>> {
        let Some((g, me)) = &self.experts else {
            return send;
        };
        // After a failure (kept for `result`), messages of the right lengths keep the pass going.
        let mut out: Vec<Vec<f32>> = lengths.iter().map(|&n| vec![0f32; n]).collect();
        self.with_comm(|c| {
            out = expert::exchange_rows(c, g, *me, self.wire, send, lengths)?;
            Ok(())
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::model::preset;

    #[test]
    fn every_parameter_has_a_rule_and_the_shards_cover_the_model() {
        for name in ["llama-tiny", "gpt2-tiny", "llama-small"] {
            let cfg = preset(name).unwrap();
            for tp in [1, 2, 4] {
                let mut held = 0;
                for rank in 0..tp {
                    let shard = TpShard::new(&cfg, tp, rank, false).unwrap();
                    let local = shard.local_config(&cfg);
                    for spec in cfg.param_specs() {
                        let slice = shard.slice(&cfg, &spec.name).unwrap();
                        let kept: usize = slice.ranges.iter().map(Range::len).sum();
                        let local_spec = local
                            .param_specs()
                            .into_iter()
                            .find(|s| s.name == spec.name)
                            .unwrap();
                        let (outer, _, inner) = dims(&spec.shape, slice.dim);
                        assert_eq!(
                            outer * (kept + slice.pad) * inner,
                            local_spec.numel(),
                            "{name} tp={tp}: {}",
                            spec.name
                        );
                        held += local_spec.numel();
                    }
                }
                assert!(
                    held >= cfg.num_params(),
                    "{name} tp={tp}: shards miss parameters"
                );
            }
        }
    }

    #[test]
    fn unknown_parameters_are_errors_not_replicas() {
        let cfg = preset("llama-tiny").unwrap();
        let shard = TpShard::new(&cfg, 2, 0, false).unwrap();
        let e = shard
            .slice(&cfg, "model.layers.0.mlp.mystery_proj.weight")
            .unwrap_err()
            .to_string();
        assert!(e.contains("mystery_proj"), "{e}");
    }
}

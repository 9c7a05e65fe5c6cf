//! The model executor: forward with the activations backward needs, then backward, for the whole
//! model or one pipeline stage of it (a contiguous range of layers). It knows nothing about devices or
//! communication; the parallel runtime decides what runs where.

mod batch;
mod collectives;
mod frozen;
mod kept;
mod layer;
mod linear;
mod moe;
mod norm;
mod params;
mod passes;
mod residency;
mod weights;

pub use batch::TokenBatch;
pub use collectives::{ShardCollectives, Unsplit};
use ferrotron_core::precision::Half;
pub use frozen::FrozenBase;
use kept::Kept;
pub use moe::RouterTally;
pub use params::ParamStore;
pub use residency::{units_of, Residency, Resident, Unit};
pub use weights::WeightGrads;
use weights::{WeightJob, WeightSink};

use crate::kernels::{Backend, RopeTable, MASKED_ID};
use ferrotron_core::layout::Recompute;
use ferrotron_core::model::{Arch, LoraConfig, ModelConfig, WeightLayout};
use layer::{LayerActs, LayerIds};
use linear::{Adapter, Lin, Weights};
use norm::{NormIds, NormStash};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What a stage receives: token ids (the first stage) or the previous stage's hidden states (this
/// device's rows of them under sequence parallelism).
pub enum StageInput<'a> {
    Tokens(&'a TokenBatch),
    Hidden {
        x: Vec<f32>,
        batch: usize,
        seq: usize,
    },
}

/// Everything the forward pass kept for the backward pass.
pub struct ForwardState {
    /// Every row of the micro-batch (`batch · seq`); hidden states hold this device's block of them.
    rows: usize,
    batch: usize,
    seq: usize,
    positions: Vec<u32>,
    /// Token ids, on the stage with the embedding.
    ids: Vec<u32>,
    layers: Vec<LayerActs>,
    /// Under full recompute: each layer's input only (its forward runs again in backward).
    layer_inputs: Vec<Kept>,
    final_in: Kept,
    /// The final norm's statistics, and its output.
    final_norm: Option<NormStash>,
    final_out: Kept,
    /// `[rows, vocab]` on the last stage; replaced by the logits' gradient once the loss is taken.
    pub logits: Vec<f32>,
    /// The hidden states this stage hands to the next one (empty on the last stage); under sequence
    /// parallelism this device's rows only.
    pub output: Vec<f32>,
    /// A mixture of experts: the load-balancing loss's statistics over this stage's layers.
    router_tally: moe::RouterTally,
    /// A mixture of experts: each of this stage's layers (by its index in the model) with the top-k
    /// places each expert took.
    expert_tokens: Vec<(usize, Vec<f64>)>,
}

impl ForwardState {
    /// A mixture of experts: each of this stage's layers (by its index in the model) with the top-k
    /// places each of its experts took in this micro-batch.
    pub fn expert_tokens(&self) -> &[(usize, Vec<f64>)] {
        &self.expert_tokens
    }

    /// A mixture of experts: the load-balancing loss's statistics of this micro-batch so far, as
    /// `width` numbers ([`RouterTally::to_vec`], zeros before any block with experts) with
    /// `predicted` tokens, for the runtime to carry between stages and sum over replicas.
    pub fn router_tally_vec(&self, width: usize, predicted: f64) -> Vec<f64> {
        if self.router_tally.assigned.is_empty() {
            let mut v = vec![0.0; width];
            v[width - 1] = predicted;
            return v;
        }
        self.router_tally.to_vec(predicted)
    }

    /// Adds the statistics of the stages before this one (their blocks with experts).
    pub fn add_router_tally(&mut self, earlier: &RouterTally) {
        self.router_tally.add(earlier);
    }

    /// Replaces the statistics by the whole micro-batch step's (every layer's, summed over the
    /// replicas, with their predicted tokens): what this stage's backward takes the load-balancing
    /// loss's gradient from.
    pub fn set_router_tally(&mut self, whole: RouterTally) {
        self.router_tally = whole;
    }

    /// Bytes held for backward right now: every stashed activation and the logits.
    pub fn stashed_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(LayerActs::bytes).sum();
        let inputs: usize = self.layer_inputs.iter().map(Kept::bytes).sum();
        let norm = self.final_norm.as_ref().map_or(0, NormStash::bytes);
        self.final_in.bytes()
            + self.final_out.bytes()
            + 4 * self.logits.len()
            + norm
            + layers
            + inputs
    }
}

/// What a step trains: every parameter of the model, or LoRA adapters on its frozen base. The
/// step's gradients are `params`' (the adapters' with LoRA).
#[derive(Clone, Copy)]
pub struct Trained<'a> {
    pub params: &'a ParamStore,
    /// LoRA: the frozen base and the adapters' configuration (`params` are then the adapters).
    pub lora: Option<(&'a ParamStore, &'a LoraConfig)>,
}

impl<'a> Trained<'a> {
    /// Every parameter of the model.
    pub fn full(params: &'a ParamStore) -> Self {
        Self { params, lora: None }
    }

    /// LoRA `adapters` of `config` on the frozen `base`.
    pub fn lora(base: &'a ParamStore, config: &'a LoraConfig, adapters: &'a ParamStore) -> Self {
        Self {
            params: adapters,
            lora: Some((base, config)),
        }
    }

    /// The unsplit model that computes this step (the whole model on one device; with LoRA over
    /// a copy of the base, frozen).
    pub fn unsplit(&self, cfg: &ModelConfig) -> Transformer {
        match self.lora {
            None => Transformer::new(cfg, self.params),
            Some((base, lora)) => {
                let frozen = FrozenBase::new(cfg, base.clone(), None);
                Transformer::new(cfg, frozen.names()).with_lora(lora, self.params, frozen)
            }
        }
    }
}

/// A contiguous range of the model's layers, resolved once to indices into a [`ParamStore`]: the
/// embedding when the range starts at layer 0, the final norm and output layer when it ends at the
/// last. The unsplit model is the range of all layers.
pub struct Transformer {
    pub cfg: ModelConfig,
    pub layer_range: Range<usize>,
    embed: Option<usize>,
    pos_embed: Option<usize>,
    layers: Vec<LayerIds>,
    final_norm: Option<NormIds>,
    head: Option<Lin>,
    /// Llama-shaped models: the rotary table last built, for the sequence length it serves.
    rope: Option<Mutex<Option<Arc<RopeTable>>>>,
    recompute: Recompute,
    vocab: VocabSlice,
    /// How the activations kept for backward are stored: f32, or 16-bit under mixed precision.
    activation_storage: Option<Half>,
    /// LoRA: the frozen base this chunk reads; then the parameters a residency hands the executor
    /// are the adapters, and only they get gradients.
    frozen: Option<FrozenBase>,
}

/// Accumulates an embedding table's gradient (now or deferred).
fn embedding_grad(
    be: &dyn Backend,
    sink: &mut WeightSink,
    table: usize,
    ids: &[u32],
    dout: &[f32],
    dim: usize,
) {
    match sink {
        WeightSink::Now(g) => be.embedding_backward_weight(ids, dout, dim, &mut g.tensors[table]),
        WeightSink::Later(jobs) => jobs.push(WeightJob::Embedding {
            table,
            ids: ids.to_vec(),
            dout: dout.to_vec(),
            dim,
        }),
    }
}

/// The part of the vocabulary this model's embedding and output rows stand for: ids
/// `start..start + valid` of `total`; rows past `valid` are padding (a vocab-parallel shard of a
/// vocabulary that does not split evenly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabSlice {
    pub start: usize,
    pub valid: usize,
    pub total: usize,
}

impl VocabSlice {
    pub fn whole(vocab: usize) -> Self {
        Self {
            start: 0,
            valid: vocab,
            total: vocab,
        }
    }
    pub fn is_whole(&self) -> bool {
        self.start == 0 && self.valid == self.total
    }
    /// Token ids as rows of this slice's table; ids held elsewhere become [`MASKED_ID`].
    fn local_ids(&self, ids: &[u32]) -> Vec<u32> {
        assert!(
            ids.iter().all(|&i| (i as usize) < self.total),
            "token id beyond the vocabulary"
        );
        if self.is_whole() {
            return ids.to_vec();
        }
        ids.iter()
            .map(|&i| match (i as usize).checked_sub(self.start) {
                Some(l) if l < self.valid => l as u32,
                _ => MASKED_ID,
            })
            .collect()
    }
}

impl Transformer {
    /// The rotary table for sequences of `seq` tokens (Llama-shaped models), built once per
    /// length: a table covers every position of the sequences it serves and no more, and under
    /// dynamic NTK scaling its frequencies are those of that length.
    pub(crate) fn rope_table(&self, seq: usize) -> Option<Arc<RopeTable>> {
        let cache = self.rope.as_ref()?;
        let mut cached = cache.lock().unwrap_or_else(|e| e.into_inner());
        let serves = |t: &RopeTable| {
            if self.cfg.rope_scaling.depends_on_length() {
                t.max_positions() == seq
            } else {
                t.max_positions() >= seq
            }
        };
        match cached.as_ref() {
            Some(t) if serves(t) => Some(t.clone()),
            _ => {
                let t = Arc::new(RopeTable::for_model(&self.cfg, seq));
                *cached = Some(t.clone());
                Some(t)
            }
        }
    }

    /// The whole model.
    pub fn new(cfg: &ModelConfig, params: &ParamStore) -> Self {
        Self::stage(cfg, params, 0..cfg.num_layers)
    }

    /// The part of the model that runs `layers`; `params` must hold what that part uses.
    pub fn stage(cfg: &ModelConfig, params: &ParamStore, layers: Range<usize>) -> Self {
        let id = |n: &str| {
            params
                .id(n)
                .unwrap_or_else(|| panic!("parameter store lacks {n}"))
        };
        let first = layers.start == 0;
        let last = layers.end == cfg.num_layers;
        let (fw, fb) = cfg.final_norm_names();
        Self {
            embed: first.then(|| id(cfg.embedding_name())),
            pos_embed: if first {
                cfg.position_embedding_name().map(id)
            } else {
                None
            },
            layers: layers
                .clone()
                .map(|i| LayerIds::resolve(cfg, i, &id))
                .collect(),
            final_norm: last.then(|| NormIds {
                kind: cfg.norm(),
                w: id(fw),
                b: fb.map(id),
            }),
            head: last.then(|| Lin {
                w: id(cfg.lm_head_name()),
                b: None,
                in_dim: cfg.hidden_size,
                out_dim: cfg.vocab_size,
                layout: WeightLayout::OutIn,
                adapter: None,
            }),
            rope: (cfg.arch == Arch::Llama).then(|| Mutex::new(None)),
            layer_range: layers,
            vocab: VocabSlice::whole(cfg.vocab_size),
            cfg: cfg.clone(),
            recompute: Recompute::None,
            activation_storage: None,
            frozen: None,
        }
    }

    /// LoRA: the frozen base this chunk reads.
    pub fn frozen_base(&self) -> Option<&FrozenBase> {
        self.frozen.as_ref()
    }

    /// LoRA: this chunk's base parameters become `base` (frozen; the chunk must have been built
    /// over `base.names()`), and every projection `lora` targets gets its adapter from `adapters`
    /// (the store a residency will hand the executor, by name).
    pub fn with_lora(mut self, lora: &LoraConfig, adapters: &ParamStore, base: FrozenBase) -> Self {
        let names = base.names();
        let id = |n: &str| {
            adapters
                .id(n)
                .unwrap_or_else(|| panic!("adapter store lacks {n}"))
        };
        for (k, i) in self.layer_range.clone().enumerate() {
            let targets = lora.layer_modules(&self.cfg, i);
            let ids = &mut self.layers[k];
            for lin in ids.lins_mut() {
                let name = &names.specs[lin.w].name;
                if let Some(t) = targets.iter().find(|t| t.weight_name() == *name) {
                    lin.adapter = Some(Adapter {
                        a: id(&t.adapter_name(ferrotron_core::model::AdapterHalf::A)),
                        b: id(&t.adapter_name(ferrotron_core::model::AdapterHalf::B)),
                        rank: lora.rank,
                        scale: lora.scale(),
                    });
                }
            }
        }
        self.frozen = Some(base);
        self
    }

    /// Runs `f` with the tensors `unit`'s work reads, as `res` holds them: its parameters alone, or
    /// with LoRA the frozen base's unit (gathered by `res` when its codes are sharded) and the
    /// parameters as the adapters.
    fn with_weights(&self, res: &mut dyn Residency, unit: Unit, f: &mut dyn FnMut(Weights)) {
        self.with_weights_and(res, unit, false, &mut |w, _| f(w))
    }

    /// [`Transformer::with_weights`] with the gradient store of `res` too.
    fn with_weights_and_grads(
        &self,
        res: &mut dyn Residency,
        unit: Unit,
        f: &mut dyn FnMut(Weights, &mut ParamStore),
    ) {
        self.with_weights_and(res, unit, true, &mut |w, g| {
            f(w, g.expect("a gradient store"))
        })
    }

    /// The two above: with `with_grads`, `f` gets the gradient store too.
    fn with_weights_and(
        &self,
        res: &mut dyn Residency,
        unit: Unit,
        with_grads: bool,
        f: &mut dyn FnMut(Weights, Option<&mut ParamStore>),
    ) {
        let gathered = match &self.frozen {
            Some(base) if base.needs_gather(unit) => Some(res.gather_frozen(unit, base)),
            _ => None,
        };
        let mut run = |p: &ParamStore, g: Option<&mut ParamStore>| match (&self.frozen, &gathered) {
            (None, _) => f(
                Weights {
                    base: p,
                    adapters: None,
                },
                g,
            ),
            (Some(_), Some(b)) => f(
                Weights {
                    base: b,
                    adapters: Some(p),
                },
                g,
            ),
            (Some(base), None) => {
                let mut g = g;
                base.with_unit(unit, &mut |b| {
                    f(
                        Weights {
                            base: b,
                            adapters: Some(p),
                        },
                        g.as_deref_mut(),
                    )
                })
            }
        };
        if with_grads {
            res.params_and_grads(unit, &mut |p, g| run(p, Some(g)))
        } else {
            res.params(unit, &mut |p| run(p, None))
        }
    }

    /// Keeps the activations for backward in a 16-bit format (mixed precision); the arithmetic
    /// stays f32.
    pub fn with_activation_storage(mut self, storage: Option<Half>) -> Self {
        self.activation_storage = storage;
        self
    }

    /// A vocab-parallel shard: this model's `cfg.vocab_size` embedding and output rows are the ids of
    /// `slice` (then padding).
    pub fn with_vocab_slice(mut self, slice: VocabSlice) -> Self {
        assert!(
            slice.valid <= self.cfg.vocab_size,
            "vocab slice larger than the shard's table"
        );
        self.vocab = slice;
        self
    }

    /// Trades compute for activation memory: `Full` keeps only each layer's input and runs the
    /// layer forward again in backward; `Selective` equals `None` here (the memory-efficient
    /// attention keeps no probabilities to drop: its backward always recomputes them).
    pub fn with_recompute(mut self, policy: Recompute) -> Self {
        self.recompute = policy;
        self
    }

    pub fn forward(&self, be: &dyn Backend, p: &ParamStore, batch: &TokenBatch) -> ForwardState {
        self.forward_stage(be, &Unsplit, p, StageInput::Tokens(batch))
    }

    /// Runs this stage forward, keeping what its backward needs; `tp` is this device's
    /// tensor-parallel group ([`Unsplit`] for the whole model).
    pub fn forward_stage(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        p: &ParamStore,
        input: StageInput,
    ) -> ForwardState {
        self.forward_stage_in(be, tp, &mut Resident::new(p), input)
    }

    /// The units a pass of this chunk asks its residency for, in order: embedding, layers, head
    /// forward; the reverse backward.
    fn pass_units(&self, backward: bool) -> Vec<Unit> {
        let mut units: Vec<Unit> = self.embed.map(|_| Unit::Embedding).into_iter().collect();
        units.extend(self.layer_range.clone().map(Unit::Layer));
        if self.head.is_some() {
            units.push(Unit::Head);
        }
        if backward {
            units.reverse();
        }
        units
    }

    /// Takes the cross-entropy of `state.logits` against `targets` and back-propagates
    /// `loss_scale · Σ row losses` into `grads` (accumulating). Returns the unscaled loss sum.
    pub fn backward(
        &self,
        be: &dyn Backend,
        p: &ParamStore,
        grads: &mut ParamStore,
        state: ForwardState,
        targets: &[Option<u32>],
        loss_scale: f32,
    ) -> f64 {
        self.backward_stage(be, &Unsplit, p, grads, state, None, targets, loss_scale)
            .0
    }

    /// Runs this stage backward. The last stage takes the loss (targets, scale); any other stage
    /// takes `dout`, the gradient at its output. Returns the unscaled loss sum (0 off the last stage)
    /// and, unless this stage has the embedding, the gradient at its input for the previous stage.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        p: &ParamStore,
        grads: &mut ParamStore,
        state: ForwardState,
        dout: Option<Vec<f32>>,
        targets: &[Option<u32>],
        loss_scale: f32,
    ) -> (f64, Option<Vec<f32>>) {
        let mut res = Resident::with_grads(p, grads);
        let (loss, dx, _) =
            self.backward_stage_in(be, tp, &mut res, state, dout, targets, loss_scale, false);
        (loss, dx)
    }

    /// The input-gradient half of [`Transformer::backward_stage`]: returns what it returns plus the
    /// weight gradients, deferred, for [`WeightGrads::apply`] (zero-bubble schedules).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage_input(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        p: &ParamStore,
        state: ForwardState,
        dout: Option<Vec<f32>>,
        targets: &[Option<u32>],
        loss_scale: f32,
    ) -> (f64, Option<Vec<f32>>, WeightGrads) {
        let (loss, dx, w) = self.backward_stage_in(
            be,
            tp,
            &mut Resident::new(p),
            state,
            dout,
            targets,
            loss_scale,
            true,
        );
        (loss, dx, w.expect("deferred weight gradients"))
    }

    /// One forward and backward over `batch`, gradients accumulated into `grads`. Returns the mean loss.
    pub fn forward_backward(
        &self,
        be: &dyn Backend,
        p: &ParamStore,
        grads: &mut ParamStore,
        batch: &TokenBatch,
    ) -> f64 {
        let n = batch.predicted_tokens().max(1);
        let state = self.forward(be, p, batch);
        self.backward(be, p, grads, state, &batch.targets(), 1.0 / n as f32) / n as f64
    }

    /// Cross-entropy of `logits` against `targets`, summed over rows; replaces `logits` by
    /// `scale · ∂loss/∂logits`. A vocab-parallel shard never sees the whole row: the row maximum, the
    /// sum of exponentials and the target's logit are reduced over the group instead.
    fn loss_and_logit_grad(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        logits: &mut [f32],
        targets: &[Option<u32>],
        scale: f32,
    ) -> f64 {
        let v = self.cfg.vocab_size;
        if tp.size() == 1 && self.vocab.is_whole() {
            return be.cross_entropy(logits, v, targets, scale);
        }
        let (valid, start) = (self.vocab.valid, self.vocab.start as u32);
        let mut max = vec![0f32; targets.len()];
        be.shard_logit_max(logits, v, valid, &mut max);
        tp.max(&mut max);
        let mut sums = vec![0f64; 2 * targets.len()];
        be.shard_exp_sums(logits, v, valid, start, targets, &max, &mut sums);
        tp.sum(&mut sums);
        be.shard_softmax_grad(logits, v, valid, start, targets, &sums, scale);
        // loss = ln Σexp(x − max) − (logit[target] − max), rows summed in a fixed order.
        targets
            .iter()
            .zip(sums.chunks_exact(2))
            .filter(|(t, _)| t.is_some())
            .map(|(_, s)| s[0].ln() - s[1])
            .sum()
    }

    /// Mean next-token loss without gradients (validation).
    pub fn loss(&self, be: &dyn Backend, p: &ParamStore, batch: &TokenBatch) -> f64 {
        let mut state = self.forward(be, p, batch);
        let n = batch.predicted_tokens().max(1);
        be.cross_entropy(
            &mut state.logits,
            self.cfg.vocab_size,
            &batch.targets(),
            0.0,
        ) / n as f64
    }
}

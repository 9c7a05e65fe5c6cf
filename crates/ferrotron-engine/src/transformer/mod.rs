//! The unsplit model executor: forward with the activations backward needs, then backward, on one
//! device. It knows nothing about parallelism; a layout shards what it runs.

mod layer;
mod params;

pub use params::ParamStore;

use crate::kernels::{Backend, RopeTable};
use ferrotron_core::model::{Arch, ModelConfig, WeightLayout};
use layer::{LayerActs, LayerIds, Lin, NormIds, NormStash};

/// A batch of `batch` sequences of `seq` token ids, row-major.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    pub ids: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
}

impl TokenBatch {
    /// Next-token targets: position t of a sequence predicts t+1; the last position predicts nothing.
    pub fn targets(&self) -> Vec<Option<u32>> {
        (0..self.batch * self.seq)
            .map(|i| (i % self.seq + 1 < self.seq).then(|| self.ids[i + 1]))
            .collect()
    }
    pub fn predicted_tokens(&self) -> usize {
        self.batch * self.seq.saturating_sub(1)
    }
    fn positions(&self) -> Vec<u32> {
        (0..self.batch * self.seq)
            .map(|i| (i % self.seq) as u32)
            .collect()
    }
}

/// Everything the forward pass kept for the backward pass.
pub struct ForwardState {
    rows: usize,
    batch: usize,
    seq: usize,
    positions: Vec<u32>,
    ids: Vec<u32>,
    layers: Vec<LayerActs>,
    final_in: Vec<f32>,
    final_norm: NormStash,
    /// `[rows, vocab]`; replaced by the logits' gradient once the loss is taken.
    pub logits: Vec<f32>,
}

impl ForwardState {
    /// Bytes held for backward right now: every stashed activation and the logits.
    pub fn stashed_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(LayerActs::bytes).sum();
        4 * (self.final_in.len() + self.logits.len()) + self.final_norm.bytes() + layers
    }
}

/// The model's parameter layout, resolved once to indices into a [`ParamStore`].
pub struct Transformer {
    pub cfg: ModelConfig,
    embed: usize,
    pos_embed: Option<usize>,
    layers: Vec<LayerIds>,
    final_norm: NormIds,
    head: Lin,
    rope: Option<RopeTable>,
}

impl Transformer {
    pub fn new(cfg: &ModelConfig, params: &ParamStore) -> Self {
        let id = |n: &str| {
            params
                .id(n)
                .unwrap_or_else(|| panic!("parameter store lacks {n}"))
        };
        let layers = (0..cfg.num_layers)
            .map(|i| LayerIds::resolve(cfg, i, &id))
            .collect();
        let (fw, fb) = cfg.final_norm_names();
        Self {
            embed: id(cfg.embedding_name()),
            pos_embed: cfg.position_embedding_name().map(id),
            layers,
            final_norm: NormIds {
                kind: cfg.norm(),
                w: id(fw),
                b: fb.map(id),
            },
            head: Lin {
                w: id(cfg.lm_head_name()),
                b: None,
                in_dim: cfg.hidden_size,
                out_dim: cfg.vocab_size,
                layout: WeightLayout::OutIn,
            },
            rope: (cfg.arch == Arch::Llama)
                .then(|| RopeTable::new(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)),
            cfg: cfg.clone(),
        }
    }

    pub fn forward(&self, be: &dyn Backend, p: &ParamStore, batch: &TokenBatch) -> ForwardState {
        let (rows, h) = (batch.batch * batch.seq, self.cfg.hidden_size);
        assert!(
            batch.seq <= self.cfg.max_position_embeddings,
            "sequence longer than the model's positions"
        );
        let positions = batch.positions();
        let mut x = vec![0f32; rows * h];
        be.embedding_forward(&batch.ids, &p.tensors[self.embed], h, &mut x, false);
        if let Some(wpe) = self.pos_embed {
            be.embedding_forward(&positions, &p.tensors[wpe], h, &mut x, true);
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for ids in &self.layers {
            let (out, acts) = layer::forward(self, be, p, ids, x, batch, &positions);
            layers.push(acts);
            x = out;
        }
        let final_norm = self.final_norm.forward(be, p, &x, self.cfg.norm_eps as f32);
        let mut logits = vec![0f32; rows * self.cfg.vocab_size];
        be.linear_forward(
            self.head.shape(rows),
            &final_norm.out,
            &p.tensors[self.head.w],
            None,
            &mut logits,
        );
        ForwardState {
            rows,
            batch: batch.batch,
            seq: batch.seq,
            positions,
            ids: batch.ids.clone(),
            layers,
            final_in: x,
            final_norm,
            logits,
        }
    }

    /// Takes the cross-entropy of `state.logits` against `targets` and back-propagates
    /// `loss_scale · Σ row losses` into `grads` (accumulating). Returns the unscaled loss sum.
    pub fn backward(
        &self,
        be: &dyn Backend,
        p: &ParamStore,
        grads: &mut ParamStore,
        mut state: ForwardState,
        targets: &[Option<u32>],
        loss_scale: f32,
    ) -> f64 {
        let (rows, h, v) = (state.rows, self.cfg.hidden_size, self.cfg.vocab_size);
        let loss_sum = be.cross_entropy(&mut state.logits, v, targets, loss_scale);
        let dlogits = std::mem::take(&mut state.logits);
        let mut dnormed = vec![0f32; rows * h];
        let hs = self.head.shape(rows);
        be.linear_backward_input(hs, &dlogits, &p.tensors[self.head.w], &mut dnormed, false);
        be.linear_backward_weight(
            hs,
            &dlogits,
            &state.final_norm.out,
            &mut grads.tensors[self.head.w],
            None,
        );
        drop(dlogits);
        let mut dx = vec![0f32; rows * h];
        self.final_norm.backward(
            be,
            p,
            grads,
            &dnormed,
            &state.final_in,
            &state.final_norm,
            &mut dx,
            false,
        );
        for (ids, acts) in self.layers.iter().zip(state.layers.drain(..)).rev() {
            layer::backward(
                self,
                be,
                p,
                grads,
                ids,
                acts,
                &mut dx,
                &state.positions,
                (state.batch, state.seq),
            );
        }
        be.embedding_backward_weight(&state.ids, &dx, h, &mut grads.tensors[self.embed]);
        if let Some(wpe) = self.pos_embed {
            be.embedding_backward_weight(&state.positions, &dx, h, &mut grads.tensors[wpe]);
        }
        loss_sum
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

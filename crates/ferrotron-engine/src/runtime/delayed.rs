//! The delayed-update reference of the asynchronous schedules: one device, the whole model, none of
//! the pipeline's code. It reads only which weight version each micro-batch uses on each stage
//! from the schedule's data (`build_async`, the lists the pipeline runs), and for every update of a
//! segment takes the gradient of that update's micro-batches — each layer reading the version its
//! stage's list gives the micro-batch — clips it by its global norm, and steps AdamW on the whole
//! model. For PipeDream-2BW that is `W(t+1) = W(t) − ν·∇f(W(t−1))`; for PipeDream each micro-batch's
//! gradient on every stage's own version (vertical sync off).

use crate::error::{EngineError, Result};
use crate::kernels::CpuBackend;
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::transformer::{ParamStore, TokenBatch, Transformer};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::MixedPrecision;
use ferrotron_core::schedule::{build_async, Action, StagePartition};

/// What the reference trains: the layout whose schedule it follows, the optimizer and clipping.
pub struct DelayedReference<'a> {
    pub cfg: &'a ModelConfig,
    pub layout: &'a Layout,
    pub adam: AdamWConfig,
    pub lr: &'a LrSchedule,
    /// Clip each update's gradient to this global norm (0: off).
    pub clip: f64,
    /// bf16: every version computed as bf16 mixed precision does (its bf16 compute copy, bf16
    /// products and stash); the master weights, the sums and Adam stay f32.
    pub precision: MixedPrecision,
}

impl DelayedReference<'_> {
    /// The parameters after steps `0..steps` from `params`, the batch of step k being
    /// `batch_of(k)`, the pipeline drained after each step `drain_after` names (and at the end).
    pub fn train(
        &self,
        params: &ParamStore,
        steps: usize,
        batch_of: &dyn Fn(usize) -> TokenBatch,
        drain_after: &dyn Fn(usize) -> bool,
    ) -> Result<ParamStore> {
        let mut params = params.clone();
        let mut opt = AdamW::new(self.adam, &params);
        let mut start = 0;
        while start < steps {
            let end = (start + 1..=steps)
                .find(|&k| k == steps || drain_after(k - 1))
                .expect("the end drains");
            self.segment(&mut params, &mut opt, start, end, batch_of)?;
            start = end;
        }
        Ok(params)
    }

    fn segment(
        &self,
        params: &mut ParamStore,
        opt: &mut AdamW,
        start: usize,
        end: usize,
        batch_of: &dyn Fn(usize) -> TokenBatch,
    ) -> Result<()> {
        let (cfg, l) = (self.cfg, self.layout);
        let (p, dp, mbs) = (l.pp.max(1), l.dp.max(1), l.micro_batch_size.max(1));
        let first = batch_of(start);
        if !first.batch.is_multiple_of(dp * mbs) {
            return Err(EngineError::Invalid(format!(
                "the batch of {} sequences does not split into dp × mbs = {dp} × {mbs}",
                first.batch
            )));
        }
        let m = first.batch / (dp * mbs);
        let sched = build_async(l.schedule, p, m, end - start, self.clip > 0.0)?;
        let partition = StagePartition::for_layout(cfg, l)?;
        // The version each stage's list gives each micro-batch's forward.
        let mut version = vec![vec![0usize; sched.micro_batches]; p];
        for (s, (list, vs)) in sched.actions.iter().zip(&sched.versions).enumerate() {
            for (a, &v) in list.iter().zip(vs) {
                if let Action::Forward { mb, .. } = a {
                    version[s][*mb] = v;
                }
            }
        }
        // Version k: the whole model after k updates of this segment.
        let mut history = vec![params.clone()];
        let per_update = sched.micro_batches_per_update;
        let updates = sched.micro_batches / per_update;
        let tokens_per_step = first.predicted_tokens().max(1);
        let scale = 1.0 / (tokens_per_step * per_update / m) as f32;
        // The model with the output layer untied, so that the embedding (the first stage's) and the
        // output layer (the last stage's) can read different versions; their gradients then sum.
        let untied = ModelConfig {
            tie_word_embeddings: false,
            ..cfg.clone()
        };
        if self.precision.needs_loss_scaling() {
            return Err(EngineError::Invalid(format!(
                "the delayed-update reference computes in f32 or bf16, not {}",
                self.precision
            )));
        }
        let be = CpuBackend::default().computing(self.precision.products());
        for u in 0..updates {
            let mut g = ParamStore::zeros(untied.param_specs());
            for mb in u * per_update..(u + 1) * per_update {
                let (step, i) = (start + mb / m, mb % m);
                let batch = batch_of(step);
                let mut weights = self.mixed_versions(&untied, &partition, &history, &version, mb);
                if self.precision == MixedPrecision::Bf16 {
                    weights = weights.bf16_compute_copy();
                }
                let tf = Transformer::new(&untied, &weights);
                let replica = |d: usize| {
                    let at = (d * m + i) * mbs * batch.seq;
                    &batch.ids[at..at + mbs * batch.seq]
                };
                // A mixture of experts takes its load-balancing loss over the replicas' i-th
                // micro-batches together (the pipeline sums their router statistics): one pass
                // over all of them. A dense model's loss is a sum over tokens either way.
                let passes: Vec<Vec<u32>> = if cfg.moe.is_some() {
                    vec![(0..dp).flat_map(|d| replica(d).to_vec()).collect()]
                } else {
                    (0..dp).map(|d| replica(d).to_vec()).collect()
                };
                for ids in passes {
                    let micro = TokenBatch {
                        batch: ids.len() / batch.seq,
                        ids,
                        seq: batch.seq,
                    };
                    let state = tf.forward(&be, &weights, &micro);
                    tf.backward(&be, &weights, &mut g, state, &micro.targets(), scale);
                }
            }
            let mut grads = params.zeros_like();
            for (spec, t) in grads.specs.iter().zip(grads.tensors.iter_mut()) {
                t.copy_from_slice(g.get(&spec.name).expect("every parameter"));
                if cfg.tie_word_embeddings && spec.name == cfg.embedding_name() {
                    let head = g.get("lm_head.weight").expect("the untied head");
                    t.iter_mut().zip(head).for_each(|(a, b)| *a += b);
                }
            }
            if self.clip > 0.0 {
                let norm = grads
                    .tensors
                    .iter()
                    .flatten()
                    .map(|&x| (x as f64) * (x as f64))
                    .sum::<f64>()
                    .sqrt();
                if norm > self.clip {
                    let s = (self.clip / (norm + 1e-6)) as f32;
                    grads
                        .tensors
                        .iter_mut()
                        .for_each(|t| t.iter_mut().for_each(|x| *x *= s));
                }
            }
            let lr = self.lr.lr(start + u * per_update / m) as f32;
            opt.step_serial(params, &grads, lr);
            history.push(params.clone());
        }
        Ok(())
    }

    /// The untied model's parameters for micro-batch `mb`: every tensor from the version the
    /// stage that holds it gives `mb` (the output layer: the last stage's copy of the embedding).
    fn mixed_versions(
        &self,
        untied: &ModelConfig,
        partition: &StagePartition,
        history: &[ParamStore],
        version: &[Vec<usize>],
        mb: usize,
    ) -> ParamStore {
        let cfg = self.cfg;
        let stage_of = |name: &str| {
            partition
                .layers
                .iter()
                .position(|r| cfg.stage_owns(name, r))
                .expect("every tensor is on a stage")
        };
        let last = partition.layers.len() - 1;
        let mut out = ParamStore::zeros(untied.param_specs());
        for (spec, t) in out.specs.iter().zip(out.tensors.iter_mut()) {
            let (source, stage) = if spec.name == "lm_head.weight" && cfg.tie_word_embeddings {
                (cfg.embedding_name(), last)
            } else {
                (spec.name.as_str(), stage_of(&spec.name))
            };
            t.copy_from_slice(
                history[version[stage][mb]]
                    .get(source)
                    .expect("a model tensor"),
            );
        }
        out
    }
}

//! The executor's passes over a stage's units, one unit at a time through a [`Residency`]: the
//! forward (keeping what backward needs, or recomputing it) and the backward (its weight gradients
//! now, or deferred for a zero-bubble schedule).

use super::*;

impl Transformer {
    /// [`Transformer::forward_stage`] with the parameters held by `res`, one unit at a time.
    pub fn forward_stage_in(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        res: &mut dyn Residency,
        input: StageInput,
    ) -> ForwardState {
        res.begin_pass(&self.pass_units(false));
        let h = self.cfg.hidden_size;
        let (batch, seq) = match &input {
            StageInput::Tokens(b) => (b.batch, b.seq),
            StageInput::Hidden { batch, seq, .. } => (*batch, *seq),
        };
        assert!(
            tp.sequence_length(seq) <= self.cfg.max_sequence_length(),
            "sequence longer than the model's positions"
        );
        let rows = batch * seq;
        let (block, blocks) = tp.row_block();
        assert!(
            rows.is_multiple_of(blocks),
            "rows do not split over the sequence-parallel group"
        );
        let in_sequence = tp.positions(seq);
        let positions: Vec<u32> = (0..rows).map(|i| in_sequence[i % seq]).collect();
        let mine = &positions[block * rows / blocks..(block + 1) * rows / blocks];
        let (mut x, ids) = match input {
            StageInput::Tokens(b) => {
                let embed = self
                    .embed
                    .expect("token input needs the stage with the embedding");
                let local = self.vocab.local_ids(&b.ids);
                let mut x = Vec::new();
                self.with_weights(res, Unit::Embedding, &mut |w| {
                    let mut e = be.zeros(rows * h);
                    be.embedding_forward(&local, w.base.matrix(embed), h, &mut e, false);
                    // Each device looked up the ids its vocabulary slice holds: the rows sum
                    // over the group.
                    x = tp.reduce(e);
                    if let Some(wpe) = self.pos_embed {
                        be.embedding_forward(mine, w.base.matrix(wpe), h, &mut x, true);
                    }
                });
                (x, local)
            }
            StageInput::Hidden { x, .. } => (x, Vec::new()),
        };
        assert_eq!(x.len(), rows / blocks * h, "stage input has the wrong size");
        let (mut layers, mut layer_inputs) = (Vec::with_capacity(self.layers.len()), Vec::new());
        let mut router_tally = moe::RouterTally::default();
        let mut expert_tokens = Vec::new();
        for (i, ids) in self.layers.iter().enumerate() {
            let input = (self.recompute == Recompute::Full).then(|| x.clone());
            let mut layer_in = Some(x);
            let mut result = None;
            let unit = Unit::Layer(self.layer_range.start + i);
            self.with_weights(res, unit, &mut |w| {
                let x = layer_in.take().expect("a layer runs once");
                result = Some(layer::forward(
                    self,
                    be,
                    tp,
                    w,
                    ids,
                    x,
                    (batch, seq),
                    &positions,
                ));
            });
            let (out, acts) = result.expect("the layer ran");
            if let (Some(t), Some(counts)) = (acts.router_tally(), acts.expert_counts()) {
                router_tally.add(t);
                expert_tokens.push((self.layer_range.start + i, counts));
            }
            match input {
                Some(input) => layer_inputs.push(Kept::keep(be, input, self.activation_storage)),
                None => layers.push(acts),
            }
            x = out;
        }
        let mut state = ForwardState {
            rows,
            batch,
            seq,
            positions,
            ids,
            layers,
            layer_inputs,
            final_in: Kept::Empty,
            final_norm: None,
            final_out: Kept::Empty,
            logits: Vec::new(),
            output: Vec::new(),
            router_tally,
            expert_tokens,
        };
        match (&self.final_norm, &self.head) {
            (Some(norm), Some(head)) => {
                self.with_weights(res, Unit::Head, &mut |w| {
                    let normed = norm.forward(be, w.base, &x, self.cfg.norm_eps as f32);
                    let normed_all = tp.gather_rows(&normed.out);
                    let normed_in = normed_all.as_deref().unwrap_or(&normed.out);
                    let logits = head.product(be, w.base, normed_in, rows, false);
                    let mut normed = normed;
                    state.final_out =
                        Kept::keep(be, std::mem::take(&mut normed.out), self.activation_storage);
                    state.final_norm = Some(normed);
                    state.logits = logits;
                });
                state.final_in = Kept::keep(be, x, self.activation_storage);
            }
            _ => state.output = x,
        }
        state
    }

    /// [`Transformer::backward_stage`] with the parameters (and, unless `defer_weights`, the
    /// gradients) held by `res`, one unit at a time. With `defer_weights` the weight gradients are
    /// returned for later instead (zero-bubble schedules).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage_in(
        &self,
        be: &dyn Backend,
        tp: &dyn ShardCollectives,
        res: &mut dyn Residency,
        mut state: ForwardState,
        dout: Option<Vec<f32>>,
        targets: &[Option<u32>],
        loss_scale: f32,
        defer_weights: bool,
    ) -> (f64, Option<Vec<f32>>, Option<WeightGrads>) {
        res.begin_pass(&self.pass_units(true));
        let (rows, h) = (state.rows, self.cfg.hidden_size);
        let blocks = tp.row_block().1;
        let mut jobs = Vec::new();
        // Runs one unit's backward with its parameters present and its weight gradients going
        // where they should.
        let mut in_unit = |unit: Unit, f: &mut dyn FnMut(Weights, &mut WeightSink)| {
            if defer_weights {
                self.with_weights(res, unit, &mut |w| f(w, &mut WeightSink::Later(&mut jobs)))
            } else {
                self.with_weights_and_grads(res, unit, &mut |w, g| f(w, &mut WeightSink::Now(g)))
            }
        };
        let mut loss_sum = 0.0;
        let mut prob_grad = Vec::new();
        let mut dx = match (&self.final_norm, &self.head, state.final_norm.take()) {
            (Some(norm), Some(head), Some(stash)) => {
                loss_sum = self.loss_and_logit_grad(be, tp, &mut state.logits, targets, loss_scale);
                if let Some(moe) = self
                    .cfg
                    .moe
                    .as_ref()
                    .filter(|_| !state.router_tally.is_empty())
                {
                    // The load-balancing loss of this micro-batch, weighted like its tokens' cross-
                    // entropy (the pass returns sums over predicted tokens). Summed over replicas,
                    // the tally is of their micro-batches together: each replica adds its tokens'
                    // share of the loss, and the gradient is the whole term's.
                    let tally = &state.router_tally;
                    let predicted = targets.iter().filter(|t| t.is_some()).count() as f64;
                    let together = tally.predicted.unwrap_or(predicted);
                    loss_sum += moe.aux_loss_coef * predicted * tally.aux_loss();
                    prob_grad = tally.prob_grad(moe.aux_loss_coef * together * loss_scale as f64);
                }
                let dlogits = std::mem::take(&mut state.logits);
                let mut dx = be.zeros(rows / blocks * h);
                let final_in = std::mem::take(&mut state.final_in).into_f32(be);
                let final_out = std::mem::take(&mut state.final_out).into_f32(be);
                in_unit(Unit::Head, &mut |p, sink| {
                    let normed_all = tp.gather_rows(&final_out);
                    let normed = normed_all.as_deref().unwrap_or(&final_out);
                    let dnormed = head.backward_new(be, p, sink, &dlogits, normed);
                    drop(normed_all);
                    let dnormed = tp.reduce(dnormed);
                    norm.backward(be, p, sink, &dnormed, &final_in, &stash, &mut dx, false);
                });
                dx
            }
            _ => {
                // A stage before the loss: the statistics came back from it, with the micro-batch
                // step's predicted tokens.
                if let (Some(moe), Some(together)) = (&self.cfg.moe, state.router_tally.predicted) {
                    let scale = moe.aux_loss_coef * together * loss_scale as f64;
                    prob_grad = state.router_tally.prob_grad(scale);
                }
                dout.expect("a stage without the loss needs the gradient at its output")
            }
        };
        assert_eq!(
            dx.len(),
            rows / blocks * h,
            "output gradient has the wrong size"
        );
        let dims = (state.batch, state.seq);
        let first = self.layer_range.start;
        let positions = &state.positions;
        if state.layer_inputs.is_empty() {
            for ((i, ids), acts) in self
                .layers
                .iter()
                .enumerate()
                .zip(state.layers.drain(..))
                .rev()
            {
                let mut acts = Some(acts);
                in_unit(Unit::Layer(first + i), &mut |p, sink| {
                    let acts = acts.take().expect("a layer's backward runs once");
                    layer::backward(
                        self, be, tp, p, sink, ids, acts, &mut dx, positions, dims, &prob_grad,
                    );
                });
            }
        } else {
            // Full recompute: run each layer's forward again from its kept input, then its backward.
            for ((i, ids), input) in self
                .layers
                .iter()
                .enumerate()
                .zip(state.layer_inputs.drain(..))
                .rev()
            {
                let mut input = Some(input);
                in_unit(Unit::Layer(first + i), &mut |p, sink| {
                    let x = input
                        .take()
                        .expect("a layer's backward runs once")
                        .into_f32(be);
                    let (_, acts) = layer::forward(self, be, tp, p, ids, x, dims, positions);
                    layer::backward(
                        self, be, tp, p, sink, ids, acts, &mut dx, positions, dims, &prob_grad,
                    );
                });
            }
        }
        let loss_and_dx = match self.embed {
            Some(embed) => {
                let block = tp.row_block().0;
                let mine = &positions[block * rows / blocks..(block + 1) * rows / blocks];
                // The embedding's rows are every row's: gather them back from the sequence shards.
                let dx_all = tp.gather_rows(&dx);
                let dx_all = dx_all.as_deref().unwrap_or(&dx);
                in_unit(Unit::Embedding, &mut |w, sink| {
                    if w.frozen() {
                        return;
                    }
                    if let Some(wpe) = self.pos_embed {
                        embedding_grad(be, sink, wpe, mine, &dx, h);
                    }
                    embedding_grad(be, sink, embed, &state.ids, dx_all, h);
                });
                (loss_sum, None)
            }
            None => (loss_sum, Some(dx)),
        };
        let deferred = defer_weights.then_some(WeightGrads(jobs));
        (loss_and_dx.0, loss_and_dx.1, deferred)
    }
}

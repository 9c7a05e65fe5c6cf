//! A batch of token sequences, and what a model accepts of one.

use ferrotron_core::model::ModelConfig;

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

    /// Why this batch cannot be a training step of `cfg`'s model, if it cannot: no rows, sequences
    /// too short to predict a token (a loss of 0 over nothing would look like a result), ids outside
    /// the vocabulary, or sequences longer than the model's positions.
    pub fn check(&self, cfg: &ModelConfig) -> std::result::Result<(), String> {
        if self.batch == 0 {
            return Err("the batch has no sequences (shape [0, seq])".into());
        }
        if self.seq < 2 {
            return Err(format!(
                "sequences of {} token(s) predict nothing: the loss needs at least 2 tokens per sequence",
                self.seq
            ));
        }
        if self.ids.len() != self.batch * self.seq {
            return Err(format!(
                "{} token ids for a batch of {} × {}",
                self.ids.len(),
                self.batch,
                self.seq
            ));
        }
        if let Some(bad) = self.ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
            return Err(format!(
                "token id {bad} is outside the model's vocabulary of {}",
                cfg.vocab_size
            ));
        }
        if self.seq > cfg.max_sequence_length() {
            return Err(format!(
                "sequence length {} exceeds the model's max_position_embeddings {}",
                self.seq, cfg.max_position_embeddings
            ));
        }
        Ok(())
    }
}

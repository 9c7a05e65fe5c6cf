//! Text → tokens → packed fixed-length sequences, with a held-out validation split and a
//! deterministic, resumable sampler.

use crate::error::{EngineError, Result};
use crate::transformer::TokenBatch;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder,
};

/// The corpus embedded in the binary (see `data/README.md` for its source and licence).
pub const BUILTIN_CORPUS: &str = include_str!("../../../data/gnu-manuals.txt");
pub const BUILTIN_NAME: &str = "builtin:gnu-manuals";
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Reads the training text: the builtin corpus, or every file named (one document each; a `.jsonl`
/// file holds one document per line, in its `text` field).
pub fn read_corpus(source: &str) -> Result<Vec<String>> {
    if source == BUILTIN_NAME {
        return Ok(vec![BUILTIN_CORPUS.to_string()]);
    }
    let mut docs = Vec::new();
    let parts: Vec<&str> = source.split(',').filter(|s| !s.is_empty()).collect();
    for part in &parts {
        let path = Path::new(part);
        if parts.len() > 1 && !path.exists() {
            // A name with a comma in it is two names here: say so.
            return Err(EngineError::Invalid(format!(
                "data `{part}`: no such file or directory (`--data` is split at commas: `{source}` names {})",
                parts.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ")
            )));
        }
        let files: Vec<PathBuf> = if path.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| EngineError::io(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            v.sort();
            v
        } else {
            vec![path.to_path_buf()]
        };
        for f in files {
            let text = ferrotron_core::bounded::read_to_string(&f, ferrotron_core::bounded::CORPUS)
                .map_err(|e| EngineError::io(&f, e))?;
            if text.trim().is_empty() {
                return Err(EngineError::format(&f, "the data file is empty"));
            }
            if f.extension().is_some_and(|e| e == "jsonl") {
                docs.extend(json_lines_documents(&f, &text)?);
            } else {
                docs.push(text);
            }
        }
    }
    if docs.is_empty() {
        return Err(EngineError::Invalid(format!(
            "data `{source}` names no files"
        )));
    }
    Ok(docs)
}

/// The documents of a JSON Lines file: each non-blank line an object whose `text` is a string.
fn json_lines_documents(file: &Path, text: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |msg: String| EngineError::format(file, format!("line {}: {msg}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not a JSON object: {e}")))?;
        match v.get("text") {
            Some(serde_json::Value::String(t)) => docs.push(t.clone()),
            Some(other) => {
                return Err(bad(format!(
                    "`text` must be a string, found {}",
                    type_name(other)
                )))
            }
            None => {
                return Err(bad(
                    "no `text` field (each line must be an object like {\"text\": \"...\"})".into(),
                ))
            }
        }
    }
    Ok(docs)
}

fn type_name(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Loads a `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let bytes = ferrotron_core::bounded::read(path, ferrotron_core::bounded::TOKENIZER)
        .map_err(|e| EngineError::io(path, e))?;
    Tokenizer::from_bytes(bytes)
        .map_err(|e| EngineError::format(path, format!("not a usable tokenizer.json: {e}")))
}

/// Trains a byte-level BPE tokenizer of `vocab_size` entries on `docs`, or loads the one cached in
/// `cache_dir` from an earlier run on the same text and size.
/// Where [`train_or_load_tokenizer`] caches the tokenizer of these documents and vocabulary size.
pub fn tokenizer_cache_path(docs: &[String], vocab_size: usize, cache_dir: &Path) -> PathBuf {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(&(docs, vocab_size, "bpe-bytelevel-v1"), &mut h);
    cache_dir.join(format!(
        "tokenizer-{:016x}.json",
        std::hash::Hasher::finish(&h)
    ))
}

pub fn train_or_load_tokenizer(
    docs: &[String],
    vocab_size: usize,
    cache_dir: &Path,
) -> Result<(Tokenizer, PathBuf)> {
    let path = tokenizer_cache_path(docs, vocab_size, cache_dir);
    if path.exists() {
        return Ok((load_tokenizer(&path)?, path));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tk = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(byte_level)))
    .with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)))
    .build()
    .map_err(|e| EngineError::Invalid(format!("building the tokenizer: {e}")))?;
    tk.train(&mut trainer, docs.iter().flat_map(|d| d.split("\n\n")))
        .map_err(|e| EngineError::Invalid(format!("training the tokenizer: {e}")))?;
    std::fs::create_dir_all(cache_dir).map_err(|e| EngineError::io(cache_dir, e))?;
    let json = tk
        .to_string(false)
        .map_err(|e| EngineError::Invalid(format!("serialising the tokenizer: {e}")))?;
    crate::hf::write_atomic(&path, json.as_bytes())?;
    Ok((load_tokenizer(&path)?, path))
}

/// A tokenizer whose ids reach past the model's vocabulary would index outside the embedding.
pub fn check_tokenizer_fits(tok: &Tokenizer, path: &Path, model_vocab: usize) -> Result<()> {
    let n = tok.get_vocab_size(true);
    if n > model_vocab {
        return Err(EngineError::format(
            path,
            format!("the tokenizer has {n} tokens but the model's vocab_size is {model_vocab}"),
        ));
    }
    Ok(())
}

/// How each document is framed with the tokenizer's special tokens, as transformers frames
/// `tokenizer(text)`: its post-processor's tokens (Llama 3's `<|begin_of_text|>`), or, where
/// `tokenizer_config.json` says `add_bos_token` / `add_eos_token` (Llama-2- and Mistral-style
/// tokenizers, whose transformers class rebuilds its post-processor from them), those. Every
/// document then ends with the end-of-sequence token, so that packed documents are separated as in
/// pretraining.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DocumentFraming {
    /// `add_bos_token`: Some(true) puts the BOS first, Some(false) removes one the post-processor put.
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub bos: Option<u32>,
    /// The separator after every document.
    pub eos: Option<u32>,
}

impl DocumentFraming {
    /// The framing of the tokenizer in `tokenizer_json`, from the `tokenizer_config.json` beside it;
    /// without one (a tokenizer ferrotron trained), `<|endoftext|>` ends each document where the
    /// tokenizer has it.
    pub fn for_tokenizer(tok: &Tokenizer, tokenizer_json: &Path) -> Result<Self> {
        let config = tokenizer_json.with_file_name("tokenizer_config.json");
        if !config.is_file() {
            return Ok(Self {
                eos: tok.token_to_id(END_OF_TEXT),
                ..Self::default()
            });
        }
        let text =
            ferrotron_core::bounded::read_to_string(&config, ferrotron_core::bounded::SETTINGS)
                .map_err(|e| EngineError::io(&config, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::format(&config, format!("not valid JSON: {e}")))?;
        let flag = |key: &str| -> Result<Option<bool>> {
            match v.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
                Some(other) => Err(EngineError::format(
                    &config,
                    format!("`{key}` must be true or false, found {other}"),
                )),
            }
        };
        let token = |key: &str| -> Result<Option<u32>> {
            let content = match v.get(key) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(serde_json::Value::Object(o)) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default(),
                Some(other) => {
                    return Err(EngineError::format(
                        &config,
                        format!("`{key}` must be a token, found {other}"),
                    ))
                }
            };
            tok.token_to_id(content).map(Some).ok_or_else(|| {
                EngineError::format(
                    &config,
                    format!("`{key}` is `{content}`, which the tokenizer does not have"),
                )
            })
        };
        Ok(Self {
            add_bos: flag("add_bos_token")?,
            add_eos: flag("add_eos_token")?,
            bos: token("bos_token")?,
            eos: token("eos_token")?,
        })
    }

    /// `tokenizer(text)` as transformers returns it: the post-processor's special tokens, then
    /// `add_bos_token` / `add_eos_token` where the config says them.
    pub fn encode(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        let enc = tok
            .encode(text, true)
            .map_err(|e| EngineError::Invalid(format!("tokenizing: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        Self::frame(&mut ids, self.add_bos, self.bos, true);
        Self::frame(&mut ids, self.add_eos, self.eos, false);
        Ok(ids)
    }

    fn frame(ids: &mut Vec<u32>, add: Option<bool>, token: Option<u32>, first: bool) {
        let (Some(add), Some(t)) = (add, token) else {
            return;
        };
        let at = if first { ids.first() } else { ids.last() }.copied();
        match (add, at == Some(t)) {
            (true, false) if first => ids.insert(0, t),
            (true, false) => ids.push(t),
            (false, true) if first => {
                ids.remove(0);
            }
            (false, true) => {
                ids.pop();
            }
            _ => {}
        }
    }
}

/// Tokenizes documents into one stream, each framed as [`DocumentFraming`] says and ended by the
/// end-of-sequence token.
pub fn encode_documents(
    tok: &Tokenizer,
    framing: &DocumentFraming,
    docs: &[String],
) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for doc in docs {
        let ids = framing.encode(tok, doc)?;
        let ends = ids.last().copied();
        out.extend(ids);
        if let Some(eos) = framing.eos.filter(|&e| ends != Some(e)) {
            out.push(eos);
        }
    }
    Ok(out)
}

/// The token stream split into a training part and a held-out tail for validation.
#[derive(Debug, Clone)]
pub struct TokenSplit {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl TokenSplit {
    /// Holds out the last `val_fraction` of the stream (a contiguous tail: no window straddles both).
    pub fn new(tokens: Vec<u32>, val_fraction: f64, seq: usize) -> Result<Self> {
        let val_len = ((tokens.len() as f64 * val_fraction) as usize).max(if val_fraction > 0.0 {
            seq
        } else {
            0
        });
        if tokens.len() < val_len + seq {
            return Err(EngineError::Invalid(format!(
                "the data has {} tokens: too few for one training sequence of {seq} tokens plus a validation split of {val_len}",
                tokens.len()
            )));
        }
        let mut train = tokens;
        let val = train.split_off(train.len() - val_len);
        Ok(Self { train, val })
    }
}

/// Non-overlapping windows of `seq` tokens, visited in a seeded random order that is reshuffled
/// each epoch. Its position is two integers, so a run can resume exactly.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SequenceSampler {
    pub seq: usize,
    pub seed: u64,
    pub epoch: u64,
    pub cursor: usize,
    num_windows: usize,
    #[serde(skip)]
    order: Vec<usize>,
}

impl SequenceSampler {
    pub fn new(num_tokens: usize, seq: usize, seed: u64) -> Self {
        let mut s = Self {
            seq,
            seed,
            epoch: 0,
            cursor: 0,
            num_windows: num_tokens / seq,
            order: Vec::new(),
        };
        s.shuffle();
        s
    }

    /// A sampler continuing from `position` (a serialised sampler, as a checkpoint records it) over
    /// `num_tokens` tokens in windows of `seq`; an error when the data or the windows changed.
    pub fn resumed(position: &serde_json::Value, num_tokens: usize, seq: usize) -> Result<Self> {
        let mut s: Self = serde_json::from_value(position.clone()).map_err(|e| {
            EngineError::Invalid(format!(
                "resume: the data loader's position is unreadable: {e}"
            ))
        })?;
        if s.seq != seq || s.num_windows != num_tokens / seq || s.cursor > s.num_windows {
            return Err(EngineError::Invalid(format!(
                "resume: the checkpoint's data loader read {} windows of {} tokens; this run's data \
                 has {} windows of {seq} (the data, the tokenizer or seq_len changed)",
                s.num_windows,
                s.seq,
                num_tokens / seq
            )));
        }
        s.shuffle();
        Ok(s)
    }

    pub fn num_windows(&self) -> usize {
        self.num_windows
    }

    fn shuffle(&mut self) {
        self.order = (0..self.num_windows).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
            self.seed ^ self.epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        self.order.shuffle(&mut rng);
    }

    /// The next `batch` windows of `tokens` as one batch.
    pub fn next_batch(&mut self, tokens: &[u32], batch: usize) -> TokenBatch {
        let mut ids = Vec::with_capacity(batch * self.seq);
        for _ in 0..batch {
            if self.cursor == self.num_windows {
                self.epoch += 1;
                self.cursor = 0;
                self.shuffle();
            }
            let w = self.order[self.cursor];
            ids.extend_from_slice(&tokens[w * self.seq..(w + 1) * self.seq]);
            self.cursor += 1;
        }
        TokenBatch {
            ids,
            batch,
            seq: self.seq,
        }
    }
}

/// Validation batches: the held-out windows in order, at most `max_batches` of them.
pub fn validation_batches(
    val: &[u32],
    seq: usize,
    batch: usize,
    max_batches: usize,
) -> Vec<TokenBatch> {
    val.chunks_exact(seq)
        .collect::<Vec<_>>()
        .chunks(batch)
        .take(max_batches)
        .map(|ws| TokenBatch {
            ids: ws.concat(),
            batch: ws.len(),
            seq,
        })
        .collect()
}

/// Reads a token file: a safetensors file with `input_ids` ([batch, seq], int64 or int32). The
/// ids are only read here; [`TokenBatch::check`] says whether they fit a model.
pub fn read_token_file(path: &Path) -> Result<TokenBatch> {
    let bytes = ferrotron_core::bounded::read(path, ferrotron_core::bounded::CORPUS)
        .map_err(|e| EngineError::io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| EngineError::format(path, format!("not a valid safetensors file: {e}")))?;
    let view = st
        .tensor("input_ids")
        .map_err(|_| EngineError::format(path, "tensor `input_ids` is missing"))?;
    let &[batch, seq] = view.shape() else {
        return Err(EngineError::format(
            path,
            format!(
                "tensor `input_ids` has shape {:?}, expected [batch, seq]",
                view.shape()
            ),
        ));
    };
    let ids: Vec<i64> = match view.dtype() {
        safetensors::Dtype::I64 => view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        safetensors::Dtype::I32 => view
            .data()
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))))
            .collect(),
        d => {
            return Err(EngineError::format(
                path,
                format!("tensor `input_ids` has dtype {d:?}, expected int64 or int32"),
            ))
        }
    };
    if let Some(bad) = ids.iter().find(|&&i| u32::try_from(i).is_err()) {
        return Err(EngineError::format(
            path,
            format!("`input_ids` holds the invalid id {bad}"),
        ));
    }
    Ok(TokenBatch {
        ids: ids.into_iter().map(|i| i as u32).collect(),
        batch,
        seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_is_deterministic_and_covers_every_window() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut a = SequenceSampler::new(tokens.len(), 10, 7);
        let mut b = SequenceSampler::new(tokens.len(), 10, 7);
        let first: Vec<u32> = (0..5).flat_map(|_| a.next_batch(&tokens, 2).ids).collect();
        let again: Vec<u32> = (0..5).flat_map(|_| b.next_batch(&tokens, 2).ids).collect();
        assert_eq!(first, again);
        let mut starts: Vec<u32> = first.chunks(10).map(|w| w[0]).collect();
        starts.sort();
        assert_eq!(starts, (0..10).map(|i| i * 10).collect::<Vec<_>>());
        // Resuming from the serialised position continues identically.
        let saved = serde_json::to_string(&a).unwrap();
        let mut resumed: SequenceSampler = serde_json::from_str(&saved).unwrap();
        resumed.shuffle();
        assert_eq!(
            resumed.next_batch(&tokens, 3).ids,
            a.next_batch(&tokens, 3).ids
        );
    }

    #[test]
    fn split_holds_out_the_tail() {
        let s = TokenSplit::new((0..1000).collect(), 0.1, 16).unwrap();
        assert_eq!(s.val.len(), 100);
        assert_eq!(s.train.len(), 900);
        assert!(TokenSplit::new((0..10).collect(), 0.1, 16).is_err());
    }

    #[test]
    fn builtin_tokenizer_trains_and_round_trips() {
        let dir = std::env::temp_dir().join(format!("ferrotron-tok-{}", std::process::id()));
        let docs = vec![BUILTIN_CORPUS[..200_000].to_string()];
        let (tok, path) = train_or_load_tokenizer(&docs, 512, &dir).unwrap();
        assert!(path.exists());
        assert_eq!(tok.get_vocab_size(true), 512);
        let text = "sort -n file | uniq -c";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert!(check_tokenizer_fits(&tok, &path, 256)
            .unwrap_err()
            .to_string()
            .contains("vocab_size is 256"));
        std::fs::remove_dir_all(dir).ok();
    }
}

//! Context parallelism: every sequence split over a group of `size` devices, and attention computed
//! across the split.
//!
//! **The split** (causal load balance): a sequence is cut into `2·size` equal chunks and device `i`
//! holds chunks `i` and `2·size − 1 − i`, so that every device has as many early (cheap) as late
//! (expensive) queries. Everything but attention is per token and runs on the device's tokens alone;
//! positions (RoPE, learned embeddings) stay the tokens' places in the whole sequence, and each token's
//! target is the next token of the whole sequence.
//!
//! **Ring** (`cp_comm=ring`): each device's K and V travel around the group; a device attends its
//! queries to the block in hand while the next one arrives (it is sent before the products start), and
//! merges the blocks' results by their log-sum-exp. Backward recomputes the same blocks from the
//! whole attention's log-sum-exp; each block's dK and dV travel on around the ring, summed as they
//! go, and reach their owner after a full turn.
//!
//! **All-to-all** (`cp_comm=a2a`, Ulysses): each device sends every other device its tokens' Q, K and
//! V of that device's heads, so that each attends whole sequences with `heads / size` heads; the
//! output goes back the same way. Backward sends Q, K, V, the output and its gradient again and
//! returns dQ, dK and dV. Where there are fewer KV heads than devices, a KV head goes to every device
//! whose query heads use it, and its gradients are summed on the way back.
//!
//! Messages are f32 (the values attention reads, unrounded), tagged by what they carry and the ring
//! step, sent without holding the device (`Comm::send_overlapped`) and counted as group `cp`.

use crate::comm::{Comm, CommError, Group};
use crate::kernels::{AttnBlock, AttnGradInputs, AttnShape, Backend, Qkv, QkvGrads, Span};
use crate::transformer::TokenBatch;
use ferrotron_core::layout::CpComm;

/// This device's place in its context-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextShard {
    pub size: usize,
    pub index: usize,
    pub comm: CpComm,
}

/// Tags of context-parallel messages: a namespace of their own (the pipeline's tags stay below 2⁶²).
const TAG: u64 = 3 << 62;
const TAG_KV: u64 = TAG;
const TAG_DKV: u64 = TAG | 1 << 40;
const TAG_A2A: u64 = TAG | 2 << 40;

impl ContextShard {
    /// The chunks (of `2·size` per sequence) this device holds, in the order its rows keep them.
    pub fn chunks(&self) -> [usize; 2] {
        [self.index, 2 * self.size - 1 - self.index]
    }

    /// Why a sequence of `seq` tokens cannot be split this way, if it cannot.
    pub fn check(&self, seq: usize) -> Result<(), String> {
        if self.size > 1 && !seq.is_multiple_of(2 * self.size) {
            return Err(format!(
                "context parallelism: cp={} splits each sequence into 2·cp = {} equal chunks (causal \
                 load balance), and sequences of {seq} tokens do not divide by {}; use a sequence \
                 length that is a multiple of {}",
                self.size,
                2 * self.size,
                2 * self.size,
                2 * self.size
            ));
        }
        Ok(())
    }

    /// The positions in its sequence of each of this device's `local` tokens per sequence.
    pub fn positions(&self, local: usize) -> Vec<u32> {
        if self.size == 1 {
            return (0..local as u32).collect();
        }
        let c = local / 2;
        self.chunks()
            .iter()
            .flat_map(|&k| (k * c..(k + 1) * c).map(|p| p as u32))
            .collect()
    }

    /// Tokens per whole sequence, from this device's `local` share.
    pub fn sequence_length(&self, local: usize) -> usize {
        local * self.size
    }

    /// This device's part of a batch of whole sequences: its tokens of each (as a batch of shorter
    /// sequences) and each token's next-token target in the whole sequence.
    pub fn split(&self, b: &TokenBatch) -> (TokenBatch, Vec<Option<u32>>) {
        if self.size == 1 {
            return (b.clone(), b.targets());
        }
        let local = b.seq / self.size;
        let positions = self.positions(local);
        let mut ids = Vec::with_capacity(b.batch * local);
        let mut targets = Vec::with_capacity(b.batch * local);
        for s in 0..b.batch {
            let seq = &b.ids[s * b.seq..(s + 1) * b.seq];
            for &p in &positions {
                let p = p as usize;
                ids.push(seq[p]);
                targets.push(seq.get(p + 1).copied());
            }
        }
        let part = TokenBatch {
            ids,
            batch: b.batch,
            seq: local,
        };
        (part, targets)
    }

    /// Why attention with `heads` query and `kv_heads` key/value heads (this device's, after tensor
    /// parallelism) cannot be split over the group's heads (all-to-all), if it cannot.
    pub fn check_heads(&self, heads: usize, kv_heads: usize) -> Result<(), String> {
        if self.comm != CpComm::A2a || self.size == 1 {
            return Ok(());
        }
        let n = self.size;
        if !heads.is_multiple_of(n) || !(kv_heads.is_multiple_of(n) || n.is_multiple_of(kv_heads)) {
            return Err(format!(
                "cp_comm=a2a gives each of the cp={n} devices heads / cp query heads of whole \
                 sequences: the query heads ({heads} per device after tensor parallelism) must divide \
                 by cp, and the KV heads ({kv_heads}) must divide by cp or cp by them (then each KV \
                 head is replicated to the devices whose query heads share it); use cp_comm=ring, \
                 or a cp that divides the heads"
            ));
        }
        Ok(())
    }
}

/// The queries (or keys) of `chunk` among this device's rows: `local` rows per sequence holding two
/// chunks.
fn span(local: usize, slot: usize, chunk: usize) -> Span {
    let c = local / 2;
    Span {
        rows: local,
        first: slot * c,
        len: c,
        position: chunk * c,
    }
}

/// The blocks of this device's queries against the keys device `owner` holds (those any query
/// sees).
fn blocks(cx: &ContextShard, owner: usize, s: AttnShape) -> Vec<AttnBlock> {
    let theirs = ContextShard {
        index: owner,
        ..*cx
    };
    let mut out = Vec::new();
    for (qs, &qc) in cx.chunks().iter().enumerate() {
        for (ks, &kc) in theirs.chunks().iter().enumerate() {
            let b = AttnBlock {
                shape: s,
                q: span(s.seq, qs, qc),
                k: span(s.seq, ks, kc),
            };
            if b.any_visible() {
                out.push(b);
            }
        }
    }
    out
}

/// Attention over the whole sequences of which this device holds `s.seq` tokens each: `out` and
/// `lse` as [`Backend::attention_forward`] writes them for this device's queries (for `a2a`, `lse`
/// holds the head-split attention's, which only [`backward`] reads).
#[allow(clippy::too_many_arguments)]
pub fn forward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    x: Qkv,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CommError> {
    match cx.comm {
        CpComm::Ring => ring_forward(c, g, cx, be, s, x, out, lse),
        CpComm::A2a => a2a_forward(c, g, cx, be, s, x, out, lse),
    }
}

/// The gradients at this device's Q, K and V (every element written).
#[allow(clippy::too_many_arguments)]
pub fn backward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    inputs: AttnGradInputs,
    grads: QkvGrads,
) -> Result<(), CommError> {
    match cx.comm {
        CpComm::Ring => ring_backward(c, g, cx, be, s, inputs, grads),
        CpComm::A2a => a2a_backward(c, g, cx, be, s, inputs, grads),
    }
}

/// The group's next and previous device around the ring.
fn neighbours(g: &Group, cx: &ContextShard) -> (usize, usize) {
    let n = cx.size;
    (g.ranks[(cx.index + 1) % n], g.ranks[(cx.index + n - 1) % n])
}

#[allow(clippy::too_many_arguments)]
fn ring_forward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    x: Qkv,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CommError> {
    let n = cx.size;
    let (next, prev) = neighbours(g, cx);
    out.fill(0.0);
    lse.fill(f32::NEG_INFINITY);
    let (q, k_len) = (x.q, x.k.len());
    let mut kv = [x.k, x.v].concat();
    let (mut out_b, mut lse_b) = (vec![0f32; out.len()], vec![0f32; lse.len()]);
    for step in 0..n {
        // Send the block in hand on before computing with it: its transfer hides behind the
        // products.
        if step + 1 < n {
            c.send_overlapped("cp", next, &kv, TAG_KV | step as u64)?;
        }
        let owner = (cx.index + n - step) % n;
        let (k, v) = kv.split_at(k_len);
        for b in blocks(cx, owner, s) {
            lse_b.fill(f32::NEG_INFINITY);
            be.attention_block_forward(b, Qkv { q, k, v }, &mut out_b, &mut lse_b);
            be.attention_merge(s, out, lse, &out_b, &lse_b);
        }
        if step + 1 < n {
            c.recv_as("cp", prev, &mut kv, TAG_KV | step as u64)?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn ring_backward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    inputs: AttnGradInputs,
    grads: QkvGrads,
) -> Result<(), CommError> {
    let n = cx.size;
    let (next, prev) = neighbours(g, cx);
    let QkvGrads { dq, dk, dv } = grads;
    dq.fill(0.0);
    let k_len = inputs.x.k.len();
    let mut kv = [inputs.x.k, inputs.x.v].concat();
    let (mut mine, mut passing) = (vec![0f32; kv.len()], vec![0f32; kv.len()]);
    for step in 0..n {
        if step + 1 < n {
            c.send_overlapped("cp", next, &kv, TAG_KV | step as u64)?;
        }
        let owner = (cx.index + n - step) % n;
        mine.fill(0.0);
        {
            let (k, v) = kv.split_at(k_len);
            let (dk, dv) = mine.split_at_mut(k_len);
            let block_inputs = AttnGradInputs {
                x: Qkv { k, v, ..inputs.x },
                ..inputs
            };
            let mut grads = QkvGrads {
                dq: &mut *dq,
                dk,
                dv,
            };
            for b in blocks(cx, owner, s) {
                be.attention_block_backward(b, block_inputs, grads.reborrow());
            }
        }
        // The owner's dK and dV so far come from the previous device (which had its K and V one
        // step ago); add this device's share and pass them on. After a full turn they are home.
        if step > 0 {
            c.recv_as("cp", prev, &mut passing, TAG_DKV | (step - 1) as u64)?;
            mine.iter_mut().zip(&passing).for_each(|(a, b)| *a += b);
        }
        c.send_overlapped("cp", next, &mine, TAG_DKV | step as u64)?;
        if step + 1 < n {
            c.recv_as("cp", prev, &mut kv, TAG_KV | step as u64)?;
        }
    }
    c.recv_as("cp", prev, &mut passing, TAG_DKV | (n - 1) as u64)?;
    let (pk, pv) = passing.split_at(k_len);
    dk.copy_from_slice(pk);
    dv.copy_from_slice(pv);
    Ok(())
}

/// Heads device `r` attends under all-to-all: its query heads and the KV heads they use.
fn heads_of(
    cx: &ContextShard,
    s: AttnShape,
    r: usize,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let per = s.heads / cx.size;
    let group = s.heads / s.kv_heads;
    let q = r * per..(r + 1) * per;
    let kv = q.start / group..(q.end - 1) / group + 1;
    (q, kv)
}

/// Columns `heads` (each `d` wide) of every row of `x` (rows `width` wide), row-major.
fn columns(x: &[f32], width: usize, heads: &std::ops::Range<usize>, d: usize) -> Vec<f32> {
    x.chunks_exact(width)
        .flat_map(|row| row[heads.start * d..heads.end * d].iter().copied())
        .collect()
}

/// Sends each device `r` the columns of `x` it needs (`want(r)`, heads `d` wide) of this device's
/// rows, and gathers from every device its rows of this device's columns: the whole sequences,
/// rows in sequence order, `s.batch · s.seq · size` rows of `want(me).len() · d` columns.
#[allow(clippy::too_many_arguments)]
fn to_heads<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    s: AttnShape,
    x: &[f32],
    width: usize,
    want: &dyn Fn(usize) -> std::ops::Range<usize>,
    tag: u64,
) -> Result<Vec<f32>, CommError> {
    let (n, d, local) = (cx.size, s.head_dim, s.seq);
    for r in (0..n).filter(|&r| r != cx.index) {
        c.send_overlapped("cp", g.ranks[r], &columns(x, width, &want(r), d), tag)?;
    }
    let cols = want(cx.index).len() * d;
    let whole = local * n;
    let mut out = vec![0f32; s.batch * whole * cols];
    for r in 0..n {
        let part = if r == cx.index {
            columns(x, width, &want(r), d)
        } else {
            let mut buf = vec![0f32; s.batch * local * cols];
            c.recv_as("cp", g.ranks[r], &mut buf, tag)?;
            buf
        };
        let theirs = ContextShard { index: r, ..*cx };
        for (i, p) in theirs.positions(local).into_iter().enumerate() {
            for b in 0..s.batch {
                let from = (b * local + i) * cols;
                let to = (b * whole + p as usize) * cols;
                out[to..to + cols].copy_from_slice(&part[from..from + cols]);
            }
        }
    }
    Ok(out)
}

/// The inverse of [`to_heads`]: from this device's columns of whole sequences back to every
/// device's rows; each device adds what it receives into its columns `want(me)` of `x` (rows
/// `width` wide; several devices' shares of a replicated KV head sum).
#[allow(clippy::too_many_arguments)]
fn from_heads<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    s: AttnShape,
    y: &[f32],
    x: &mut [f32],
    width: usize,
    want: &dyn Fn(usize) -> std::ops::Range<usize>,
    tag: u64,
) -> Result<(), CommError> {
    let (n, d, local) = (cx.size, s.head_dim, s.seq);
    let whole = local * n;
    let cols = want(cx.index).len() * d;
    // The rows device r holds, of this device's columns.
    let rows_of = |r: usize| -> Vec<f32> {
        let theirs = ContextShard { index: r, ..*cx };
        let mut part = Vec::with_capacity(s.batch * local * cols);
        for b in 0..s.batch {
            for p in theirs.positions(local) {
                let from = (b * whole + p as usize) * cols;
                part.extend_from_slice(&y[from..from + cols]);
            }
        }
        part
    };
    for r in (0..n).filter(|&r| r != cx.index) {
        c.send_overlapped("cp", g.ranks[r], &rows_of(r), tag)?;
    }
    x.fill(0.0);
    for r in 0..n {
        let heads = want(r);
        let w = heads.len() * d;
        let part = if r == cx.index {
            rows_of(r)
        } else {
            let mut buf = vec![0f32; s.batch * local * w];
            c.recv_as("cp", g.ranks[r], &mut buf, tag)?;
            buf
        };
        for (row, src) in x.chunks_exact_mut(width).zip(part.chunks_exact(w)) {
            row[heads.start * d..heads.end * d]
                .iter_mut()
                .zip(src)
                .for_each(|(a, b)| *a += b);
        }
    }
    Ok(())
}

/// The head-split attention's shape: whole sequences, this device's query and KV heads.
fn head_shape(cx: &ContextShard, s: AttnShape) -> AttnShape {
    let (qh, kvh) = heads_of(cx, s, cx.index);
    AttnShape {
        seq: s.seq * cx.size,
        heads: qh.len(),
        kv_heads: kvh.len(),
        ..s
    }
}

#[allow(clippy::too_many_arguments)]
fn a2a_forward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    x: Qkv,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CommError> {
    let (qw, kw) = (s.q_width(), s.kv_width());
    let qheads = |r: usize| heads_of(cx, s, r).0;
    let kvheads = |r: usize| heads_of(cx, s, r).1;
    let hq = to_heads(c, g, cx, s, x.q, qw, &qheads, TAG_A2A)?;
    let hk = to_heads(c, g, cx, s, x.k, kw, &kvheads, TAG_A2A | 1)?;
    let hv = to_heads(c, g, cx, s, x.v, kw, &kvheads, TAG_A2A | 2)?;
    let hs = head_shape(cx, s);
    let mut ho = vec![0f32; hq.len()];
    let heads = Qkv::new(&hq, &hk, &hv);
    be.attention_forward(hs, heads, &mut ho, lse);
    from_heads(c, g, cx, s, &ho, out, qw, &qheads, TAG_A2A | 3)
}

#[allow(clippy::too_many_arguments)]
fn a2a_backward<C: Comm>(
    c: &mut C,
    g: &Group,
    cx: &ContextShard,
    be: &dyn Backend,
    s: AttnShape,
    inputs: AttnGradInputs,
    grads: QkvGrads,
) -> Result<(), CommError> {
    let (qw, kw) = (s.q_width(), s.kv_width());
    let qheads = |r: usize| heads_of(cx, s, r).0;
    let kvheads = |r: usize| heads_of(cx, s, r).1;
    let AttnGradInputs { dout, x, out, lse } = inputs;
    let QkvGrads { dq, dk, dv } = grads;
    let hq = to_heads(c, g, cx, s, x.q, qw, &qheads, TAG_A2A | 4)?;
    let hk = to_heads(c, g, cx, s, x.k, kw, &kvheads, TAG_A2A | 5)?;
    let hv = to_heads(c, g, cx, s, x.v, kw, &kvheads, TAG_A2A | 6)?;
    let ho = to_heads(c, g, cx, s, out, qw, &qheads, TAG_A2A | 7)?;
    let hdo = to_heads(c, g, cx, s, dout, qw, &qheads, TAG_A2A | 8)?;
    let hs = head_shape(cx, s);
    let (mut hdq, mut hdk, mut hdv) = (
        vec![0f32; hq.len()],
        vec![0f32; hk.len()],
        vec![0f32; hv.len()],
    );
    let head_inputs = AttnGradInputs::new(&hdo, Qkv::new(&hq, &hk, &hv), &ho, lse);
    let head_grads = QkvGrads::new(&mut hdq, &mut hdk, &mut hdv);
    be.attention_backward(hs, head_inputs, head_grads);
    from_heads(c, g, cx, s, &hdq, dq, qw, &qheads, TAG_A2A | 9)?;
    from_heads(c, g, cx, s, &hdk, dk, kw, &kvheads, TAG_A2A | 10)?;
    from_heads(c, g, cx, s, &hdv, dv, kw, &kvheads, TAG_A2A | 11)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ThreadWorld;
    use crate::kernels::CpuBackend;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    /// Rows of `x` (width `w`) that device `cx` holds of each sequence of `seq` tokens.
    fn local_rows(cx: &ContextShard, x: &[f32], w: usize, batch: usize, seq: usize) -> Vec<f32> {
        let local = seq / cx.size;
        (0..batch)
            .flat_map(|b| {
                cx.positions(local)
                    .into_iter()
                    .flat_map(move |p| x[(b * seq + p as usize) * w..][..w].to_vec())
            })
            .collect()
    }

    fn max_rel(want: &[f32], got: &[f32]) -> f64 {
        let norm = want.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        let err = want
            .iter()
            .zip(got)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        err / norm
    }

    /// Ring and all-to-all attention over cp devices give each device exactly the rows of the
    /// whole attention's output and gradients it holds.
    #[test]
    fn split_attention_equals_the_whole() {
        let be = CpuBackend::with_threads(1);
        for (cp, comm, heads, kv, window) in [
            (2, CpComm::Ring, 4, 2, None),
            (3, CpComm::Ring, 2, 1, None),
            (4, CpComm::Ring, 2, 2, Some(13)),
            // A window shorter than a chunk: a chunk's first queries still see the chunk before.
            (2, CpComm::Ring, 4, 2, Some(5)),
            (2, CpComm::A2a, 4, 2, None),
            (4, CpComm::A2a, 4, 2, None),
            (4, CpComm::A2a, 4, 1, Some(9)),
        ] {
            let (batch, seq, d) = (2, 48, 8);
            let s = AttnShape {
                batch,
                seq,
                heads,
                kv_heads: kv,
                head_dim: d,
                window,
            };
            let (qw, kw) = (s.q_width(), s.kv_width());
            let [q, k, v, dout] = [qw, kw, kw, qw].map(|w| random(batch * seq * w, w as u64));
            let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; s.lse_len()]);
            let x = Qkv::new(&q, &k, &v);
            be.attention_forward(s, x, &mut out, &mut lse);
            let (mut dq, mut dk, mut dv) = (
                vec![0f32; q.len()],
                vec![0f32; k.len()],
                vec![0f32; v.len()],
            );
            let inputs = AttnGradInputs::new(&dout, x, &out, &lse);
            let grads = QkvGrads::new(&mut dq, &mut dk, &mut dv);
            be.attention_backward(s, inputs, grads);
            let results = ThreadWorld::new(cp).run(|c| {
                let cx = ContextShard {
                    size: cp,
                    index: c.rank(),
                    comm,
                };
                let g = Group::new("cp", (0..cp).collect());
                let local = AttnShape { seq: seq / cp, ..s };
                let rows = |x: &[f32], w| local_rows(&cx, x, w, batch, seq);
                let (lq, lk, lv, ldo) = (rows(&q, qw), rows(&k, kw), rows(&v, kw), rows(&dout, qw));
                let (mut o, mut l) = (vec![0f32; lq.len()], vec![0f32; local.lse_len()]);
                let x = Qkv::new(&lq, &lk, &lv);
                forward(c, &g, &cx, &be, local, x, &mut o, &mut l)?;
                let (mut gq, mut gk, mut gv) = (
                    vec![0f32; lq.len()],
                    vec![0f32; lk.len()],
                    vec![0f32; lv.len()],
                );
                let inputs = AttnGradInputs::new(&ldo, x, &o, &l);
                let grads = QkvGrads::new(&mut gq, &mut gk, &mut gv);
                backward(c, &g, &cx, &be, local, inputs, grads)?;
                Ok::<_, CommError>([
                    (o, rows(&out, qw)),
                    (gq, rows(&dq, qw)),
                    (gk, rows(&dk, kw)),
                    (gv, rows(&dv, kw)),
                ])
            });
            for (rank, r) in results.into_iter().enumerate() {
                let r = r.unwrap().unwrap();
                for (name, (got, want)) in ["out", "dq", "dk", "dv"].iter().zip(r) {
                    let e = max_rel(&want, &got);
                    assert!(
                        e < 2e-6,
                        "cp={cp} {comm:?} rank {rank} {name}: relative error {e:e}"
                    );
                }
            }
        }
    }
}

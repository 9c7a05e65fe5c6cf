//! Expert parallelism: a mixture of experts' routed experts divided over an expert-parallel group
//! carved from the data-parallel replicas (`ep` of them, see `RankGrid::expert_ranks`), tokens sent
//! to their experts' devices and the results back with all-to-alls. Each device holds
//! `num_experts / ep` experts of every block (`MoeConfig::held`); the model code does the routing
//! and calls the two exchanges here through `ShardCollectives`.
//!
//! An all-to-all is one message to each other device of the group (a device keeps its own part),
//! each sent without waiting (`send_overlapped`) before any is received, so no order of arrival can
//! deadlock; counted under group kind `ep`. Rows travel in the run's wire format (16 bits under
//! mixed precision, as the activations between pipeline stages and tensor-parallel devices do); a
//! device's own part is rounded alike, so that a row's value does not depend on where its expert
//! lives.

use crate::comm::{Comm, CommError, Group};
use crate::half_storage::{Half16, Wire};
use ferrotron_core::precision::Half;

/// Tags of expert-parallel messages: a namespace of their own (context parallelism's are
/// `3 << 62 | k << 40` for small k, the pipeline's below 2⁶²).
const TAG: u64 = 3 << 62 | 1 << 44;
const TAG_COUNTS: u64 = TAG;
const TAG_ROWS: u64 = TAG | 1;

/// Sends `counts[j]` to member j of `g` (this device is member `me`); returns what each member
/// sent here. Every member's vectors have the same length (experts per device).
pub fn exchange_counts<C: Comm>(
    c: &mut C,
    g: &Group,
    me: usize,
    counts: Vec<Vec<usize>>,
) -> Result<Vec<Vec<usize>>, CommError> {
    let per = counts.first().map_or(0, Vec::len);
    let wire: Vec<Vec<u64>> = counts
        .into_iter()
        .map(|v| v.into_iter().map(|n| n as u64).collect())
        .collect();
    let got = exchange(c, g, me, wire, &vec![per; g.size()], TAG_COUNTS)?;
    Ok(got
        .into_iter()
        .map(|v| v.into_iter().map(|n| n as usize).collect())
        .collect())
}

/// Sends `send[j]` to member j of `g` (this device is member `me`) in `wire`'s format; returns what
/// each member sent here, `lengths[j]` elements from member j.
pub fn exchange_rows<C: Comm>(
    c: &mut C,
    g: &Group,
    me: usize,
    wire: Wire,
    send: Vec<Vec<f32>>,
    lengths: &[usize],
) -> Result<Vec<Vec<f32>>, CommError> {
    match wire.0 {
        None => exchange(c, g, me, send, lengths, TAG_ROWS),
        Some(Half::Bf16) => exchange_rounded::<C, half::bf16>(c, g, me, send, lengths),
        Some(Half::F16) => exchange_rounded::<C, half::f16>(c, g, me, send, lengths),
    }
}

/// [`exchange_rows`] with every message rounded to `T` (the device's own part too).
fn exchange_rounded<C: Comm, T: Half16>(
    c: &mut C,
    g: &Group,
    me: usize,
    send: Vec<Vec<f32>>,
    lengths: &[usize],
) -> Result<Vec<Vec<f32>>, CommError> {
    let send: Vec<Vec<T>> = send.iter().map(|m| T::round_all(m)).collect();
    let got = exchange(c, g, me, send, lengths, TAG_ROWS)?;
    Ok(got.iter().map(|m| T::widen_all(m)).collect())
}

fn exchange<C: Comm, T: crate::comm::Element>(
    c: &mut C,
    g: &Group,
    me: usize,
    mut send: Vec<Vec<T>>,
    lengths: &[usize],
    tag: u64,
) -> Result<Vec<Vec<T>>, CommError> {
    let n = g.size();
    if send.len() != n || lengths.len() != n {
        return Err(CommError::Usage(format!(
            "expert all-to-all on group {}: {} messages and {} lengths for {n} devices",
            g.name,
            send.len(),
            lengths.len()
        )));
    }
    for (j, msg) in send.iter().enumerate().filter(|&(j, _)| j != me) {
        c.send_overlapped("ep", g.ranks[j], msg, tag)?;
    }
    let mut out = Vec::with_capacity(n);
    for (j, &len) in lengths.iter().enumerate() {
        if j == me {
            out.push(std::mem::take(&mut send[me]));
            continue;
        }
        let mut buf = vec![T::default(); len];
        c.recv_as("ep", g.ranks[j], &mut buf, tag)?;
        out.push(buf);
    }
    Ok(out)
}

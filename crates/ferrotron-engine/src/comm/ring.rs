//! The collectives, written once as ring algorithms over a point-to-point [`Transport`]: every backend
//! that can post and take messages gets all of [`Comm`] with the same byte counts, the same summation
//! order (so the same bits) and the same accounting.

use super::stats::{CommStats, OpStats};
use super::{Comm, CommError, CommResult, Element, Group, ReduceOp};

/// What one call of an operation did; added to the stats when it ends.
pub(crate) struct Tally {
    pub kind: &'static str,
    pub op: &'static str,
    pub group: String,
    pub s: OpStats,
}

/// Point-to-point messaging with accounting: what a backend provides.
pub(crate) trait Transport {
    fn my_rank(&self) -> usize;
    fn world(&self) -> usize;
    fn comm_stats(&self) -> &CommStats;
    fn begin(&mut self, kind: &'static str, op: &'static str, group: &str) -> Tally;
    fn end(&mut self, t: Tally);
    /// Sends `data` to `to` without waiting for the receiver.
    fn post<T: Element>(
        &mut self,
        t: &mut Tally,
        to: usize,
        data: &[T],
        tag: u64,
        total_len: usize,
    ) -> CommResult<()>;
    /// Receives the next message from `from`, checks it belongs to this operation (tag, total length,
    /// element type) and hands its elements to `consume`.
    fn take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()>;
    /// A ring step's send: by default a plain post (the receive follows).
    fn exchange_post<T: Element>(
        &mut self,
        t: &mut Tally,
        to: usize,
        data: &[T],
        tag: u64,
        total_len: usize,
    ) -> CommResult<()> {
        self.post(t, to, data, tag, total_len)
    }
    /// Reusable working storage.
    fn scratch(&mut self) -> &mut Vec<u64>;
}

/// The element range of chunk `c` when `len` elements are cut into `n` nearly equal chunks.
pub(crate) fn chunk(len: usize, n: usize, c: usize) -> std::ops::Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

/// Ring reduce-scatter in place over `buf` cut into `g.size()` chunks; afterwards chunk `i` of the
/// group member with index `i` holds the full reduction.
fn ring_reduce_scatter<X: Transport, T: Element>(
    x: &mut X,
    t: &mut Tally,
    g: &Group,
    buf: &mut [T],
) -> CommResult<()> {
    let (n, i) = (g.size(), g.index_of(x.my_rank())?);
    let (next, prev) = (g.ranks[(i + 1) % n], g.ranks[(i + n - 1) % n]);
    let len = buf.len();
    for s in 0..n - 1 {
        let send_c = (i + 2 * n - s - 1) % n;
        let recv_c = (i + 2 * n - s - 2) % n;
        x.exchange_post(t, next, &buf[chunk(len, n, send_c)], s as u64, len)?;
        let dst = &mut buf[chunk(len, n, recv_c)];
        x.take(t, prev, s as u64, len, |part: &[T]| {
            dst.iter_mut().zip(part).for_each(|(x, &y)| *x = x.add(y));
            Ok(())
        })?;
    }
    Ok(())
}

/// Ring all-gather in place: member `i` contributes `buf[ranges[i]]`.
fn ring_all_gather<X: Transport, T: Element>(
    x: &mut X,
    t: &mut Tally,
    g: &Group,
    buf: &mut [T],
    ranges: &[std::ops::Range<usize>],
) -> CommResult<()> {
    let (n, i) = (g.size(), g.index_of(x.my_rank())?);
    let (next, prev) = (g.ranks[(i + 1) % n], g.ranks[(i + n - 1) % n]);
    let len = buf.len();
    for s in 0..n - 1 {
        let send_c = (i + n - s) % n;
        let recv_c = (i + 2 * n - s - 1) % n;
        x.exchange_post(t, next, &buf[ranges[send_c].clone()], 1000 + s as u64, len)?;
        let (rank, op, group) = (x.my_rank(), t.op, g.name.clone());
        let dst = &mut buf[ranges[recv_c].clone()];
        x.take(t, prev, 1000 + s as u64, len, |part: &[T]| {
            if part.len() != dst.len() {
                return Err(CommError::Mismatch {
                    op,
                    group,
                    rank,
                    peer: prev,
                    mine: format!("{} elements expected from member {recv_c}", dst.len()),
                    theirs: format!("{} elements", part.len()),
                });
            }
            dst.copy_from_slice(part);
            Ok(())
        })?;
    }
    Ok(())
}

fn gather_impl<X: Transport, T: Element>(
    x: &mut X,
    g: &Group,
    input: &[T],
    counts: &[usize],
    output: &mut [T],
) -> CommResult<()> {
    let mut t = x.begin(g.kind, "all_gather", &g.name);
    let (n, i) = (g.size(), g.index_of(x.my_rank())?);
    if counts.len() != n || counts[i] != input.len() || output.len() != counts.iter().sum::<usize>()
    {
        return Err(CommError::Usage(format!(
            "all_gather on group {}: {} counts for {n} members, input {} (count {}), output {} (sum {})",
            g.name,
            counts.len(),
            input.len(),
            counts.get(i).copied().unwrap_or(0),
            output.len(),
            counts.iter().sum::<usize>()
        )));
    }
    let mut starts = vec![0usize; n + 1];
    for (k, c) in counts.iter().enumerate() {
        starts[k + 1] = starts[k] + c;
    }
    let ranges: Vec<_> = (0..n).map(|k| starts[k]..starts[k + 1]).collect();
    output[ranges[i].clone()].copy_from_slice(input);
    if n > 1 {
        ring_all_gather(x, &mut t, g, output, &ranges)?;
    }
    x.end(t);
    Ok(())
}

impl<X: Transport> Comm for X {
    fn rank(&self) -> usize {
        self.my_rank()
    }
    fn world_size(&self) -> usize {
        self.world()
    }
    fn stats(&self) -> &CommStats {
        self.comm_stats()
    }

    fn all_reduce<T: Element>(&mut self, g: &Group, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        let mut t = self.begin(g.kind, "all_reduce", &g.name);
        let n = g.size();
        let i = g.index_of(self.my_rank())?;
        if n > 1 {
            ring_reduce_scatter(self, &mut t, g, buf)?;
            let len = buf.len();
            if op == ReduceOp::Mean {
                buf[chunk(len, n, i)].iter_mut().for_each(|x| *x = x.div(n));
            }
            let ranges: Vec<_> = (0..n).map(|c| chunk(len, n, c)).collect();
            ring_all_gather(self, &mut t, g, buf, &ranges)?;
        }
        self.end(t);
        Ok(())
    }

    fn reduce_scatter<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        let mut t = self.begin(g.kind, "reduce_scatter", &g.name);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        if input.len() != n * output.len() {
            return Err(CommError::Usage(format!(
                "reduce_scatter on group {}: input has {} elements, expected {n} shards of {}",
                g.name,
                input.len(),
                output.len()
            )));
        }
        // Work on a reused copy of the input: allocating (and faulting in) a fresh one per call costs
        // more than the transfer.
        let mut storage = std::mem::take(self.scratch());
        storage.clear();
        storage.resize(std::mem::size_of_val(input).div_ceil(8), 0);
        // SAFETY: 8-byte aligned storage of at least size_of_val(input) bytes; any bits are a valid `T`.
        let work =
            unsafe { std::slice::from_raw_parts_mut(storage.as_mut_ptr() as *mut T, input.len()) };
        work.copy_from_slice(input);
        let result = if n > 1 {
            ring_reduce_scatter(self, &mut t, g, work)
        } else {
            Ok(())
        };
        output.copy_from_slice(&work[chunk(input.len(), n, i)]);
        *self.scratch() = storage;
        result?;
        if op == ReduceOp::Mean {
            output.iter_mut().for_each(|x| *x = x.div(n));
        }
        self.end(t);
        Ok(())
    }

    fn all_gather<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        output: &mut [T],
    ) -> CommResult<()> {
        let counts = vec![input.len(); g.size()];
        gather_impl(self, g, input, &counts, output)
    }

    fn all_gather_uneven<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> CommResult<()> {
        gather_impl(self, g, input, counts, output)
    }

    fn broadcast<T: Element>(&mut self, g: &Group, buf: &mut [T], root: usize) -> CommResult<()> {
        let mut t = self.begin(g.kind, "broadcast", &g.name);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        if root >= n {
            return Err(CommError::Usage(format!(
                "broadcast on group {}: root index {root} is outside the group of {n}",
                g.name
            )));
        }
        // A chain along the ring starting at the root: every member but the last forwards once.
        let pos = (i + n - root) % n;
        let len = buf.len();
        if pos > 0 {
            self.take(&mut t, g.ranks[(i + n - 1) % n], 0, len, |data: &[T]| {
                buf.copy_from_slice(data);
                Ok(())
            })?;
        }
        if pos + 1 < n {
            self.post(&mut t, g.ranks[(i + 1) % n], buf, 0, len)?;
        }
        self.end(t);
        Ok(())
    }

    fn barrier(&mut self, g: &Group) -> CommResult<()> {
        let mut token = [0u8];
        self.all_reduce(g, &mut token, ReduceOp::Sum)
    }

    fn send<T: Element>(&mut self, to: usize, buf: &[T], tag: u64) -> CommResult<()> {
        if to >= self.world() {
            return Err(CommError::Usage(format!(
                "send: rank {to} is outside the world of {}",
                self.world()
            )));
        }
        let mut t = self.begin("p2p", "send", &format!("p2p[{},{to}]", self.my_rank()));
        self.post(&mut t, to, buf, tag, buf.len())?;
        self.end(t);
        Ok(())
    }

    fn recv<T: Element>(&mut self, from: usize, buf: &mut [T], tag: u64) -> CommResult<()> {
        if from >= self.world() {
            return Err(CommError::Usage(format!(
                "recv: rank {from} is outside the world of {}",
                self.world()
            )));
        }
        // A message is labelled by the sender's operation ("send"); the stats record it as a receive.
        let mut t = self.begin("p2p", "send", &format!("p2p[{from},{}]", self.my_rank()));
        self.take(&mut t, from, tag, buf.len(), |data: &[T]| {
            buf.copy_from_slice(data);
            Ok(())
        })?;
        t.op = "recv";
        self.end(t);
        Ok(())
    }
}

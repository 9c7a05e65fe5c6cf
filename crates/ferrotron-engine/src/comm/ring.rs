//! The collectives, written once as ring algorithms over a point-to-point [`Transport`]: every backend
//! that can post and take messages gets all of [`Comm`] with the same byte counts, the same summation
//! order (so the same bits) and the same accounting. A ring collective is a list of steps (send one
//! range to the next rank, receive one range from the previous, add or copy it); the blocking calls
//! run the list at once, a [`Pending`] operation runs it as its inputs arrive.

use super::flight::{FlightRecord, FlightRecorder};
use super::stats::{CommStats, OpStats};
use super::{Comm, CommError, CommResult, Element, Group, ReduceOp};
use crate::memory::{self, Term};
use std::ops::Range;

/// What one call of an operation did; added to the stats when it ends.
pub(crate) struct Tally {
    pub kind: &'static str,
    pub op: &'static str,
    pub group: String,
    pub s: OpStats,
    /// A started (asynchronous) operation: its sends do not stop the device's clock.
    pub overlapped: bool,
    /// A started operation progresses on its own, as a device's communication engine moves it
    /// while the device computes: the device time at which what it sends next is ready (its start,
    /// then the latest arrival of what it received), and that arrival's transfer time. Backends
    /// that time messages in device time depart its sends from here, not from when the device
    /// next polls it.
    pub ready: f64,
    pub ready_transfer: f64,
    /// Its record in the device's flight recorder.
    pub flight: u64,
}

/// Point-to-point messaging with accounting: what a backend provides.
pub(crate) trait Transport {
    fn my_rank(&self) -> usize;
    /// Device time so far (seconds).
    fn clock(&mut self) -> f64;
    fn world(&self) -> usize;
    fn comm_stats(&self) -> &CommStats;
    /// Brings the device clock up to date with the compute done since the last pause.
    fn resume(&mut self);
    /// Marks the end of communication work: what follows is compute again.
    fn pause(&mut self);
    fn record(&mut self, t: Tally);
    /// Sends `data` to `to` without waiting for the receiver.
    fn post<T: Element>(
        &mut self,
        t: &mut Tally,
        to: usize,
        data: &[T],
        tag: u64,
        total_len: usize,
    ) -> CommResult<()>;
    /// Receives the next message from `from` (waiting up to the timeout), checks it belongs to this
    /// operation (tag, total length, element type) and hands its elements to `consume`.
    fn take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()>;
    /// Like `take`, but returns `Ok(false)` at once if the message has not arrived.
    fn try_take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<bool>;
    /// A started operation's last message is in: the device waits (in device time) until the
    /// operation's progress on its own finished it.
    fn settle(&mut self, t: &mut Tally);
    /// Reusable working storage.
    fn scratch(&mut self) -> &mut Vec<u64>;
    /// The device's flight recorder.
    fn flight(&mut self) -> &mut FlightRecorder;
    fn flight_records(&self) -> Vec<FlightRecord>;

    fn begin(&mut self, kind: &'static str, op: &'static str, group: &str) -> Tally {
        self.resume();
        let flight = self.flight().started(kind, op, group);
        Tally {
            ready: self.clock(),
            ready_transfer: 0.0,
            flight,
            kind,
            op,
            group: group.to_string(),
            s: OpStats {
                calls: 1,
                ..OpStats::default()
            },
            overlapped: false,
        }
    }
    fn end(&mut self, t: Tally) {
        self.pause();
        self.flight().finished(t.flight, t.s.bytes_sent);
        self.record(t);
    }
}

/// What a received message says it is, for [`check_received`]. A backend that carries names says
/// them; one that carries only codes says whether they matched.
pub(crate) struct Received<'a> {
    pub op_matches: bool,
    pub op: &'a str,
    pub tag: u64,
    pub total_len: usize,
    pub elem_matches: bool,
    pub elem: &'a str,
}

/// Checks that a received message belongs to the operation `t` expects (operation and tag, the
/// sender's total buffer length, element type): ranks that disagree get an error naming both.
pub(crate) fn check_received(
    t: &Tally,
    rank: usize,
    from: usize,
    tag: u64,
    total_len: usize,
    elem: &str,
    got: &Received,
) -> CommResult<()> {
    let mismatch = |mine: String, theirs: String| CommError::Mismatch {
        op: t.op,
        group: t.group.clone(),
        rank,
        peer: from,
        mine,
        theirs,
    };
    if !got.op_matches || got.tag != tag {
        return Err(mismatch(
            format!("{} (tag {tag})", t.op),
            format!("{} (tag {})", got.op, got.tag),
        ));
    }
    if got.total_len != total_len {
        return Err(mismatch(
            format!("{total_len} elements"),
            format!("{} elements", got.total_len),
        ));
    }
    if !got.elem_matches {
        return Err(mismatch(
            format!("element type {elem}"),
            format!("element type {}", got.elem),
        ));
    }
    Ok(())
}

/// The element range of chunk `c` when `len` elements are cut into `n` nearly equal chunks.
pub(crate) fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

/// One message of a ring step: send `send` to the next member and/or receive `recv` from the previous
/// one, reducing or copying it in. A ring step's chunk moves as several such segments.
#[derive(Debug, Clone)]
struct Step {
    send: Option<Range<usize>>,
    recv: Option<Range<usize>>,
    /// Sends go to the member this many places on, receives come from as many places back (1: the
    /// ring's neighbours).
    peer: usize,
    /// The ring step this segment belongs to.
    ring: u64,
    tag: u64,
    reduce: bool,
    /// Divide this range by the group size before sending (all-reduce mean, after reduce-scatter).
    divide_first: Option<Range<usize>>,
}

/// Bytes per ring message. A chunk moves in segments of this size, so that what one core packs is
/// still in the shared cache when the next core consumes it.
const SEGMENT_BYTES: usize = 1 << 20;

fn segment<T>(r: &Range<usize>, k: usize) -> Option<Range<usize>> {
    let seg = (SEGMENT_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    let parts = r.len().div_ceil(seg).max(1);
    (k < parts).then(|| r.start + (k * seg).min(r.len())..r.start + ((k + 1) * seg).min(r.len()))
}

/// One ring step as segments. The sent and the received chunk are segmented by their own lengths,
/// which is how the neighbours segment the same chunks.
fn segmented<T>(
    send: Range<usize>,
    recv: Range<usize>,
    ring: u64,
    reduce: bool,
) -> impl Iterator<Item = Step> {
    let seg = (SEGMENT_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    let parts = send
        .len()
        .div_ceil(seg)
        .max(recv.len().div_ceil(seg))
        .max(1);
    (0..parts).map(move |k| Step {
        send: segment::<T>(&send, k),
        recv: segment::<T>(&recv, k),
        peer: 1,
        ring,
        tag: ring * 4096 + k as u64,
        reduce,
        divide_first: None,
    })
}

/// Reduce-scatter steps over `len` elements in `n` chunks: afterwards member `i` holds the full
/// reduction of chunk `i`.
fn reduce_scatter_steps<T>(n: usize, i: usize, len: usize) -> Vec<Step> {
    (0..n.saturating_sub(1))
        .flat_map(|s| {
            segmented::<T>(
                chunk(len, n, (i + 2 * n - s - 1) % n),
                chunk(len, n, (i + 2 * n - s - 2) % n),
                s as u64,
                true,
            )
        })
        .collect()
}

/// All-gather steps: member `k` contributes `ranges[k]`.
fn all_gather_steps<T>(n: usize, i: usize, ranges: &[Range<usize>]) -> Vec<Step> {
    (0..n.saturating_sub(1))
        .flat_map(|s| {
            segmented::<T>(
                ranges[(i + n - s) % n].clone(),
                ranges[(i + 2 * n - s - 1) % n].clone(),
                1000 + s as u64,
                false,
            )
        })
        .collect()
}

/// All-gather steps that need no forwarding: member `i` sends its own range straight to every
/// other member (member `i + s` in step `s`) and receives each member's range from it, all posted
/// at once. The bytes each member sends are the ring's ((n−1)/n of the result), but nothing waits
/// on a neighbour's progress, so a started gather completes while its device computes, whatever n.
fn direct_all_gather_steps<T>(n: usize, i: usize, ranges: &[Range<usize>]) -> Vec<Step> {
    (1..n)
        .flat_map(|s| {
            segmented::<T>(
                ranges[i].clone(),
                ranges[(i + n - s) % n].clone(),
                3000,
                false,
            )
            .map(move |st| Step { peer: s, ..st })
        })
        .collect()
}

fn all_reduce_steps<T>(n: usize, i: usize, len: usize, op: ReduceOp) -> Vec<Step> {
    let mut steps = reduce_scatter_steps::<T>(n, i, len);
    let ranges: Vec<_> = (0..n).map(|c| chunk(len, n, c)).collect();
    let mut ag = all_gather_steps::<T>(n, i, &ranges);
    // A group of one has no steps, and its mean is the value itself.
    if let (ReduceOp::Mean, Some(first)) = (op, ag.first_mut()) {
        first.divide_first = Some(chunk(len, n, i));
    }
    steps.extend(ag);
    steps
}

/// The send half of a step.
fn post_step<X: Transport, T: Element>(
    x: &mut X,
    t: &mut Tally,
    g: &Group,
    st: &Step,
    buf: &mut [T],
) -> CommResult<()> {
    let (n, i) = (g.size(), g.index_of(x.my_rank())?);
    if let Some(r) = &st.divide_first {
        buf[r.clone()].iter_mut().for_each(|v| *v = v.div(n));
    }
    if let Some(send) = &st.send {
        x.post(
            t,
            g.ranks[(i + st.peer) % n],
            &buf[send.clone()],
            st.tag,
            buf.len(),
        )?;
    }
    Ok(())
}

/// The receive half of a step; `Ok(false)` if not `blocking` and the message has not arrived.
fn recv_step<X: Transport, T: Element>(
    x: &mut X,
    t: &mut Tally,
    g: &Group,
    st: &Step,
    buf: &mut [T],
    blocking: bool,
) -> CommResult<bool> {
    let Some(recv) = &st.recv else {
        return Ok(true);
    };
    let (n, i) = (g.size(), g.index_of(x.my_rank())?);
    let prev = g.ranks[(i + n - st.peer) % n];
    let len = buf.len();
    let (rank, op, group) = (x.my_rank(), t.op, g.name.clone());
    let dst = &mut buf[recv.clone()];
    let consume = |part: &[T]| {
        if part.len() != dst.len() {
            return Err(CommError::Mismatch {
                op,
                group,
                rank,
                peer: prev,
                mine: format!("{} elements in this step", dst.len()),
                theirs: format!("{} elements", part.len()),
            });
        }
        if st.reduce {
            dst.iter_mut().zip(part).for_each(|(a, &b)| *a = a.add(b));
        } else {
            dst.copy_from_slice(part);
        }
        Ok(())
    };
    if blocking {
        x.take(t, prev, st.tag, len, consume)?;
        Ok(true)
    } else {
        x.try_take(t, prev, st.tag, len, consume)
    }
}

/// Runs every step at once, each segment sent and then received, so it is consumed while cached.
fn run_all<X: Transport, T: Element>(
    x: &mut X,
    t: &mut Tally,
    g: &Group,
    steps: &[Step],
    buf: &mut [T],
) -> CommResult<()> {
    for st in steps {
        post_step(x, t, g, st, buf)?;
        recv_step(x, t, g, st, buf, true)?;
    }
    Ok(())
}

/// A collective that has started and finishes as its messages arrive: call [`Comm::test`] between
/// pieces of compute to move it on, and [`Comm::wait`] for the result. While it is pending, issue no
/// other operation on the same group (messages between two ranks arrive in order).
pub struct Pending<T: Element> {
    group: Group,
    buf: Vec<T>,
    steps: Vec<Step>,
    /// Steps received so far, and steps whose send half has been posted.
    step: usize,
    posted: usize,
    tally: Option<Tally>,
    /// The part of `buf` that is the result (the own shard for reduce-scatter).
    result: Range<usize>,
    divide_result: bool,
}

impl<T: Element> Pending<T> {
    pub fn is_done(&self) -> bool {
        self.step == self.steps.len()
    }
}

fn start<X: Transport, T: Element>(
    x: &mut X,
    g: &Group,
    op: &'static str,
    buf: Vec<T>,
    steps: Vec<Step>,
    result: Range<usize>,
    divide_result: bool,
) -> CommResult<Pending<T>> {
    g.index_of(x.my_rank())?;
    let mut t = x.begin(g.kind, op, &g.name);
    t.overlapped = true;
    let mut p = Pending {
        group: g.clone(),
        buf,
        steps,
        step: 0,
        posted: 0,
        tally: Some(t),
        result,
        divide_result,
    };
    advance(x, &mut p, false)?;
    x.pause();
    Ok(p)
}

/// Runs the pending steps whose inputs are here (all of them if `blocking`). Every segment of the
/// current ring step is sent at once, so the whole chunk travels while the device computes.
fn advance<X: Transport, T: Element>(
    x: &mut X,
    p: &mut Pending<T>,
    blocking: bool,
) -> CommResult<bool> {
    let mut t = p
        .tally
        .take()
        .expect("a pending operation has its tally until it completes");
    let result = (|| loop {
        if p.step == p.steps.len() {
            return Ok(true);
        }
        let ring = p.steps[p.step].ring;
        while p.posted < p.steps.len() && p.steps[p.posted].ring == ring {
            let st = p.steps[p.posted].clone();
            post_step(x, &mut t, &p.group, &st, &mut p.buf)?;
            p.posted += 1;
        }
        let st = p.steps[p.step].clone();
        if !recv_step(x, &mut t, &p.group, &st, &mut p.buf, blocking)? {
            return Ok(false);
        }
        p.step += 1;
    })();
    p.tally = Some(t);
    result
}

impl<X: Transport> Comm for X {
    fn device_time(&mut self) -> f64 {
        self.clock()
    }

    fn rank(&self) -> usize {
        self.my_rank()
    }
    fn world_size(&self) -> usize {
        self.world()
    }
    fn stats(&self) -> &CommStats {
        self.comm_stats()
    }

    fn flight_records(&self) -> Vec<FlightRecord> {
        Transport::flight_records(self)
    }

    fn all_reduce<T: Element>(&mut self, g: &Group, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        let _buffers = memory::scope(Term::CommBuffers);
        let mut t = self.begin(g.kind, "all_reduce", &g.name);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        run_all(
            self,
            &mut t,
            g,
            &all_reduce_steps::<T>(n, i, buf.len(), op),
            buf,
        )?;
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
        let _buffers = memory::scope(Term::CommBuffers);
        let mut t = self.begin(g.kind, "reduce_scatter", &g.name);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        check_shards(g, input.len(), output.len())?;
        // Work on a reused copy of the input: allocating (and faulting in) a fresh one per call costs
        // more than the transfer.
        // Grown to exactly the largest input (not by doubling): the copy is a communication buffer
        // that stays, and the planner prices it as the largest input reduce-scattered.
        let mut storage = std::mem::take(self.scratch());
        storage.clear();
        let words = std::mem::size_of_val(input).div_ceil(8);
        storage.reserve_exact(words);
        storage.resize(words, 0);
        // SAFETY: 8-byte aligned storage of at least size_of_val(input) bytes; any bits are a valid `T`.
        let work =
            unsafe { std::slice::from_raw_parts_mut(storage.as_mut_ptr() as *mut T, input.len()) };
        work.copy_from_slice(input);
        let result = run_all(
            self,
            &mut t,
            g,
            &reduce_scatter_steps::<T>(n, i, input.len()),
            work,
        );
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
        let _buffers = memory::scope(Term::CommBuffers);
        let counts = vec![input.len(); g.size()];
        self.all_gather_uneven(g, input, &counts, output)
    }

    fn all_gather_uneven<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> CommResult<()> {
        let _buffers = memory::scope(Term::CommBuffers);
        let mut t = self.begin(g.kind, "all_gather", &g.name);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        let ranges = gather_ranges(g, i, input.len(), counts, output.len())?;
        output[ranges[i].clone()].copy_from_slice(input);
        run_all(
            self,
            &mut t,
            g,
            &all_gather_steps::<T>(n, i, &ranges),
            output,
        )?;
        self.end(t);
        Ok(())
    }

    fn broadcast<T: Element>(&mut self, g: &Group, buf: &mut [T], root: usize) -> CommResult<()> {
        let _buffers = memory::scope(Term::CommBuffers);
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
        let _buffers = memory::scope(Term::CommBuffers);
        let mut token = [0u8];
        self.all_reduce(g, &mut token, ReduceOp::Sum)
    }

    fn send<T: Element>(&mut self, to: usize, buf: &[T], tag: u64) -> CommResult<()> {
        point_to_point_send(self, "p2p", to, buf, tag, false)
    }

    fn recv<T: Element>(&mut self, from: usize, buf: &mut [T], tag: u64) -> CommResult<()> {
        self.recv_as("p2p", from, buf, tag)
    }

    fn send_overlapped<T: Element>(
        &mut self,
        kind: &'static str,
        to: usize,
        buf: &[T],
        tag: u64,
    ) -> CommResult<()> {
        point_to_point_send(self, kind, to, buf, tag, true)
    }

    fn recv_as<T: Element>(
        &mut self,
        kind: &'static str,
        from: usize,
        buf: &mut [T],
        tag: u64,
    ) -> CommResult<()> {
        let _buffers = memory::scope(Term::CommBuffers);
        if from >= self.world() {
            return Err(CommError::Usage(format!(
                "recv: rank {from} is outside the world of {}",
                self.world()
            )));
        }
        // A message is labelled by the sender's operation ("send"); the stats record it as a receive.
        let mut t = self.begin(kind, "send", &format!("p2p[{from},{}]", self.my_rank()));
        self.take(&mut t, from, tag, buf.len(), |data: &[T]| {
            buf.copy_from_slice(data);
            Ok(())
        })?;
        t.op = "recv";
        self.end(t);
        Ok(())
    }

    fn start_all_reduce<T: Element>(
        &mut self,
        g: &Group,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<T>> {
        let _buffers = memory::scope(Term::CommBuffers);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        let steps = all_reduce_steps::<T>(n, i, buf.len(), op);
        let len = buf.len();
        start(self, g, "all_reduce", buf, steps, 0..len, false)
    }

    fn start_reduce_scatter<T: Element>(
        &mut self,
        g: &Group,
        input: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<T>> {
        let _buffers = memory::scope(Term::CommBuffers);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        if !input.len().is_multiple_of(n) {
            return Err(CommError::Usage(format!(
                "reduce_scatter on group {}: {} elements do not split into {n} equal shards",
                g.name,
                input.len()
            )));
        }
        let steps = reduce_scatter_steps::<T>(n, i, input.len());
        let own = chunk(input.len(), n, i);
        start(
            self,
            g,
            "reduce_scatter",
            input,
            steps,
            own,
            op == ReduceOp::Mean,
        )
    }

    fn start_all_gather<T: Element>(&mut self, g: &Group, input: &[T]) -> CommResult<Pending<T>> {
        let _buffers = memory::scope(Term::CommBuffers);
        let (n, i) = (g.size(), g.index_of(self.my_rank())?);
        let counts = vec![input.len(); n];
        let ranges = gather_ranges(g, i, input.len(), &counts, n * input.len())?;
        let mut buf = vec![T::default(); n * input.len()];
        buf[ranges[i].clone()].copy_from_slice(input);
        let steps = direct_all_gather_steps::<T>(n, i, &ranges);
        let len = buf.len();
        start(self, g, "all_gather", buf, steps, 0..len, false)
    }

    fn test<T: Element>(&mut self, p: &mut Pending<T>) -> CommResult<bool> {
        let _buffers = memory::scope(Term::CommBuffers);
        self.resume();
        let done = advance(self, p, false);
        self.pause();
        done
    }

    fn wait<T: Element>(&mut self, mut p: Pending<T>) -> CommResult<Vec<T>> {
        let _buffers = memory::scope(Term::CommBuffers);
        self.resume();
        advance(self, &mut p, true)?;
        let mut t = p.tally.take().expect("tally present until completion");
        self.settle(&mut t);
        self.end(t);
        let n = p.group.size();
        let mut out = p.buf;
        if p.result != (0..out.len()) {
            out = out[p.result.clone()].to_vec();
        }
        if p.divide_result {
            out.iter_mut().for_each(|x| *x = x.div(n));
        }
        Ok(out)
    }
}

fn check_shards(g: &Group, input: usize, output: usize) -> CommResult<()> {
    if input != g.size() * output {
        return Err(CommError::Usage(format!(
            "reduce_scatter on group {}: input has {input} elements, expected {} shards of {output}",
            g.name,
            g.size()
        )));
    }
    Ok(())
}

/// The output range of every member's shard, after checking the counts against the buffers.
fn gather_ranges(
    g: &Group,
    i: usize,
    input: usize,
    counts: &[usize],
    output: usize,
) -> CommResult<Vec<Range<usize>>> {
    let n = g.size();
    if counts.len() != n || counts[i] != input || output != counts.iter().sum::<usize>() {
        return Err(CommError::Usage(format!(
            "all_gather on group {}: {} counts for {n} members, input {input} (count {}), output {output} (sum {})",
            g.name,
            counts.len(),
            counts.get(i).copied().unwrap_or(0),
            counts.iter().sum::<usize>()
        )));
    }
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}

/// A point-to-point send counted under `kind`; `overlapped`: the device goes on while it travels.
fn point_to_point_send<X: Transport, T: Element>(
    x: &mut X,
    kind: &'static str,
    to: usize,
    buf: &[T],
    tag: u64,
    overlapped: bool,
) -> CommResult<()> {
    let _buffers = memory::scope(Term::CommBuffers);
    if to >= x.world() {
        return Err(CommError::Usage(format!(
            "send: rank {to} is outside the world of {}",
            x.world()
        )));
    }
    let mut t = x.begin(kind, "send", &format!("p2p[{},{to}]", x.my_rank()));
    t.overlapped = overlapped;
    x.post(&mut t, to, buf, tag, buf.len())?;
    x.end(t);
    Ok(())
}

//! The threads backend: every device is a thread of one process and data moves through shared memory
//! (a channel per ordered pair of ranks, message buffers recycled). Collectives are ring algorithms
//! over point-to-point transfers, so each device sends the textbook byte count. Each device keeps a
//! virtual clock: its thread's CPU time while computing, and on every receive the later of its own
//! clock and the message's arrival (sender's clock + the modelled transfer cost), so timelines mean on
//! 2 cores what they would on N real devices.

use super::stats::{CommStats, OpStats};
use super::{Comm, CommError, CommResult, Element, Group, ReduceOp, DEFAULT_TIMEOUT};
use ferrotron_core::topology::Link;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A simulated interconnect: what each transfer costs on its link class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    pub intra: Link,
    pub inter: Link,
    pub devices_per_node: usize,
}

impl LinkModel {
    /// Seconds to move `bytes` from `src` to `dst`.
    pub fn cost(&self, bytes: usize, src: usize, dst: usize) -> f64 {
        let link = if src / self.devices_per_node == dst / self.devices_per_node {
            self.intra
        } else {
            self.inter
        };
        link.latency_s + bytes as f64 / link.bandwidth_bytes_per_s
    }
}

struct Msg {
    tag: u64,
    op: &'static str,
    /// Elements in the sender's whole buffer for this operation (checked against the receiver's).
    total_len: usize,
    /// The elements as raw bytes in 8-byte words: a recycled buffer (see [`Pool`]).
    payload: Vec<u64>,
    elem: &'static str,
    len: usize,
    bytes: usize,
    /// Sender's device clock when the transfer started, and its modelled cost.
    depart: f64,
    cost: f64,
}

/// Message buffers a receiver hands back for its senders to reuse, so steady-state traffic allocates
/// (and page-faults) nothing.
type Pool = Arc<Mutex<Vec<Vec<u64>>>>;

/// Copies `data` into a buffer from `pool` (or a new one).
fn pack<T: Element>(pool: &Pool, data: &[T]) -> Vec<u64> {
    let bytes = std::mem::size_of_val(data);
    let words = bytes.div_ceil(8);
    let mut v = {
        let mut free = pool.lock().expect("pool lock");
        match free.iter().position(|b| b.capacity() >= words) {
            Some(i) => free.swap_remove(i),
            None => Vec::new(),
        }
    };
    v.clear();
    v.reserve(words);
    // SAFETY: `Element` values are plain bytes; we write `bytes` bytes into the reserved capacity,
    // zero the tail of the last word, and only then set the length.
    unsafe {
        let dst = v.as_mut_ptr() as *mut u8;
        std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, dst, bytes);
        std::ptr::write_bytes(dst.add(bytes), 0, words * 8 - bytes);
        v.set_len(words);
    }
    v
}

/// Views a received buffer as `len` elements of `T`.
fn view<T: Element>(payload: &[u64], len: usize) -> &[T] {
    assert!(
        len * std::mem::size_of::<T>() <= payload.len() * 8,
        "message shorter than its length"
    );
    // SAFETY: the storage is 8-byte aligned, at least len·size_of::<T>() bytes long, and any bit
    // pattern is a valid `T` (`Element`'s contract).
    unsafe { std::slice::from_raw_parts(payload.as_ptr() as *const T, len) }
}

/// Builds the communicators of a world of threads.
pub struct ThreadWorld {
    pub world: usize,
    pub timeout: Duration,
    pub link: Option<LinkModel>,
}

impl ThreadWorld {
    pub fn new(world: usize) -> Self {
        Self {
            world,
            timeout: DEFAULT_TIMEOUT,
            link: None,
        }
    }
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn link(mut self, link: LinkModel) -> Self {
        self.link = Some(link);
        self
    }

    /// One communicator per rank, wired to each other.
    pub fn build(&self) -> Vec<ThreadComm> {
        let n = self.world;
        let mut to: Vec<Vec<Sender<Msg>>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
        let mut from: Vec<Vec<Option<Receiver<Msg>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (src, senders) in to.iter_mut().enumerate() {
            for receivers in from.iter_mut() {
                let (tx, rx) = channel();
                senders.push(tx);
                receivers[src] = Some(rx);
            }
        }
        let pools: Vec<Pool> = (0..n).map(|_| Pool::default()).collect();
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| ThreadComm {
                rank,
                world: n,
                to,
                from: from.into_iter().map(|r| r.expect("wired")).collect(),
                pools: pools.clone(),
                timeout: self.timeout,
                link: self.link,
                clock: 0.0,
                cpu_mark: thread_cpu_time(),
                wall_start: Instant::now(),
                stats: CommStats {
                    rank,
                    ..CommStats::default()
                },
                scratch: Vec::new(),
            })
            .collect()
    }

    /// Runs `f` on every rank, each on its own thread, and returns the results in rank order. A rank
    /// that panics is reported as an error naming it.
    pub fn run<R: Send>(&self, f: impl Fn(&mut ThreadComm) -> R + Sync) -> Vec<CommResult<R>> {
        let comms = self.build();
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let f = &f;
                    s.spawn(move || {
                        // Start the device clock on the device's own thread.
                        c.cpu_mark = thread_cpu_time();
                        c.wall_start = Instant::now();
                        f(&mut c)
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join()
                        .map_err(|_| CommError::Usage(format!("rank {r} panicked")))
                })
                .collect()
        })
    }
}

/// This thread's CPU time in seconds.
fn thread_cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// One device's endpoint in a [`ThreadWorld`].
pub struct ThreadComm {
    rank: usize,
    world: usize,
    to: Vec<Sender<Msg>>,
    from: Vec<Receiver<Msg>>,
    /// `pools[r]`: free buffers for messages addressed to rank r.
    pools: Vec<Pool>,
    timeout: Duration,
    link: Option<LinkModel>,
    clock: f64,
    cpu_mark: f64,
    wall_start: Instant,
    stats: CommStats,
    /// Reused working storage (reduce-scatter's copy of its input).
    scratch: Vec<u64>,
}

/// The element range of chunk `c` when `len` elements are cut into `n` nearly equal chunks.
fn chunk(len: usize, n: usize, c: usize) -> std::ops::Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

/// What one call of an operation did, added to the stats when it ends.
struct Tally {
    kind: &'static str,
    op: &'static str,
    group: String,
    s: OpStats,
}

impl ThreadComm {
    /// Device time so far (seconds).
    pub fn device_time(&mut self) -> f64 {
        self.accrue_compute();
        self.clock
    }

    /// Adds the CPU time spent computing since the last communication to the device clock.
    fn accrue_compute(&mut self) {
        let now = thread_cpu_time();
        let dt = (now - self.cpu_mark).max(0.0);
        self.clock += dt;
        self.stats.compute_time_s += dt;
        self.cpu_mark = now;
    }

    fn begin(&mut self, kind: &'static str, op: &'static str, group: &str) -> Tally {
        self.accrue_compute();
        Tally {
            kind,
            op,
            group: group.to_string(),
            s: OpStats {
                calls: 1,
                ..OpStats::default()
            },
        }
    }

    fn end(&mut self, t: Tally) {
        // The copies and additions a collective does are not counted as compute: the link model
        // (or nothing, without one) is its cost.
        self.cpu_mark = thread_cpu_time();
        self.stats.record(t.kind, t.op, t.s);
        self.stats.device_time_s = self.clock;
        self.stats.wall_time_s = self.wall_start.elapsed().as_secs_f64();
    }

    fn post<T: Element>(
        &mut self,
        t: &mut Tally,
        to: usize,
        data: &[T],
        tag: u64,
        total_len: usize,
    ) -> CommResult<()> {
        let bytes = std::mem::size_of_val(data);
        let cost = self.link.map_or(0.0, |l| l.cost(bytes, self.rank, to));
        let payload = pack(&self.pools[to], data);
        let msg = Msg {
            tag,
            op: t.op,
            total_len,
            payload,
            elem: T::NAME,
            len: data.len(),
            bytes,
            depart: self.clock,
            cost,
        };
        // The sender is busy for the transfer's duration.
        self.clock += cost;
        t.s.time_transfer_s += cost;
        t.s.bytes_sent += bytes as u64;
        self.to[to].send(msg).map_err(|_| CommError::PeerGone {
            op: t.op,
            group: t.group.clone(),
            rank: self.rank,
            peer: to,
        })
    }

    /// Receives the next message from `from`, checks that it belongs to this operation, advances the
    /// clock, and hands its elements to `consume`; the buffer then goes back to this rank's pool.
    fn take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()> {
        let msg = match self.from[from].recv_timeout(self.timeout) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                return Err(CommError::Timeout {
                    op: t.op,
                    group: t.group.clone(),
                    rank: self.rank,
                    peer: from,
                    waited: self.timeout,
                })
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(CommError::PeerGone {
                    op: t.op,
                    group: t.group.clone(),
                    rank: self.rank,
                    peer: from,
                })
            }
        };
        let mismatch = |mine: String, theirs: String| CommError::Mismatch {
            op: t.op,
            group: t.group.clone(),
            rank: self.rank,
            peer: from,
            mine,
            theirs,
        };
        if msg.op != t.op || msg.tag != tag {
            return Err(mismatch(
                format!("{} (tag {tag})", t.op),
                format!("{} (tag {})", msg.op, msg.tag),
            ));
        }
        if msg.total_len != total_len {
            return Err(mismatch(
                format!("{total_len} elements"),
                format!("{} elements", msg.total_len),
            ));
        }
        if msg.elem != T::NAME {
            return Err(mismatch(
                format!("element type {}", T::NAME),
                format!("element type {}", msg.elem),
            ));
        }
        let arrival = msg.depart + msg.cost;
        if arrival > self.clock {
            let wait = arrival - self.clock;
            let moving = wait.min(msg.cost);
            t.s.time_transfer_s += moving;
            t.s.time_blocked_s += wait - moving;
            self.clock = arrival;
        }
        t.s.bytes_received += msg.bytes as u64;
        let result = consume(view::<T>(&msg.payload, msg.len));
        self.pools[self.rank]
            .lock()
            .expect("pool lock")
            .push(msg.payload);
        result
    }

    /// Ring reduce-scatter in place over `buf` cut into `g.size()` chunks; afterwards chunk `i` of the
    /// group member with index `i` holds the full reduction.
    fn ring_reduce_scatter<T: Element>(
        &mut self,
        t: &mut Tally,
        g: &Group,
        buf: &mut [T],
    ) -> CommResult<()> {
        let (n, i) = (g.size(), g.index_of(self.rank)?);
        let (next, prev) = (g.ranks[(i + 1) % n], g.ranks[(i + n - 1) % n]);
        let len = buf.len();
        for s in 0..n - 1 {
            let send_c = (i + 2 * n - s - 1) % n;
            let recv_c = (i + 2 * n - s - 2) % n;
            self.post(t, next, &buf[chunk(len, n, send_c)], s as u64, len)?;
            let dst = &mut buf[chunk(len, n, recv_c)];
            self.take(t, prev, s as u64, len, |part: &[T]| {
                dst.iter_mut().zip(part).for_each(|(x, &y)| *x = x.add(y));
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Ring all-gather in place: member `i` contributes `buf[ranges[i]]`.
    fn ring_all_gather<T: Element>(
        &mut self,
        t: &mut Tally,
        g: &Group,
        buf: &mut [T],
        ranges: &[std::ops::Range<usize>],
    ) -> CommResult<()> {
        let (n, i) = (g.size(), g.index_of(self.rank)?);
        let (next, prev) = (g.ranks[(i + 1) % n], g.ranks[(i + n - 1) % n]);
        let len = buf.len();
        for s in 0..n - 1 {
            let send_c = (i + n - s) % n;
            let recv_c = (i + 2 * n - s - 1) % n;
            self.post(t, next, &buf[ranges[send_c].clone()], 1000 + s as u64, len)?;
            let (rank, op, group) = (self.rank, t.op, g.name.clone());
            let dst = &mut buf[ranges[recv_c].clone()];
            self.take(t, prev, 1000 + s as u64, len, |part: &[T]| {
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

    fn gather_impl<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> CommResult<()> {
        let mut t = self.begin(g.kind, "all_gather", &g.name);
        let (n, i) = (g.size(), g.index_of(self.rank)?);
        if counts.len() != n
            || counts[i] != input.len()
            || output.len() != counts.iter().sum::<usize>()
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
            self.ring_all_gather(&mut t, g, output, &ranges)?;
        }
        self.end(t);
        Ok(())
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn all_reduce<T: Element>(&mut self, g: &Group, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        let mut t = self.begin(g.kind, "all_reduce", &g.name);
        let n = g.size();
        let i = g.index_of(self.rank)?;
        if n > 1 {
            self.ring_reduce_scatter(&mut t, g, buf)?;
            let len = buf.len();
            if op == ReduceOp::Mean {
                buf[chunk(len, n, i)].iter_mut().for_each(|x| *x = x.div(n));
            }
            let ranges: Vec<_> = (0..n).map(|c| chunk(len, n, c)).collect();
            self.ring_all_gather(&mut t, g, buf, &ranges)?;
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
        let (n, i) = (g.size(), g.index_of(self.rank)?);
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
        let mut storage = std::mem::take(&mut self.scratch);
        storage.clear();
        storage.resize(std::mem::size_of_val(input).div_ceil(8), 0);
        // SAFETY: 8-byte aligned storage of at least size_of_val(input) bytes; any bits are a valid `T`.
        let work =
            unsafe { std::slice::from_raw_parts_mut(storage.as_mut_ptr() as *mut T, input.len()) };
        work.copy_from_slice(input);
        let result = if n > 1 {
            self.ring_reduce_scatter(&mut t, g, work)
        } else {
            Ok(())
        };
        output.copy_from_slice(&work[chunk(input.len(), n, i)]);
        self.scratch = storage;
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
        self.gather_impl(g, input, &counts, output)
    }

    fn all_gather_uneven<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> CommResult<()> {
        self.gather_impl(g, input, counts, output)
    }

    fn broadcast<T: Element>(&mut self, g: &Group, buf: &mut [T], root: usize) -> CommResult<()> {
        let mut t = self.begin(g.kind, "broadcast", &g.name);
        let (n, i) = (g.size(), g.index_of(self.rank)?);
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
        if to >= self.world {
            return Err(CommError::Usage(format!(
                "send: rank {to} is outside the world of {}",
                self.world
            )));
        }
        let mut t = self.begin("p2p", "send", &format!("p2p[{},{to}]", self.rank));
        self.post(&mut t, to, buf, tag, buf.len())?;
        self.end(t);
        Ok(())
    }

    fn recv<T: Element>(&mut self, from: usize, buf: &mut [T], tag: u64) -> CommResult<()> {
        if from >= self.world {
            return Err(CommError::Usage(format!(
                "recv: rank {from} is outside the world of {}",
                self.world
            )));
        }
        // A message is labelled by the sender's operation ("send"); the stats record it as a receive.
        let mut t = self.begin("p2p", "send", &format!("p2p[{from},{}]", self.rank));
        self.take(&mut t, from, tag, buf.len(), |data: &[T]| {
            buf.copy_from_slice(data);
            Ok(())
        })?;
        t.op = "recv";
        self.end(t);
        Ok(())
    }
}

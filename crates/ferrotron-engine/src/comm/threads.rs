//! The threads backend: every device is a thread of one process and data moves through shared memory
//! (a channel per ordered pair of ranks, message buffers recycled). Collectives are ring algorithms
//! over point-to-point transfers, so each device sends the textbook byte count. Each device keeps a
//! virtual clock: its thread's CPU time while computing, and on every receive the later of its own
//! clock and the message's arrival (sender's clock + the modelled transfer cost), so timelines mean on
//! 2 cores what they would on N real devices. A started collective moves on its own, as a device's
//! communication engine moves it beside its compute: each send departs when its data is in (the
//! start, or the arrival it forwards), and the device waits only for what is still in flight when
//! it needs the result.

use super::clock::{ClockSource, DeviceClock};
use super::ring::{check_received, Received, Tally, Transport};
use super::stats::CommStats;
use super::{CommError, CommResult, Element, DEFAULT_TIMEOUT};
use ferrotron_core::topology::Link;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A simulated interconnect: what each transfer costs on its link class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    pub intra: Link,
    pub inter: Link,
    pub devices_per_node: usize,
}

/// Whether a receive (point-to-point `p2p` with `tag`, or a collective's) must leave message `m`
/// for another: a point-to-point receive takes only its tag's message, a collective only its own.
fn not_for_this(p2p: bool, tag: u64, m: &Msg) -> bool {
    if p2p {
        !(m.op == "send" && m.tag == tag)
    } else {
        m.op == "send"
    }
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

/// Copies `data` into a buffer from `pool` (the smallest that holds it), or a new one. When none
/// holds it, the pool's largest is freed first: a buffer too small for the messages now passing
/// would only linger. Message buffers, pooled or carrying a message, are the link's, no device's
/// (`memory::on_the_link`): allocated there, and never charged to a device.
fn pack<T: Element>(pool: &Pool, data: &[T]) -> Vec<u64> {
    let bytes = std::mem::size_of_val(data);
    let words = bytes.div_ceil(8);
    let _link = crate::memory::on_the_link();
    let mut v = {
        let mut free = pool.lock().expect("pool lock");
        let fits = (0..free.len())
            .filter(|&i| free[i].capacity() >= words)
            .min_by_key(|&i| free[i].capacity());
        match fits {
            Some(i) => free.swap_remove(i),
            None => {
                if let Some(i) = (0..free.len()).max_by_key(|&i| free[i].capacity()) {
                    drop(free.swap_remove(i));
                }
                Vec::new()
            }
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
    pub clock: ClockSource,
}

impl ThreadWorld {
    /// The most devices one process runs as threads: each is a thread with a channel to every
    /// other, so more is work that grows with the square of the count; more belongs under MPI.
    pub const MAX_DEVICES: usize = 256;

    pub fn new(world: usize) -> Self {
        Self {
            world,
            timeout: DEFAULT_TIMEOUT,
            link: None,
            clock: ClockSource::ThreadCpu,
        }
    }
    /// How the devices' compute time is measured (their thread's CPU time unless a device computes
    /// on several threads).
    pub fn clock(mut self, source: ClockSource) -> Self {
        self.clock = source;
        self
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
                clock: DeviceClock::start(self.clock),
                link_free: 0.0,
                held: (0..n).map(|_| Vec::new()).collect(),
                stats: CommStats {
                    rank,
                    ..CommStats::default()
                },
                scratch: Vec::new(),
                flight: Default::default(),
            })
            .collect()
    }

    /// Runs `f` on every rank, each on its own thread, and returns the results in rank order. A rank
    /// that panics is reported as an error naming it. A world over [`Self::MAX_DEVICES`] starts no
    /// thread and returns one error.
    pub fn run<R: Send>(&self, f: impl Fn(&mut ThreadComm) -> R + Sync) -> Vec<CommResult<R>> {
        if self.world > Self::MAX_DEVICES {
            // Refused before any thread starts: one error stands for every rank.
            return vec![Err(CommError::Usage(format!(
                "{} devices as threads of one process: at most {} (run more under mpirun with --backend mpi)",
                self.world,
                Self::MAX_DEVICES
            )))];
        }
        let comms = self.build();
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let f = &f;
                    s.spawn(move || {
                        // Start the device clock on the device's own thread.
                        c.clock = DeviceClock::start(self.clock);
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
    clock: DeviceClock,
    /// Device time at which this device's outgoing link is free again.
    link_free: f64,
    /// Per source: point-to-point messages that arrived before the receive that wants them (matched
    /// by tag, as MPI matches).
    held: Vec<Vec<Msg>>,
    stats: CommStats,
    /// Reused working storage (reduce-scatter's copy of its input).
    scratch: Vec<u64>,
    flight: super::flight::FlightRecorder,
}

impl ThreadComm {
    /// Device time so far (seconds).
    pub fn device_time(&mut self) -> f64 {
        self.clock.accrue(&mut self.stats);
        self.clock.now
    }

    /// Checks that `msg` belongs to this operation, advances the clock to its arrival, hands its
    /// elements to `consume`, and returns its buffer to this rank's pool.
    fn accept<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        msg: Msg,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()> {
        let got = Received {
            op_matches: msg.op == t.op,
            op: msg.op,
            tag: msg.tag,
            total_len: msg.total_len,
            elem_matches: msg.elem == T::NAME,
            elem: msg.elem,
        };
        check_received(t, self.rank, from, tag, total_len, T::NAME, &got)?;
        let arrival = msg.depart + msg.cost;
        if t.overlapped {
            // A started operation's message is taken in by the operation, not by the device:
            // its next sends leave from here, and the device waits only when it completes.
            if arrival > t.ready {
                (t.ready, t.ready_transfer) = (arrival, msg.cost);
            }
        } else {
            // Waiting for the arrival: the transfer's own duration is moving data, the rest is
            // blocked.
            let wait = self.clock.wait_until(arrival);
            let moving = wait.min(msg.cost);
            t.s.time_transfer_s += moving;
            t.s.time_blocked_s += wait - moving;
        }
        t.s.bytes_received += msg.bytes as u64;
        let result = consume(view::<T>(&msg.payload, msg.len));
        // Back to this receiver's pool, still the link's (no device's) until a sender fills it.
        self.pools[self.rank]
            .lock()
            .expect("pool lock")
            .push(msg.payload);
        result
    }
}

impl Transport for ThreadComm {
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
        // The link is a resource of its own: a transfer starts when both its data and the link are
        // ready. A blocking send holds the device until the transfer is done; a started
        // (overlapped) operation's sends leave the device computing, and leave when the operation
        // has their data (its start, or the arrival they forward), however late the device polls.
        let ready = if t.overlapped {
            t.ready
        } else {
            self.clock.now
        };
        let depart = ready.max(self.link_free);
        self.link_free = depart + cost;
        let msg = Msg {
            tag,
            op: t.op,
            total_len,
            payload,
            elem: T::NAME,
            len: data.len(),
            bytes,
            depart,
            cost,
        };
        if !t.overlapped {
            t.s.time_transfer_s += self.clock.wait_until(self.link_free);
        }
        t.s.bytes_sent += bytes as u64;
        self.to[to].send(msg).map_err(|_| CommError::PeerGone {
            op: t.op,
            group: t.group.clone(),
            rank: self.rank,
            peer: to,
        })
    }
    fn take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()> {
        // Point-to-point receives match by tag: a point-to-point message for another receive (a
        // later one, or one after the collective this receive is part of) waits in `held`, and so
        // does a collective's message that arrives first (an overlapped reduction between the same
        // two devices, as context parallelism's ring runs beside the replicas' gradient
        // reduction). A collective takes its messages in order: those held, then the channel's.
        let p2p = t.op == "send";
        let held = if p2p {
            self.held[from]
                .iter()
                .position(|m| m.op == "send" && m.tag == tag)
        } else {
            self.held[from].iter().position(|m| m.op != "send")
        };
        if let Some(i) = held {
            let msg = self.held[from].remove(i);
            return self.accept(t, from, msg, tag, total_len, consume);
        }
        let deadline = std::time::Instant::now() + self.timeout;
        let msg = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.from[from].recv_timeout(left) {
                Ok(m) if not_for_this(p2p, tag, &m) => self.held[from].push(m),
                other => break other,
            }
        };
        let msg = match msg {
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
        self.accept(t, from, msg, tag, total_len, consume)
    }
    fn try_take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<bool> {
        // A started operation takes in what is here, whenever in device time it arrives (see
        // `accept`).
        let msg = match self.held[from].iter().position(|m| m.op != "send") {
            Some(i) => Ok(self.held[from].remove(i)),
            None => loop {
                // A point-to-point message is not this collective's: it waits for its receive.
                match self.from[from].try_recv() {
                    Ok(m) if not_for_this(t.op == "send", tag, &m) => self.held[from].push(m),
                    other => break other,
                }
            },
        };
        match msg {
            Ok(msg) => self
                .accept(t, from, msg, tag, total_len, consume)
                .map(|_| true),
            Err(TryRecvError::Empty) => Ok(false),
            Err(TryRecvError::Disconnected) => Err(CommError::PeerGone {
                op: t.op,
                group: t.group.clone(),
                rank: self.rank,
                peer: from,
            }),
        }
    }
    fn clock(&mut self) -> f64 {
        self.device_time()
    }
    fn my_rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn comm_stats(&self) -> &CommStats {
        &self.stats
    }
    fn resume(&mut self) {
        self.clock.accrue(&mut self.stats);
    }
    fn pause(&mut self) {
        // The copies and additions communication does are not counted as compute: the link model (or
        // nothing, without one) is its cost.
        self.clock.mark();
    }
    fn record(&mut self, t: Tally) {
        self.clock.record(&mut self.stats, t);
    }
    fn settle(&mut self, t: &mut Tally) {
        let wait = self.clock.wait_until(t.ready);
        let moving = wait.min(t.ready_transfer);
        t.s.time_transfer_s += moving;
        t.s.time_blocked_s += wait - moving;
    }
    fn scratch(&mut self) -> &mut Vec<u64> {
        &mut self.scratch
    }
    fn flight(&mut self) -> &mut super::flight::FlightRecorder {
        &mut self.flight
    }
    fn flight_records(&self) -> Vec<super::flight::FlightRecord> {
        self.flight.records()
    }
}

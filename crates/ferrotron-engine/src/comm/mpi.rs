//! The MPI backend: one rank per process, across processes and hosts. The same ring collectives as
//! the threads backend run over MPI point-to-point messages (so byte counts, summation order and
//! accounting are identical). Sends are non-blocking with owned buffers; every receive polls against a
//! deadline, so a missing peer becomes an error naming it rather than a hang. A rank that hits an
//! error should call [`MpiComm::abort`]: mpirun then ends every other rank with a non-zero status.

use super::clock::{ClockSource, DeviceClock};
use super::ring::{check_received, Received, Tally, Transport};
use super::stats::CommStats;
use super::{CommError, CommResult, Element, DEFAULT_TIMEOUT};
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::time::{Duration, Instant};

const MPI_TAG: c_int = 7;
const HEADER_WORDS: usize = 8;
const MAGIC: u64 = 0x6665_7272_6f74_726f; // "ferrotro"

/// A stable 64-bit code for a name (FNV-1a), carried in message headers.
fn code(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// True for a message this receive does not want: for a point-to-point receive, anything but its
/// tag's point-to-point message (a collective's message can arrive first when an overlapped
/// reduction runs between the same two ranks); for a collective, any point-to-point message. It
/// waits in `held` for its own receive.
fn is_other(t: &Tally, buf: &[u64], tag: u64) -> bool {
    if buf.len() < HEADER_WORDS {
        return false;
    }
    let p2p = buf[2] == code("send");
    if t.op == "send" {
        !(p2p && buf[1] == tag)
    } else {
        p2p
    }
}

/// This process's endpoint of MPI_COMM_WORLD.
pub struct MpiComm {
    _universe: mpi::environment::Universe,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Sends in flight with the buffers they read from.
    pending: Vec<(ffi::MPI_Request, Vec<u64>, usize)>,
    clock: DeviceClock,
    stats: CommStats,
    scratch: Vec<u64>,
    recv_buf: Vec<u64>,
    /// Per source: point-to-point messages that arrived before the receive that wants them.
    held: Vec<Vec<Vec<u64>>>,
    flight: super::flight::FlightRecorder,
}

impl MpiComm {
    /// Initialises MPI (once per process).
    pub fn init(timeout: Option<Duration>) -> CommResult<Self> {
        let universe = mpi::initialize()
            .ok_or_else(|| CommError::Usage("MPI is already initialised in this process".into()))?;
        let world = mpi::topology::Communicator::size(&universe.world()) as usize;
        let rank = mpi::topology::Communicator::rank(&universe.world()) as usize;
        Ok(Self {
            _universe: universe,
            rank,
            world,
            timeout: timeout.unwrap_or(DEFAULT_TIMEOUT),
            pending: Vec::new(),
            clock: DeviceClock::start(ClockSource::ThreadCpu),
            stats: CommStats {
                rank,
                ..CommStats::default()
            },
            scratch: Vec::new(),
            recv_buf: Vec::new(),
            held: (0..world).map(|_| Vec::new()).collect(),
            flight: Default::default(),
        })
    }

    /// Ends the whole job: prints `why` and makes mpirun stop every rank with a non-zero status.
    pub fn abort(&self, why: &str, code: i32) -> ! {
        eprintln!("rank {}: {why}", self.rank);
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }

    pub fn device_time(&mut self) -> f64 {
        self.clock.accrue(&mut self.stats);
        self.clock.now
    }

    /// Drops the sends that have completed; with `wait`, waits (to the deadline) for all of them.
    fn progress_sends(&mut self, wait: bool, op: &'static str, group: &str) -> CommResult<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut i = 0;
            while i < self.pending.len() {
                let mut flag: c_int = 0;
                // SAFETY: the request is live and its buffer is owned by `pending` until it completes.
                unsafe {
                    ffi::MPI_Test(&mut self.pending[i].0, &mut flag, ffi::RSMPI_STATUS_IGNORE)
                };
                if flag != 0 {
                    self.pending.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            if !wait || self.pending.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let peer = self.pending[0].2;
                return Err(CommError::Timeout {
                    op,
                    group: group.to_string(),
                    rank: self.rank,
                    peer,
                    waited: self.timeout,
                });
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Buffers must outlive their sends.
        let _ = self.progress_sends(true, "finalize", "world");
    }
}

impl MpiComm {
    /// One non-blocking probe for a message from `from`.
    fn probe(&mut self, from: usize) -> Option<ffi::MPI_Status> {
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        let mut flag: c_int = 0;
        // SAFETY: plain MPI call with valid out-pointers.
        unsafe {
            ffi::MPI_Iprobe(
                from as c_int,
                MPI_TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut flag,
                &mut status,
            )
        };
        (flag != 0).then_some(status)
    }

    /// Receives the probed message, checks it belongs to this operation, and hands its elements to
    /// `consume`.
    /// Receives the probed message whole (header and payload).
    fn receive_raw(&mut self, from: usize, status: ffi::MPI_Status) -> Vec<u64> {
        let mut count: c_int = 0;
        // SAFETY: `status` comes from a successful probe.
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT64_T, &mut count) };
        // The transport's receive buffer (see `post`).
        let _transport = crate::memory::scope(crate::memory::Term::Other);
        let mut buf = std::mem::take(&mut self.recv_buf);
        buf.clear();
        buf.resize(count.max(0) as usize, 0);
        // SAFETY: the probed message fits `buf` exactly; MPI_Recv completes at once.
        unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr() as *mut c_void,
                count,
                ffi::RSMPI_UINT64_T,
                from as c_int,
                MPI_TAG,
                ffi::RSMPI_COMM_WORLD,
                ffi::RSMPI_STATUS_IGNORE,
            )
        };
        buf
    }

    /// Checks that a received message belongs to this operation and hands its elements to `consume`.
    fn accept<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        buf: Vec<u64>,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()> {
        if buf.len() < HEADER_WORDS || buf[0] != MAGIC {
            return Err(CommError::Mismatch {
                op: t.op,
                group: t.group.clone(),
                rank: self.rank,
                peer: from,
                mine: "a ferrotron message".into(),
                theirs: "something else".into(),
            });
        }
        let h: Vec<u64> = buf[..HEADER_WORDS].to_vec();
        // The header carries codes, not names.
        let got = Received {
            op_matches: h[2] == code(t.op),
            op: "this or another operation",
            tag: h[1],
            total_len: h[3] as usize,
            elem_matches: h[5] == code(T::NAME),
            elem: "another",
        };
        check_received(t, self.rank, from, tag, total_len, T::NAME, &got)?;
        let (len, bytes) = (h[4] as usize, h[7] as usize);
        let depart = f64::from_bits(h[6]);
        t.s.time_blocked_s += self.clock.wait_until(depart);
        t.s.bytes_received += bytes as u64;
        // SAFETY: the payload words hold `len` plain elements, 8-byte aligned.
        let view =
            unsafe { std::slice::from_raw_parts(buf[HEADER_WORDS..].as_ptr() as *const T, len) };
        let result = consume(view);
        self.recv_buf = buf;
        result
    }
}

impl Transport for MpiComm {
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
    fn settle(&mut self, _t: &mut Tally) {
        // Messages here carry their sender's device time and each receive waits for it (`accept`):
        // a completed operation has no later arrival left to wait for.
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
    fn resume(&mut self) {
        self.clock.accrue(&mut self.stats);
    }
    fn pause(&mut self) {
        let _ = self.progress_sends(false, "progress", "world");
        self.clock.mark();
    }
    fn record(&mut self, t: Tally) {
        self.clock.record(&mut self.stats, t);
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
        let words = bytes.div_ceil(8);
        // The transport's copy, held until MPI has sent it: this process's memory, but MPI's (as a
        // collective library's staging buffers are), not one of the planner's terms.
        let mut buf = {
            let _transport = crate::memory::scope(crate::memory::Term::Other);
            vec![0u64; HEADER_WORDS + words]
        };
        buf[..HEADER_WORDS].copy_from_slice(&[
            MAGIC,
            tag,
            code(t.op),
            total_len as u64,
            data.len() as u64,
            code(T::NAME),
            self.clock.now.to_bits(),
            bytes as u64,
        ]);
        // SAFETY: `Element` values are plain bytes and `buf` has room for them after the header.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr() as *const u8,
                buf[HEADER_WORDS..].as_mut_ptr() as *mut u8,
                bytes,
            )
        };
        let mut req: ffi::MPI_Request = unsafe { std::mem::zeroed() };
        // SAFETY: the buffer stays alive in `pending` until MPI_Test reports the send complete.
        let rc = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const c_void,
                buf.len() as c_int,
                ffi::RSMPI_UINT64_T,
                to as c_int,
                MPI_TAG,
                ffi::RSMPI_COMM_WORLD,
                &mut req,
            )
        };
        if rc != 0 {
            return Err(CommError::PeerGone {
                op: t.op,
                group: t.group.clone(),
                rank: self.rank,
                peer: to,
            });
        }
        self.pending.push((req, buf, to));
        t.s.bytes_sent += bytes as u64;
        Ok(())
    }

    fn take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<()> {
        // Point-to-point receives match by tag: a message for a later receive waits in `held`; a
        // collective takes its own held messages first, in order.
        if let Some(i) = self.held[from].iter().position(|m| !is_other(t, m, tag)) {
            let buf = self.held[from].remove(i);
            return self.accept(t, from, buf, tag, total_len, consume);
        }
        let deadline = Instant::now() + self.timeout;
        let buf = loop {
            if let Some(status) = self.probe(from) {
                let buf = self.receive_raw(from, status);
                if is_other(t, &buf, tag) {
                    self.held[from].push(buf);
                    continue;
                }
                break buf;
            }
            // Keep our own sends moving while we wait (a peer may be waiting for them).
            self.progress_sends(false, t.op, &t.group)?;
            if Instant::now() > deadline {
                return Err(CommError::Timeout {
                    op: t.op,
                    group: t.group.clone(),
                    rank: self.rank,
                    peer: from,
                    waited: self.timeout,
                });
            }
            std::thread::yield_now();
        };
        self.accept(t, from, buf, tag, total_len, consume)
    }

    fn try_take<T: Element>(
        &mut self,
        t: &mut Tally,
        from: usize,
        tag: u64,
        total_len: usize,
        consume: impl FnOnce(&[T]) -> CommResult<()>,
    ) -> CommResult<bool> {
        self.progress_sends(false, t.op, &t.group)?;
        if let Some(i) = self.held[from].iter().position(|m| !is_other(t, m, tag)) {
            let buf = self.held[from].remove(i);
            return self
                .accept(t, from, buf, tag, total_len, consume)
                .map(|_| true);
        }
        while let Some(status) = self.probe(from) {
            let buf = self.receive_raw(from, status);
            if is_other(t, &buf, tag) {
                self.held[from].push(buf);
                continue;
            }
            return self
                .accept(t, from, buf, tag, total_len, consume)
                .map(|_| true);
        }
        Ok(false)
    }
}

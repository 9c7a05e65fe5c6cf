//! The wire: a device mesh with its process groups, collectives and point-to-point transfers behind one
//! interface ([`Comm`]), every byte and every wait accounted per device, and no wait without a timeout.
//! Backends: threads in one process (every device a thread; optional simulated interconnect and a
//! virtual clock per device). An MPI or NCCL backend implements the same trait.

mod clock;
pub mod flight;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi;
mod ring;
pub mod selftest;
mod stats;
mod threads;

#[cfg(feature = "mpi")]
pub use self::mpi::MpiComm;
pub use clock::{burn_cpu, thread_cpu_time, ClockSource};
pub use mesh::{DeviceMesh, Dim, Group};
pub use ring::Pending;
pub use stats::{CommStats, OpStats};
pub use threads::{LinkModel, ThreadComm, ThreadWorld};

use ferrotron_core::precision::Half;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A peer did not arrive in time; names the operation, the group, this rank and the peer.
    #[error(
        "{op} on group {group}: rank {rank} timed out after {waited:?} waiting for rank {peer}"
    )]
    Timeout {
        op: &'static str,
        group: String,
        rank: usize,
        peer: usize,
        waited: Duration,
    },
    /// A peer's thread or process is gone.
    #[error("{op} on group {group}: rank {rank} lost rank {peer} (it exited or failed)")]
    PeerGone {
        op: &'static str,
        group: String,
        rank: usize,
        peer: usize,
    },
    /// Ranks called the same collective with different buffer sizes or operations.
    #[error("{op} on group {group}: rank {rank} has {mine}, but rank {peer} has {theirs}")]
    Mismatch {
        op: &'static str,
        group: String,
        rank: usize,
        peer: usize,
        mine: String,
        theirs: String,
    },
    #[error("{0}")]
    Usage(String),
}

pub type CommResult<T> = Result<T, CommError>;

/// Element types the collectives move and reduce.
///
/// # Safety
/// Implementors are plain numbers: no padding, no pointers, every bit pattern a valid value, alignment
/// at most 8. Backends copy them as raw bytes.
pub unsafe trait Element:
    Copy + Send + Sync + Default + std::fmt::Debug + PartialEq + 'static
{
    const NAME: &'static str;
    fn add(self, other: Self) -> Self;
    /// Multiply by 1/n (for a mean); integers divide.
    fn div(self, n: usize) -> Self;
}

macro_rules! float_element {
    ($t:ty, $name:expr) => {
        // SAFETY: a primitive number type.
        unsafe impl Element for $t {
            const NAME: &'static str = $name;
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn div(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_element!(f32, "f32");
float_element!(f64, "f64");

macro_rules! int_element {
    ($t:ty, $name:expr) => {
        // SAFETY: a primitive number type.
        unsafe impl Element for $t {
            const NAME: &'static str = $name;
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn div(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
int_element!(i32, "i32");
int_element!(i64, "i64");
int_element!(u8, "u8");
int_element!(u32, "u32");
int_element!(u64, "u64");

macro_rules! half_element {
    ($t:ty, $name:expr) => {
        // SAFETY: a primitive number type.
        unsafe impl Element for $t {
            const NAME: &'static str = $name;
            /// Each addition rounds once to the 16-bit type (the sum itself is formed in f32).
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            fn div(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_element!(half::bf16, Half::Bf16.name());
half_element!(half::f16, Half::F16.name());

/// Where the devices of a run live: threads of this process, or one MPI rank each (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommBackend {
    Threads,
    Mpi,
}

impl CommBackend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Threads => "threads",
            Self::Mpi => "mpi",
        }
    }
}

impl std::fmt::Display for CommBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CommBackend {
    type Err = String;
    /// `threads`, or `mpi` in a build with the `mpi` feature.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "threads" => Ok(Self::Threads),
            "mpi" if cfg!(feature = "mpi") => Ok(Self::Mpi),
            "mpi" => Err(
                "backend `mpi`: this ferrotron was built without MPI; build it with \
                 `cargo build --release --features mpi` (needs OpenMPI) and run it under mpirun"
                    .into(),
            ),
            other => Err(format!("backend `{other}`: expected `threads` or `mpi`")),
        }
    }
}

ferrotron_core::serde_as_text!(CommBackend);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
}

/// One device's view of the wire. Every rank of a group must call the same collectives in the same
/// order (as with MPI and NCCL); a point-to-point receive takes the message with its tag, whatever
/// order the sender sent them in.
pub trait Comm {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Every rank ends with the element-wise reduction of all ranks' `buf`, bit-identical everywhere.
    fn all_reduce<T: Element>(&mut self, g: &Group, buf: &mut [T], op: ReduceOp) -> CommResult<()>;
    /// `input` holds `g.size()` equal shards; rank i of the group ends with the reduction of shard i.
    fn reduce_scatter<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()>;
    /// Concatenates every rank's `input` (equal lengths) in group order.
    fn all_gather<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        output: &mut [T],
    ) -> CommResult<()>;
    /// Concatenates shards of different lengths: `counts[i]` elements from group member i.
    fn all_gather_uneven<T: Element>(
        &mut self,
        g: &Group,
        input: &[T],
        counts: &[usize],
        output: &mut [T],
    ) -> CommResult<()>;
    /// Copies `buf` of group member `root` (an index into the group) to every member.
    fn broadcast<T: Element>(&mut self, g: &Group, buf: &mut [T], root: usize) -> CommResult<()>;
    fn barrier(&mut self, g: &Group) -> CommResult<()>;
    /// Sends without waiting for the receiver (the buffer is copied).
    fn send<T: Element>(&mut self, to: usize, buf: &[T], tag: u64) -> CommResult<()>;
    fn recv<T: Element>(&mut self, from: usize, buf: &mut [T], tag: u64) -> CommResult<()>;
    /// A send whose transfer overlaps what this device does next (the device is not held until it
    /// is done; the receiver waits for its arrival), counted under group kind `kind`.
    fn send_overlapped<T: Element>(
        &mut self,
        kind: &'static str,
        to: usize,
        buf: &[T],
        tag: u64,
    ) -> CommResult<()>;
    /// [`Comm::recv`], counted under group kind `kind`.
    fn recv_as<T: Element>(
        &mut self,
        kind: &'static str,
        from: usize,
        buf: &mut [T],
        tag: u64,
    ) -> CommResult<()>;

    /// Device time so far (seconds): the virtual clock on the threads backend, the thread's CPU
    /// time plus waits elsewhere.
    fn device_time(&mut self) -> f64;

    /// What this device has sent, received and waited for so far.
    fn stats(&self) -> &CommStats;
    /// Its last communication operations, oldest first (see [`flight`]).
    fn flight_records(&self) -> Vec<flight::FlightRecord>;

    /// Starts an all-reduce of `buf` and returns at once; compute until [`Comm::wait`] overlaps it.
    fn start_all_reduce<T: Element>(
        &mut self,
        g: &Group,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<T>>;
    /// Starts a reduce-scatter of `input` (`g.size()` equal shards); `wait` returns this rank's shard.
    fn start_reduce_scatter<T: Element>(
        &mut self,
        g: &Group,
        input: Vec<T>,
        op: ReduceOp,
    ) -> CommResult<Pending<T>>;
    /// Starts an all-gather of equal shards; `wait` returns the concatenation.
    fn start_all_gather<T: Element>(&mut self, g: &Group, input: &[T]) -> CommResult<Pending<T>>;
    /// Moves a pending operation on as far as its arrived messages allow; true when it is complete.
    fn test<T: Element>(&mut self, p: &mut Pending<T>) -> CommResult<bool>;
    /// Completes a pending operation (waiting up to the timeout for each peer) and returns its result.
    fn wait<T: Element>(&mut self, p: Pending<T>) -> CommResult<Vec<T>>;
}

/// Default time a rank waits for a peer before giving up.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

//! A device's clocks: device time (its thread's CPU time while computing, plus the waits and
//! transfers communication adds) and wall time, and how they feed the stats.

use super::ring::Tally;
use super::stats::CommStats;
use std::time::Instant;

/// This thread's CPU time in seconds (what device time counts while a device computes).
pub fn thread_cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Computes for `seconds` of this thread's CPU time (a device made slow on purpose, to test that a
/// straggler is noticed: its clock advances as if its kernels were slower).
pub fn burn_cpu(seconds: f64) {
    let until = thread_cpu_time() + seconds;
    let mut x = 1.0f64;
    while thread_cpu_time() < until {
        for i in 0..1000 {
            x = (x * 1.000_000_1 + (i & 7) as f64).sqrt();
        }
        std::hint::black_box(x);
    }
}

/// What a device's compute time is measured by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockSource {
    /// The device thread's CPU time: right when the device computes on its own thread only (several
    /// devices sharing a process's cores), and immune to the other devices' threads.
    #[default]
    ThreadCpu,
    /// Elapsed time: for a device whose kernels run on several threads (a device with the process
    /// to itself), where its own thread's CPU time would miss the helpers' work.
    Wall,
}

impl ClockSource {
    fn read(self, origin: Instant) -> f64 {
        match self {
            ClockSource::ThreadCpu => thread_cpu_time(),
            ClockSource::Wall => origin.elapsed().as_secs_f64(),
        }
    }
}

pub(crate) struct DeviceClock {
    /// Device time, seconds.
    pub now: f64,
    source: ClockSource,
    cpu_mark: f64,
    wall_start: Instant,
}

impl DeviceClock {
    /// Starts counting on the calling thread.
    pub fn start(source: ClockSource) -> Self {
        let wall_start = Instant::now();
        Self {
            now: 0.0,
            source,
            cpu_mark: source.read(wall_start),
            wall_start,
        }
    }

    /// Adds the time spent computing since the last mark to device time.
    pub fn accrue(&mut self, stats: &mut CommStats) {
        let cpu = self.source.read(self.wall_start);
        let dt = (cpu - self.cpu_mark).max(0.0);
        self.now += dt;
        stats.compute_time_s += dt;
        self.cpu_mark = cpu;
    }

    /// Ends a stretch of communication: the CPU time it took is not compute.
    pub fn mark(&mut self) {
        self.cpu_mark = self.source.read(self.wall_start);
    }

    /// Waits (in device time) until `t`; returns how long that was.
    pub fn wait_until(&mut self, t: f64) -> f64 {
        let waited = (t - self.now).max(0.0);
        self.now = self.now.max(t);
        waited
    }

    pub fn record(&self, stats: &mut CommStats, t: Tally) {
        stats.record(t.kind, t.op, t.s);
        stats.device_time_s = self.now;
        stats.wall_time_s = self.wall_start.elapsed().as_secs_f64();
    }
}

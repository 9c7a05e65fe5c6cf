//! Per-device accounting: bytes and calls per (group kind, operation), time blocked waiting for a peer
//! versus time spent moving data, and the device's clocks.

use std::collections::BTreeMap;
use std::fmt;

#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct OpStats {
    pub calls: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Device time spent waiting for a peer to reach the operation.
    pub time_blocked_s: f64,
    /// Device time spent moving bytes (the link's cost of this device's transfers).
    pub time_transfer_s: f64,
}

impl OpStats {
    fn add(&mut self, o: &OpStats) {
        self.calls += o.calls;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.time_blocked_s += o.time_blocked_s;
        self.time_transfer_s += o.time_transfer_s;
    }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CommStats {
    pub rank: usize,
    /// Keyed by "group kind/operation", e.g. "tp/all_reduce".
    pub by_op: BTreeMap<String, OpStats>,
    /// The device clock: compute (this thread's CPU time) plus waits and transfers, in seconds.
    pub device_time_s: f64,
    /// CPU time this device's thread spent computing outside communication.
    pub compute_time_s: f64,
    pub wall_time_s: f64,
}

impl CommStats {
    pub fn record(&mut self, kind: &str, op: &str, s: OpStats) {
        self.by_op
            .entry(format!("{kind}/{op}"))
            .or_default()
            .add(&s);
    }
    /// What happened after `earlier` (a snapshot of the same device's stats).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = self.clone();
        for (k, s) in out.by_op.iter_mut() {
            if let Some(e) = earlier.by_op.get(k) {
                s.calls -= e.calls;
                s.bytes_sent -= e.bytes_sent;
                s.bytes_received -= e.bytes_received;
                s.time_blocked_s -= e.time_blocked_s;
                s.time_transfer_s -= e.time_transfer_s;
            }
        }
        out.compute_time_s -= earlier.compute_time_s;
        out
    }

    pub fn total(&self) -> OpStats {
        let mut t = OpStats::default();
        self.by_op.values().for_each(|s| t.add(s));
        t
    }
    /// Bytes sent by group kind (tp, dp, pp, world, p2p).
    pub fn bytes_sent_by_group(&self, kind: &str) -> u64 {
        self.by_op
            .iter()
            .filter(|(k, _)| k.split('/').next() == Some(kind))
            .map(|(_, s)| s.bytes_sent)
            .sum()
    }
    /// Idle fraction of the device clock: time blocked on peers over device time.
    pub fn idle_fraction(&self) -> f64 {
        if self.device_time_s == 0.0 {
            0.0
        } else {
            self.total().time_blocked_s / self.device_time_s
        }
    }
}

impl fmt::Display for CommStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "rank {}: device time {:.4} s (compute {:.4} s), wall {:.4} s, idle {:.1}%",
            self.rank,
            self.device_time_s,
            self.compute_time_s,
            self.wall_time_s,
            self.idle_fraction() * 100.0
        )?;
        writeln!(
            f,
            "  {:<24} {:>7} {:>14} {:>14} {:>10} {:>10}",
            "group/op", "calls", "bytes sent", "bytes recv", "blocked s", "moving s"
        )?;
        for (k, s) in &self.by_op {
            writeln!(
                f,
                "  {:<24} {:>7} {:>14} {:>14} {:>10.4} {:>10.4}",
                k, s.calls, s.bytes_sent, s.bytes_received, s.time_blocked_s, s.time_transfer_s
            )?;
        }
        Ok(())
    }
}

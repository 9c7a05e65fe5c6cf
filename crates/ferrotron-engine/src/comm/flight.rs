//! The flight recorder: each device keeps its last few hundred communication operations — group,
//! operation, its number among that group's operations of the kind, bytes, when it started and
//! whether it finished. When a run hangs (a peer times out, or is gone), every rank's records say
//! where it was: the ranks waiting inside collective #N of a group, and the rank that never entered
//! it. `read_and_judge` turns a run's records into that sentence.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

/// How many operations a device remembers.
pub const FLIGHT_RECORDS: usize = 512;

/// One communication operation of one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlightRecord {
    /// The group's name (`dp[0,2]`, `world`, `p2p[1,2]`) and its kind (`dp`, `tp`, …).
    pub group: String,
    pub kind: String,
    pub op: String,
    /// 1 for the first `op` of this group on this device, 2 for the second, …
    pub seq: u64,
    pub bytes: u64,
    /// Seconds since the device's recorder started.
    pub started_s: f64,
    /// When it finished; `None` if it never did.
    pub finished_s: Option<f64>,
}

/// A device's last [`FLIGHT_RECORDS`] operations.
#[derive(Debug)]
pub struct FlightRecorder {
    records: VecDeque<(u64, FlightRecord)>,
    next_id: u64,
    counts: BTreeMap<(String, &'static str), u64>,
    epoch: Instant,
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self {
            records: VecDeque::with_capacity(FLIGHT_RECORDS),
            next_id: 0,
            counts: BTreeMap::new(),
            epoch: Instant::now(),
        }
    }
}

impl FlightRecorder {
    /// Notes that an operation starts; the id its end is told by.
    pub fn started(&mut self, kind: &str, op: &'static str, group: &str) -> u64 {
        let seq = self.counts.entry((group.to_string(), op)).or_insert(0);
        *seq += 1;
        if self.records.len() == FLIGHT_RECORDS {
            self.records.pop_front();
        }
        let id = self.next_id;
        self.next_id += 1;
        self.records.push_back((
            id,
            FlightRecord {
                group: group.to_string(),
                kind: kind.to_string(),
                op: op.to_string(),
                seq: *seq,
                bytes: 0,
                started_s: self.epoch.elapsed().as_secs_f64(),
                finished_s: None,
            },
        ));
        id
    }

    /// Notes that operation `id` finished, having sent `bytes`.
    pub fn finished(&mut self, id: u64, bytes: u64) {
        let now = self.epoch.elapsed().as_secs_f64();
        if let Some((_, r)) = self.records.iter_mut().rev().find(|(i, _)| *i == id) {
            r.bytes = bytes;
            r.finished_s = Some(now);
        }
    }

    /// The records, oldest first.
    pub fn records(&self) -> Vec<FlightRecord> {
        self.records.iter().map(|(_, r)| r.clone()).collect()
    }
}

/// One rank's records as written to `flight/rank-N.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankFlight {
    pub rank: usize,
    /// Why it stopped (its error).
    pub ended: String,
    pub records: Vec<FlightRecord>,
}

/// Who is behind, from the ranks' records: the collective most ranks are stuck in (started, not
/// finished), and the members of its group that never entered it. `members` gives a group's
/// ranks by name. `None` when no rank is stuck inside an operation.
pub fn judge(flights: &[RankFlight], members: &dyn Fn(&str) -> Vec<usize>) -> Option<String> {
    // The unfinished operation of each rank that has one.
    let stuck: Vec<(usize, &FlightRecord)> = flights
        .iter()
        .filter_map(|f| {
            f.records
                .iter()
                .rev()
                .find(|r| r.finished_s.is_none())
                .map(|r| (f.rank, r))
        })
        .collect();
    // The one most ranks wait in.
    let mut votes: BTreeMap<(&str, &str, u64), Vec<usize>> = BTreeMap::new();
    for (rank, r) in &stuck {
        votes
            .entry((&r.group, &r.op, r.seq))
            .or_default()
            .push(*rank);
    }
    let ((group, op, seq), waiting) = votes.into_iter().max_by_key(|(_, w)| w.len())?;
    let behind: Vec<String> = members(group)
        .into_iter()
        .filter(|m| !waiting.contains(m))
        .map(|m| {
            let mine = flights.iter().find(|f| f.rank == m);
            let reached = mine.and_then(|f| {
                f.records
                    .iter()
                    .filter(|r| r.group == group && r.op == op)
                    .map(|r| r.seq)
                    .max()
            });
            match (mine, reached) {
                (None, _) => format!("rank {m} (no flight record: it never wrote one)"),
                (Some(_), Some(n)) if n >= seq => {
                    format!("rank {m} (it entered #{n}: a mismatch, not a laggard)")
                }
                (Some(f), reached) => format!(
                    "rank {m} never entered {op} #{seq} of {group} (its last there: #{}; it was last in {})",
                    reached.unwrap_or(0),
                    f.records
                        .last()
                        .map_or("nothing".to_string(), |r| format!("{} #{} of {}", r.op, r.seq, r.group))
                ),
            }
        })
        .collect();
    let waiting_list = format!(
        "{} {}",
        if waiting.len() == 1 { "rank" } else { "ranks" },
        waiting
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Some(if behind.is_empty() {
        format!("{waiting_list} waited in {op} #{seq} of {group}; every member entered it")
    } else {
        format!("{}; {waiting_list} waited there", behind.join("; "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's records of all-reduces over `world[0,1,2]`, each finished or not.
    fn flight(rank: usize, finished: &[bool]) -> RankFlight {
        let mut f = FlightRecorder::default();
        for done in finished {
            let id = f.started("world", "all_reduce", "world[0,1,2]");
            if *done {
                f.finished(id, 8);
            }
        }
        RankFlight {
            rank,
            ended: String::new(),
            records: f.records(),
        }
    }

    #[test]
    fn the_rank_that_never_entered_is_named() {
        let flights = vec![
            flight(0, &[true, true, false]),
            flight(1, &[true, true]),
            flight(2, &[true, true, false]),
        ];
        let said = judge(&flights, &|_| vec![0, 1, 2]).unwrap();
        assert!(
            said.contains("rank 1 never entered all_reduce #3 of world[0,1,2]")
                && said.contains("ranks 0, 2 waited there"),
            "{said}"
        );
        // A rank with no record at all is named too.
        let said = judge(&flights[..1], &|_| vec![0, 1]).unwrap();
        assert!(said.contains("rank 1 (no flight record"), "{said}");
    }

    #[test]
    fn the_recorder_keeps_the_last_operations() {
        let mut f = FlightRecorder::default();
        for _ in 0..FLIGHT_RECORDS + 10 {
            let id = f.started("dp", "all_reduce", "dp[0,1]");
            f.finished(id, 4);
        }
        let r = f.records();
        assert_eq!(r.len(), FLIGHT_RECORDS);
        assert_eq!(r.last().unwrap().seq, (FLIGHT_RECORDS + 10) as u64);
    }
}

//! When a run hangs: every device writes its flight records (`<out_dir>/flight/rank-N.json`) as it
//! gives up, and the reporting process reads them all and says who is behind and where — "rank 1
//! never entered all_reduce #4 of world[0,1,2,3]; ranks 0, 2, 3 waited there".

use crate::comm::flight::{judge, FlightRecord, RankFlight};
use crate::error::{EngineError, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn dir(out: &Path) -> PathBuf {
    out.join("flight")
}

/// Removes an earlier run's records (a run of this directory that hung before this one).
pub(super) fn clear(out: &Path) -> Result<()> {
    let d = dir(out);
    match std::fs::remove_dir_all(&d) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EngineError::io(&d, e)),
        _ => Ok(()),
    }
}

/// Writes device `rank`'s records and why it stopped. Best effort: the error being reported
/// matters more than a record that could not be written.
pub(super) fn write(out: &Path, rank: usize, ended: &EngineError, records: Vec<FlightRecord>) {
    let d = dir(out);
    let flight = RankFlight {
        rank,
        ended: ended.to_string(),
        records,
    };
    let text = serde_json::to_string_pretty(&flight).expect("records serialise");
    let written = std::fs::create_dir_all(&d)
        .map_err(|e| EngineError::io(&d, e))
        .and_then(|()| {
            crate::hf::write_atomic(&d.join(format!("rank-{rank}.json")), text.as_bytes())
        });
    if let Err(e) = written {
        eprintln!("note: device {rank}'s flight records were not written: {e}");
    }
}

/// The ranks of a group from its name (`dp[0,2]`).
fn members(group: &str) -> Vec<usize> {
    group
        .split_once('[')
        .and_then(|(_, rest)| rest.strip_suffix(']'))
        .map(|list| list.split(',').filter_map(|r| r.parse().ok()).collect())
        .unwrap_or_default()
}

/// `e` with what the devices' flight records say, when there are any: waits up to `wait` for all
/// `world` devices' files (under MPI the others write theirs as they give up).
pub(super) fn explain(out: &Path, world: usize, wait: Duration, e: EngineError) -> EngineError {
    let d = dir(out);
    let started = Instant::now();
    let read_all = || -> Vec<RankFlight> {
        (0..world)
            .filter_map(|r| {
                let text = ferrotron_core::bounded::read_to_string(
                    &d.join(format!("rank-{r}.json")),
                    ferrotron_core::bounded::RECORDS,
                )
                .ok()?;
                serde_json::from_str(&text).ok()
            })
            .collect()
    };
    let mut flights = read_all();
    if flights.is_empty() {
        return e;
    }
    while flights.len() < world && started.elapsed() < wait {
        std::thread::sleep(Duration::from_millis(100));
        flights = read_all();
    }
    match judge(&flights, &members) {
        Some(said) => EngineError::Invalid(format!(
            "{e}\nthe flight records ({}) say: {said}",
            d.display()
        )),
        None => e,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn group_members_come_from_its_name() {
        assert_eq!(super::members("dp[0,2]"), vec![0, 2]);
        assert_eq!(super::members("world[0,1,2,3]"), vec![0, 1, 2, 3]);
        assert!(super::members("odd").is_empty());
    }
}

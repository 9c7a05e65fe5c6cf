//! Reading a failed job: which hosts are gone, from the ranks' status files, their reports of
//! peers lost or waited for in vain, and OpenMPI's own errors.

use super::hosts::Host;
use std::path::Path;

/// A rank's report of a peer it lost or waited for in vain (`… waiting for rank 2`, `… lost rank 2`).
pub(crate) fn accused_rank(line: &str) -> Option<usize> {
    ["waiting for rank ", "lost rank "]
        .iter()
        .find_map(|marker| {
            let (_, rest) = line.split_once(marker)?;
            let r: String = rest.chars().take_while(char::is_ascii_digit).collect();
            r.parse().ok()
        })
}

/// Rank `from` (on host `by`) waited in vain for rank `to` (on host `of`), in `words`.
#[derive(Debug, Clone)]
pub(crate) struct Accusation {
    from: usize,
    to: usize,
    by: String,
    of: String,
    words: String,
}

/// What a failed job says of the hosts it lost.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    /// Hosts known to be gone, and how that was found.
    pub(crate) gone: Vec<(String, String)>,
    /// A rank's report of a peer it could not reach.
    pub(crate) accusations: Vec<Accusation>,
    /// Errors of ranks that name no peer: a failure of the run itself, not of a host.
    pub(crate) other_errors: Vec<String>,
}

impl Findings {
    pub(crate) fn add_gone(&mut self, host: &str, how: String) {
        if !self.gone.iter().any(|g| g.0 == host) {
            self.gone.push((host.to_string(), how));
        }
    }

    /// Reads mpirun's output (OpenMPI's reports of a connection or daemon lost on a node, and the
    /// ranks' errors) and the ranks' status files (see `rank_status`).
    pub(crate) fn read(out: &str, statuses: &[Option<String>], rank_host: &[String]) -> Self {
        let mut f = Findings::default();
        let known = |h: &str| {
            let h = h.trim_matches(|c: char| !c.is_alphanumeric() && !"-_.".contains(c));
            rank_host.iter().any(|k| k == h).then(|| h.to_string())
        };
        for line in out.lines().map(str::trim) {
            if let Some(h) = line.strip_prefix("Peer host:").and_then(known) {
                f.add_gone(
                    &h,
                    "a rank's MPI connection to it broke (OpenMPI: `Peer host`)".into(),
                );
            }
            if let Some((_, rest)) = line.split_once(" on node ") {
                if line.contains("exited")
                    || line.contains("Remote daemon")
                    || line.contains("lost")
                {
                    if let Some(h) = rest.split_whitespace().next().and_then(known) {
                        f.add_gone(&h, format!("mpirun: `{line}`"));
                    }
                }
            }
        }
        for (rank, status) in statuses.iter().enumerate() {
            let host = &rank_host[rank];
            let Some(text) = status else { continue };
            let last = text.lines().last().unwrap_or("");
            if last == "running" {
                f.add_gone(
                    host,
                    format!("rank {rank} on it ended without a word (its process was killed)"),
                );
            } else if let Some(err) = last.strip_prefix("error: ") {
                match accused_rank(err).and_then(|r| Some((r, rank_host.get(r)?))) {
                    Some((to, peer)) if peer != host => f.accusations.push(Accusation {
                        from: rank,
                        to,
                        by: host.clone(),
                        of: peer.clone(),
                        words: format!("rank {rank}: {err}"),
                    }),
                    _ => f.other_errors.push(format!("rank {rank}: {err}")),
                }
            }
        }
        f
    }

    /// Settles the accusations: a host already gone explains those that name it (or come from it);
    /// a rank that waited for a peer that was itself waiting for a third rank was held up, not cut
    /// off (its timeout cascades from the peer's, within milliseconds of it), so its report is set
    /// aside while others remain; the rest are a partition between live hosts, cut by dropping as
    /// few hosts as cover them — the most accused first, the later host of a tie (rank 0's host is
    /// kept longest).
    pub(crate) fn settle(&mut self, hosts: &[Host]) {
        let mut open: Vec<Accusation> = std::mem::take(&mut self.accusations);
        let held_up = |a: &Accusation, all: &[Accusation]| {
            all.iter().any(|b| b.from == a.to && b.to != a.from)
        };
        let direct: Vec<Accusation> = open
            .iter()
            .filter(|a| !held_up(a, &open))
            .cloned()
            .collect();
        if !direct.is_empty() {
            open = direct;
        }
        loop {
            open.retain(|a| !self.gone.iter().any(|g| g.0 == a.by || g.0 == a.of));
            if open.is_empty() {
                return;
            }
            let count = |h: &str| open.iter().filter(|a| a.by == h || a.of == h).count();
            let pick = hosts
                .iter()
                .max_by_key(|h| count(&h.name))
                .expect("an accusation names a host");
            let words = open
                .iter()
                .find(|a| a.by == pick.name || a.of == pick.name)
                .map(|a| a.words.clone())
                .unwrap_or_default();
            let how = format!("its ranks and others' could not reach each other while both lived (a partition): `{words}`");
            self.add_gone(&pick.name.clone(), how);
        }
    }
}

/// A rank's status file (see `rank_status`) and when it was last written (unix seconds).
pub(crate) struct RankEnd {
    pub(crate) text: Option<String>,
    pub(crate) time: Option<f64>,
}

/// Reads the status file of every rank (`text` is `None` where it never wrote one).
pub(crate) fn read_statuses(dir: &Path, ranks: usize) -> Vec<RankEnd> {
    (0..ranks)
        .map(|r| {
            let p = dir.join(format!("rank-{r}"));
            let time = std::fs::metadata(&p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| {
                    t.duration_since(std::time::UNIX_EPOCH)
                        .ok()
                        .map(|d| d.as_secs_f64())
                });
            RankEnd {
                text: std::fs::read_to_string(&p).ok(),
                time,
            }
        })
        .collect()
}

/// How each rank ended, for the failure event: its last word (`finished`, `terminated` by mpirun,
/// `error: …`, `running` if it was killed) and when it said it.
pub(crate) fn rank_ends(ends: &[RankEnd], rank_host: &[String]) -> serde_json::Value {
    ends.iter()
        .enumerate()
        .map(|(r, e)| {
            serde_json::json!({
                "rank": r,
                "host": rank_host[r],
                "last_word": e.text.as_deref().and_then(|t| t.lines().last()),
                "time": e.time,
            })
        })
        .collect()
}

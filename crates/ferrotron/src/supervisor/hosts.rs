//! The hosts of a launch: OpenMPI's hostfile read, and the cluster a job on some of them runs on.

use anyhow::{bail, Context, Result};
use ferrotron_engine::runtime::TrainConfig;
use std::path::Path;

/// One host of the hostfile and its slots (devices).
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub name: String,
    pub slots: usize,
}

/// OpenMPI's hostfile format: `name [slots=N]` a line.
pub fn parse_hostfile(text: &str, file: &Path) -> Result<Vec<Host>> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words
            .next()
            .expect("a non-empty line has a word")
            .to_string();
        let mut slots = 1;
        for w in words {
            match w.split_once('=') {
                Some(("slots", n)) => {
                    slots = n
                        .parse()
                        .ok()
                        .filter(|&n| (1..=4096).contains(&n))
                        .with_context(|| {
                            format!(
                                "{}:{}: `slots={n}` must be a count from 1 to 4096",
                                file.display(),
                                i + 1
                            )
                        })?
                }
                Some(("max_slots", _)) => {}
                _ => bail!(
                    "{}:{}: `{w}`: a host line is `NAME slots=N`",
                    file.display(),
                    i + 1
                ),
            }
        }
        if hosts.iter().any(|h| h.name == name) {
            bail!(
                "{}:{}: host `{name}` is listed twice",
                file.display(),
                i + 1
            );
        }
        hosts.push(Host { name, slots });
    }
    if hosts.is_empty() {
        bail!("{}: names no host", file.display());
    }
    Ok(hosts)
}

/// The cluster a job on `hosts` runs on: the run's, with one node per host of its slots (unless the
/// run's cluster names its nodes itself, or the hosts have different slots).
pub(crate) fn cluster_of(cfg: &TrainConfig, hosts: &[Host]) -> Option<String> {
    let names_nodes = cfg.parallelism.cluster.contains("nodes=")
        || cfg.parallelism.cluster.contains("devices_per_node=");
    let slots = hosts[0].slots;
    (!names_nodes && hosts.iter().all(|h| h.slots == slots)).then(|| {
        format!(
            "{},nodes={},devices_per_node={slots}",
            cfg.parallelism.cluster,
            hosts.len()
        )
    })
}

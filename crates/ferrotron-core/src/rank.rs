//! The rank grid: the one definition of how ranks map to (tp, dp, pp) coordinates, which node a rank
//! sits on, and which ranks form each parallel group. The planner prices links with it, the engine
//! builds its communication groups from it, and the checkpoint code finds a rank's shard with it.
//!
//! Megatron's order: tensor-parallel fastest, then data-parallel, then pipeline:
//! `rank = tp_rank + tp · (dp_rank + dp · pp_rank)`, and rank r sits on node `r / devices_per_node`.

use crate::error::{ConfigError, Result};

/// A parallel dimension of the grid, fastest-varying first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    Tp,
    Dp,
    Pp,
}

impl Dim {
    pub const ALL: [Dim; 3] = [Dim::Tp, Dim::Dp, Dim::Pp];
    pub fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }
}

/// dp × pp × tp ranks laid out tp fastest, then dp, then pp, on nodes of `devices_per_node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankGrid {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
    pub devices_per_node: usize,
}

impl RankGrid {
    /// A grid of positive sizes on nodes of `devices_per_node` devices.
    pub fn new(tp: usize, dp: usize, pp: usize, devices_per_node: usize) -> Result<Self> {
        if tp == 0 || dp == 0 || pp == 0 || devices_per_node == 0 {
            return Err(ConfigError::Invalid(
                "rank grid: tp, dp, pp and devices per node must be positive".into(),
            ));
        }
        Ok(Self {
            tp,
            dp,
            pp,
            devices_per_node,
        })
    }

    pub fn world_size(&self) -> usize {
        self.tp * self.dp * self.pp
    }

    pub fn size(&self, d: Dim) -> usize {
        match d {
            Dim::Tp => self.tp,
            Dim::Dp => self.dp,
            Dim::Pp => self.pp,
        }
    }

    /// (tp, dp, pp) coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> (usize, usize, usize) {
        (
            rank % self.tp,
            (rank / self.tp) % self.dp,
            rank / (self.tp * self.dp),
        )
    }

    pub fn rank_of(&self, tp: usize, dp: usize, pp: usize) -> usize {
        tp + self.tp * (dp + self.dp * pp)
    }

    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.devices_per_node
    }

    /// The ranks of the group along `d` that contains `rank`, in coordinate order.
    pub fn group_ranks(&self, rank: usize, d: Dim) -> Vec<usize> {
        let (t, dd, p) = self.coords(rank);
        (0..self.size(d))
            .map(|i| match d {
                Dim::Tp => self.rank_of(i, dd, p),
                Dim::Dp => self.rank_of(t, i, p),
                Dim::Pp => self.rank_of(t, dd, i),
            })
            .collect()
    }

    /// Every group along `d`, each in coordinate order, sorted.
    pub fn groups(&self, d: Dim) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = (0..self.world_size())
            .map(|r| self.group_ranks(r, d))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// How far apart consecutive ranks of a group along `d` are.
    fn stride(&self, d: Dim) -> usize {
        match d {
            Dim::Tp => 1,
            Dim::Dp => self.tp,
            Dim::Pp => self.tp * self.dp,
        }
    }

    /// True when every group along `d` sits inside one node. A group's ranks increase along it, so
    /// it does when its first and last rank share a node: when `first mod n + span < n` (n devices
    /// per node, span its last rank − its first). Only the largest residue of a first rank matters,
    /// and residues repeat within n steps, so this takes at most n² steps however large the grid
    /// (the planner asks it for every candidate of a search).
    pub fn within_nodes(&self, d: Dim) -> bool {
        let n = self.devices_per_node;
        let span = (self.size(d) - 1) * self.stride(d);
        let (tp, dp, pp) = (self.tp, self.dp, self.pp);
        let highest = match d {
            // First ranks: tp·j for every (dp, pp) pair j.
            Dim::Tp => (0..(dp * pp).min(n)).map(|j| (j * tp) % n).max(),
            // First ranks: t + tp·dp·p.
            Dim::Dp => (0..tp.min(n))
                .flat_map(|t| (0..pp.min(n)).map(move |p| (t + tp * dp * p) % n))
                .max(),
            // First ranks: every rank of stage 0, 0 .. tp·dp.
            Dim::Pp => Some((tp * dp).min(n) - 1),
        };
        highest.unwrap_or(0) + span < n
    }

    /// The previous and next pipeline stage's rank (same tp and dp coordinates), if any.
    pub fn pipeline_neighbours(&self, rank: usize) -> (Option<usize>, Option<usize>) {
        let (t, d, p) = self.coords(rank);
        let next = (p + 1 < self.pp).then(|| self.rank_of(t, d, p + 1));
        let prev = (p > 0).then(|| self.rank_of(t, d, p - 1));
        (prev, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_nodes_agrees_with_checking_every_group() {
        for tp in 1..=6 {
            for dp in 1..=5 {
                for pp in 1..=4 {
                    for n in 1..=9 {
                        let g = RankGrid::new(tp, dp, pp, n).unwrap();
                        for d in Dim::ALL {
                            let every = g
                                .groups(d)
                                .iter()
                                .all(|gr| gr.iter().all(|&r| g.node_of(r) == g.node_of(gr[0])));
                            assert_eq!(g.within_nodes(d), every, "{g:?} {d:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn megatron_rank_order_groups_and_nodes() {
        let g = RankGrid::new(2, 2, 2, 4).unwrap();
        assert_eq!(g.coords(5), (1, 0, 1));
        for r in 0..8 {
            let (t, d, p) = g.coords(r);
            assert_eq!(g.rank_of(t, d, p), r);
        }
        assert_eq!(
            g.groups(Dim::Tp),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            g.groups(Dim::Dp),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            g.groups(Dim::Pp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(g.pipeline_neighbours(1), (None, Some(5)));
        assert!(g.within_nodes(Dim::Tp) && g.within_nodes(Dim::Dp) && !g.within_nodes(Dim::Pp));
        assert!(!RankGrid::new(8, 1, 1, 4).unwrap().within_nodes(Dim::Tp));
        assert!(RankGrid::new(0, 1, 1, 4).is_err());
    }
}

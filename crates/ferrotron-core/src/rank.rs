//! The rank grid: the one definition of how ranks map to (tp, cp, dp, pp) coordinates, which node
//! a rank sits on, and which ranks form each parallel group. The planner prices links with it, the
//! engine builds its communication groups from it, and the checkpoint code finds a rank's shard with
//! it.
//!
//! Megatron's order: tensor-parallel fastest, then context-parallel, then data-parallel, then
//! pipeline: `rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))`, and rank r sits on
//! node `r / devices_per_node`.

use crate::error::{ConfigError, Result};
use crate::model::ExpertShard;

/// A parallel dimension of the grid, fastest-varying first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    Tp,
    Cp,
    Dp,
    Pp,
}

impl Dim {
    pub const ALL: [Dim; 4] = [Dim::Tp, Dim::Cp, Dim::Dp, Dim::Pp];
    pub fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Cp => "cp",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }
}

/// A rank's place on each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Coords {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl Coords {
    fn with(mut self, d: Dim, i: usize) -> Self {
        match d {
            Dim::Tp => self.tp = i,
            Dim::Cp => self.cp = i,
            Dim::Dp => self.dp = i,
            Dim::Pp => self.pp = i,
        }
        self
    }
}

/// tp × cp × dp × pp ranks laid out tp fastest, then cp, dp and pp, on nodes of `devices_per_node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankGrid {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
    pub devices_per_node: usize,
}

impl RankGrid {
    /// A grid of positive sizes on nodes of `devices_per_node` devices.
    pub fn new(
        tp: usize,
        cp: usize,
        dp: usize,
        pp: usize,
        devices_per_node: usize,
    ) -> Result<Self> {
        if tp == 0 || cp == 0 || dp == 0 || pp == 0 || devices_per_node == 0 {
            return Err(ConfigError::Invalid(
                "rank grid: tp, cp, dp, pp and devices per node must be positive".into(),
            ));
        }
        Ok(Self {
            tp,
            cp,
            dp,
            pp,
            devices_per_node,
        })
    }

    /// Devices of the grid (saturating, like [`crate::layout::Layout::world_size`]).
    pub fn world_size(&self) -> usize {
        self.tp
            .saturating_mul(self.cp)
            .saturating_mul(self.dp)
            .saturating_mul(self.pp)
    }

    pub fn size(&self, d: Dim) -> usize {
        match d {
            Dim::Tp => self.tp,
            Dim::Cp => self.cp,
            Dim::Dp => self.dp,
            Dim::Pp => self.pp,
        }
    }

    /// The coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            cp: (rank / self.tp) % self.cp,
            dp: (rank / (self.tp * self.cp)) % self.dp,
            pp: rank / (self.tp * self.cp * self.dp),
        }
    }

    pub fn rank_of(&self, c: Coords) -> usize {
        c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp))
    }

    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.devices_per_node
    }

    /// The ranks of the group along `d` that contains `rank`, in coordinate order.
    pub fn group_ranks(&self, rank: usize, d: Dim) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.size(d))
            .map(|i| self.rank_of(c.with(d, i)))
            .collect()
    }

    /// The replicas of `rank`'s model shard: the ranks with its tensor-parallel and pipeline
    /// coordinates, which hold the same parameters and see different tokens (other sequences over
    /// dp, other parts of each sequence over cp). Their gradients sum, and ZeRO shards over them;
    /// ordered by [`RankGrid::replica_index`].
    pub fn replica_ranks(&self, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.dp)
            .flat_map(|d| (0..self.cp).map(move |k| Coords { cp: k, dp: d, ..c }))
            .map(|x| self.rank_of(x))
            .collect()
    }

    /// `rank`'s place among its replicas: `cp_rank + cp · dp_rank`.
    pub fn replica_index(&self, rank: usize) -> usize {
        let c = self.coords(rank);
        c.cp + self.cp * c.dp
    }

    /// Expert parallelism over groups of `ep` replicas: the group of `rank` — the `ep` replicas
    /// whose [`RankGrid::replica_index`] differ only modulo `ep` (consecutive replicas, so inside a
    /// node first) — and `rank`'s place in it, which says which share of the experts it holds.
    pub fn expert_ranks(&self, rank: usize, ep: usize) -> (Vec<usize>, usize) {
        let (replicas, d) = (self.replica_ranks(rank), self.replica_index(rank));
        let ep = ep.max(1);
        let first = d / ep * ep;
        (replicas[first..first + ep].to_vec(), d % ep)
    }

    /// The share of every block's routed experts device `rank` holds under expert parallelism
    /// over `ep`, its tensor-parallel group cutting them into `blocks` blocks first
    /// ([`crate::layout::Layout::expert_blocks`]: tp under `etp=1`, else 1): block = its tp
    /// coordinate, index = its place in its expert-parallel group.
    pub fn expert_shard(&self, rank: usize, ep: usize, blocks: usize) -> ExpertShard {
        let block = if blocks > 1 { self.coords(rank).tp } else { 0 };
        ExpertShard {
            index: self.expert_ranks(rank, ep).1,
            size: ep.max(1),
            block,
            blocks: blocks.max(1),
        }
    }

    /// The replicas that hold the same experts as `rank` under expert parallelism over `ep`
    /// (replica indices equal modulo `ep`): the experts' gradients sum, and ZeRO shards their
    /// state, over these; and `rank`'s place among them.
    pub fn expert_replica_ranks(&self, rank: usize, ep: usize) -> (Vec<usize>, usize) {
        let (replicas, d) = (self.replica_ranks(rank), self.replica_index(rank));
        let ep = ep.max(1);
        let ranks = replicas.into_iter().skip(d % ep).step_by(ep).collect();
        (ranks, d / ep)
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
            Dim::Cp => self.tp,
            Dim::Dp => self.tp * self.cp,
            Dim::Pp => self.tp * self.cp * self.dp,
        }
    }

    /// True when every group along `d` sits inside one node. A group's ranks increase along it, so
    /// it does when its first and last rank share a node: when `first mod n + span < n` (n devices
    /// per node, span its last rank − its first). Only the largest residue of a first rank matters;
    /// along each other dimension residues repeat every n / gcd(stride, n) steps (one step when the
    /// stride is whole nodes), so this takes at most n³ steps however large the grid, and usually a
    /// few (the planner asks it for every candidate of a search).
    pub fn within_nodes(&self, d: Dim) -> bool {
        let n = self.devices_per_node;
        let span = (self.size(d) - 1) * self.stride(d);
        if span >= n {
            return false;
        }
        // The other dimensions, each walked only as far as its residues can differ.
        let [a, b, c] = {
            let mut others = Dim::ALL.into_iter().filter(|&e| e != d);
            [(); 3].map(|_| {
                let e = others.next().expect("three other dimensions");
                let period = n / gcd(self.stride(e), n);
                (self.size(e).min(period), self.stride(e))
            })
        };
        let mut highest = 0;
        for i in 0..a.0 {
            for j in 0..b.0 {
                for k in 0..c.0 {
                    highest = highest.max((i * a.1 + j * b.1 + k * c.1) % n);
                    if highest + span >= n {
                        return false;
                    }
                }
            }
        }
        highest + span < n
    }

    /// The previous and next pipeline stage's rank (same tp, cp and dp coordinates), if any.
    pub fn pipeline_neighbours(&self, rank: usize) -> (Option<usize>, Option<usize>) {
        let c = self.coords(rank);
        let next = (c.pp + 1 < self.pp).then(|| self.rank_of(Coords { pp: c.pp + 1, ..c }));
        let prev = (c.pp > 0).then(|| self.rank_of(Coords { pp: c.pp - 1, ..c }));
        (prev, next)
    }
}

/// The greatest common divisor (Euclid).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_nodes_agrees_with_checking_every_group() {
        for tp in 1..=4 {
            for cp in 1..=3 {
                for dp in 1..=3 {
                    for pp in 1..=3 {
                        for n in 1..=9 {
                            let g = RankGrid::new(tp, cp, dp, pp, n).unwrap();
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
    }

    #[test]
    fn expert_groups_are_carved_from_consecutive_replicas() {
        // tp=2, dp=4: rank r's replicas are r % 2, +2, +4, +6.
        let g = RankGrid::new(2, 1, 4, 1, 8).unwrap();
        assert_eq!(g.expert_ranks(5, 2), (vec![5, 7], 0));
        assert_eq!(g.expert_ranks(7, 2), (vec![5, 7], 1));
        assert_eq!(g.expert_replica_ranks(7, 2), (vec![3, 7], 1));
        assert_eq!(g.expert_ranks(6, 4), (vec![0, 2, 4, 6], 3));
        assert_eq!(g.expert_replica_ranks(6, 4), (vec![6], 0));
        // ep=1: every replica holds every expert.
        assert_eq!(g.expert_ranks(6, 1), (vec![6], 0));
        assert_eq!(g.expert_replica_ranks(6, 1), (g.replica_ranks(6), 3));
    }

    #[test]
    fn megatron_rank_order_groups_and_nodes() {
        let g = RankGrid::new(2, 1, 2, 2, 4).unwrap();
        assert_eq!(
            g.coords(5),
            Coords {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
        for r in 0..8 {
            assert_eq!(g.rank_of(g.coords(r)), r);
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
        assert!(!RankGrid::new(8, 1, 1, 1, 4).unwrap().within_nodes(Dim::Tp));
        assert!(RankGrid::new(0, 1, 1, 1, 4).is_err());
    }

    #[test]
    fn context_parallel_ranks_sit_between_tensor_and_data_parallel() {
        // tp=2, cp=2, dp=2: rank = t + 2·(c + 2·d).
        let g = RankGrid::new(2, 2, 2, 1, 8).unwrap();
        assert_eq!(
            g.coords(6),
            Coords {
                tp: 0,
                cp: 1,
                dp: 1,
                pp: 0
            }
        );
        assert_eq!(
            g.groups(Dim::Cp),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            g.groups(Dim::Dp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        // The replicas of rank 1's shard: every (cp, dp) with its tp coordinate.
        assert_eq!(g.replica_ranks(1), vec![1, 3, 5, 7]);
        assert_eq!(
            (0..8).map(|r| g.replica_index(r)).collect::<Vec<_>>(),
            vec![0, 0, 1, 1, 2, 2, 3, 3]
        );
    }
}

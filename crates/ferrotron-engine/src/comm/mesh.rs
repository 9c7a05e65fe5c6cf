//! Process groups: named sets of ranks for the collectives, made from the core's rank grid
//! (`ferrotron_core::rank`), which alone defines rank order, placement and group membership.

use super::CommError;
pub use ferrotron_core::rank::{Dim, RankGrid};

/// An ordered set of ranks that take part in a collective together.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    /// e.g. `tp[4,5]`, `dp[1,3]`, `world`.
    pub name: String,
    /// The dimension (or "world"/"pair") the group spans, for accounting.
    pub kind: &'static str,
    pub ranks: Vec<usize>,
}

impl Group {
    pub fn new(kind: &'static str, ranks: Vec<usize>) -> Self {
        let list = ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",");
        Self {
            name: format!("{kind}[{list}]"),
            kind,
            ranks,
        }
    }
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// This rank's position in the group, or an error naming the group.
    pub fn index_of(&self, rank: usize) -> Result<usize, CommError> {
        self.ranks.iter().position(|&r| r == rank).ok_or_else(|| {
            CommError::Usage(format!(
                "rank {rank} is not a member of group {}",
                self.name
            ))
        })
    }
}

/// The ranks of a run and their groups: the core's [`RankGrid`] (the one definition of rank order
/// and placement), with each group as a named [`Group`] the collectives take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMesh(RankGrid);

impl std::ops::Deref for DeviceMesh {
    type Target = RankGrid;
    fn deref(&self) -> &RankGrid {
        &self.0
    }
}

impl DeviceMesh {
    /// A mesh of `grid` over exactly `world` devices; anything else is an error.
    pub fn new(grid: RankGrid, world: usize) -> Result<Self, CommError> {
        if grid.world_size() != world {
            return Err(CommError::Usage(format!(
                "mesh tp={} × cp={} × dp={} × pp={} = {} does not equal the world size {world}",
                grid.tp,
                grid.cp,
                grid.dp,
                grid.pp,
                grid.world_size()
            )));
        }
        Ok(Self(grid))
    }

    /// The replicas of `rank`'s shard (dp × cp, see [`RankGrid::replica_ranks`]): the group its
    /// gradients are summed over and its ZeRO state sharded over.
    pub fn replica_group(&self, rank: usize) -> Group {
        Group::new("dp", self.replica_ranks(rank))
    }

    /// The expert-parallel group of `rank` over `ep` of its replicas, and its place there (see
    /// [`RankGrid::expert_ranks`]).
    pub fn expert_group(&self, rank: usize, ep: usize) -> (Group, usize) {
        let (ranks, i) = self.expert_ranks(rank, ep);
        (Group::new("ep", ranks), i)
    }

    /// The replicas holding `rank`'s experts under expert parallelism over `ep` (their gradients
    /// sum and ZeRO shards over them), and its place there (see [`RankGrid::expert_replica_ranks`]).
    pub fn expert_replica_group(&self, rank: usize, ep: usize) -> (Group, usize) {
        let (ranks, i) = self.expert_replica_ranks(rank, ep);
        (Group::new("dp", ranks), i)
    }

    /// The group along `d` that contains `rank`, its members in coordinate order.
    pub fn group_of(&self, rank: usize, d: Dim) -> Group {
        Group::new(d.name(), self.group_ranks(rank, d))
    }

    /// Every group along `d`.
    pub fn groups(&self, d: Dim) -> Vec<Group> {
        self.0
            .groups(d)
            .into_iter()
            .map(|ranks| Group::new(d.name(), ranks))
            .collect()
    }

    pub fn world(&self) -> Group {
        Group::new("world", (0..self.world_size()).collect())
    }

    /// True when every tensor-parallel group sits inside one node.
    pub fn tp_groups_within_nodes(&self) -> bool {
        self.within_nodes(Dim::Tp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_rank_order_and_groups() {
        let grid = |tp, dp, pp| RankGrid::new(tp, 1, dp, pp, 4).unwrap();
        let m = DeviceMesh::new(grid(2, 2, 2), 8).unwrap();
        for r in 0..8 {
            assert_eq!(m.rank_of(m.coords(r)), r);
        }
        assert_eq!(
            m.groups(Dim::Tp)
                .iter()
                .map(|g| g.ranks.clone())
                .collect::<Vec<_>>(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            m.groups(Dim::Dp)
                .iter()
                .map(|g| g.ranks.clone())
                .collect::<Vec<_>>(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            m.groups(Dim::Pp)
                .iter()
                .map(|g| g.ranks.clone())
                .collect::<Vec<_>>(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(m.pipeline_neighbours(1), (None, Some(5)));
        assert!(m.tp_groups_within_nodes());
        assert!(!DeviceMesh::new(grid(8, 1, 1), 8)
            .unwrap()
            .tp_groups_within_nodes());
    }

    #[test]
    fn bad_meshes_and_groups_are_errors() {
        let grid = RankGrid::new(2, 1, 2, 2, 8).unwrap();
        let e = DeviceMesh::new(grid, 6).unwrap_err().to_string();
        assert!(e.contains("does not equal the world size 6"), "{e}");
        let g = Group::new("tp", vec![0, 1]);
        assert!(g
            .index_of(3)
            .unwrap_err()
            .to_string()
            .contains("rank 3 is not a member of group tp[0,1]"));
    }
}

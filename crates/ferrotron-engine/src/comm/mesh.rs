//! The device mesh: the one place that knows how ranks map to (tp, dp, pp) coordinates, which node a
//! rank sits on, and which ranks form each process group.

use super::CommError;

/// A parallel dimension of the mesh, fastest-varying first in Megatron's rank order.
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

/// dp × pp × tp ranks, laid out tp fastest, then dp, then pp: `rank = tp + tp_size·(dp + dp_size·pp)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMesh {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
    pub devices_per_node: usize,
}

impl DeviceMesh {
    /// A mesh over exactly `world` devices; anything else is an error.
    pub fn new(
        tp: usize,
        dp: usize,
        pp: usize,
        world: usize,
        devices_per_node: usize,
    ) -> Result<Self, CommError> {
        if tp == 0 || dp == 0 || pp == 0 || devices_per_node == 0 {
            return Err(CommError::Usage(
                "mesh dimensions and devices per node must be positive".into(),
            ));
        }
        if tp * dp * pp != world {
            return Err(CommError::Usage(format!(
                "mesh tp={tp} × dp={dp} × pp={pp} = {} does not equal the world size {world}",
                tp * dp * pp
            )));
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

    /// The group along `d` that contains `rank`, its members in coordinate order.
    pub fn group_of(&self, rank: usize, d: Dim) -> Group {
        let (t, p_, q) = self.coords(rank);
        let ranks = (0..self.size(d))
            .map(|i| match d {
                Dim::Tp => self.rank_of(i, p_, q),
                Dim::Dp => self.rank_of(t, i, q),
                Dim::Pp => self.rank_of(t, p_, i),
            })
            .collect();
        Group::new(d.name(), ranks)
    }

    /// Every group along `d`.
    pub fn groups(&self, d: Dim) -> Vec<Group> {
        let mut out: Vec<Group> = (0..self.world_size())
            .map(|r| self.group_of(r, d))
            .collect();
        out.sort_by(|a, b| a.ranks.cmp(&b.ranks));
        out.dedup();
        out
    }

    pub fn world(&self) -> Group {
        Group::new("world", (0..self.world_size()).collect())
    }

    /// True when every tensor-parallel group sits inside one node.
    pub fn tp_groups_within_nodes(&self) -> bool {
        self.groups(Dim::Tp).iter().all(|g| {
            g.ranks
                .iter()
                .all(|&r| self.node_of(r) == self.node_of(g.ranks[0]))
        })
    }

    /// The next and previous pipeline stage's rank (same tp and dp coordinates), if any.
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
    fn megatron_rank_order_and_groups() {
        let m = DeviceMesh::new(2, 2, 2, 8, 4).unwrap();
        assert_eq!(m.coords(5), (1, 0, 1));
        for r in 0..8 {
            let (t, d, p) = m.coords(r);
            assert_eq!(m.rank_of(t, d, p), r);
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
        assert!(!DeviceMesh::new(8, 1, 1, 8, 4)
            .unwrap()
            .tp_groups_within_nodes());
    }

    #[test]
    fn bad_meshes_and_groups_are_errors() {
        let e = DeviceMesh::new(2, 2, 2, 6, 8).unwrap_err().to_string();
        assert!(e.contains("does not equal the world size 6"), "{e}");
        let g = Group::new("tp", vec![0, 1]);
        assert!(g
            .index_of(3)
            .unwrap_err()
            .to_string()
            .contains("rank 3 is not a member of group tp[0,1]"));
    }
}

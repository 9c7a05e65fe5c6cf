//! What each rank of a layout keeps in a checkpoint: for every tensor of its pipeline stages, its
//! tensor-parallel shard and the part of it the rank owns under ZeRO. The same cut the runtime makes
//! ([`TpShard`], [`crate::parallel::data::owned`]), so files and devices always agree.

use super::{Kind, Piece, SliceEntry, TensorEntry};
use crate::error::{EngineError, Result};
use crate::parallel::data::owned;
use crate::parallel::tensor::Slice;
use crate::parallel::TpShard;
use ferrotron_core::layout::Layout;
use ferrotron_core::model::{LoraConfig, ModelConfig};
use ferrotron_core::schedule::StagePartition;
use std::ops::Range;

/// One tensor a rank keeps: part `flat` of its tensor-parallel shard `tp_slice` (of shape
/// `shard_shape`) of the global tensor `name` (of shape `shape`).
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    pub name: String,
    pub shape: Vec<usize>,
    pub tp_slice: Slice,
    pub shard_shape: Vec<usize>,
    pub flat: Range<usize>,
}

impl Holding {
    /// How its arrays are stored: cut-major when the shard is cut along a later dimension.
    pub fn order(&self) -> super::StoredOrder {
        super::StoredOrder::for_cut(self.tp_slice.dim)
    }

    /// Its elements in the order they are stored (`order`), from the runtime's row-major ones.
    pub fn stored(&self, row_major: &[f32]) -> Vec<f32> {
        match self.order() {
            super::StoredOrder::RowMajor => row_major.to_vec(),
            super::StoredOrder::CutMajor => {
                super::order::CutMajor::new(&self.shard_shape, self.tp_slice.dim, self.flat.clone())
                    .store(row_major)
            }
        }
    }

    pub fn piece(&self, kind: Kind, file: &str) -> Piece {
        Piece {
            kind,
            file: file.to_string(),
            key: kind.key(&self.name),
            tp_slice: SliceEntry::from(&self.tp_slice),
            shard_shape: self.shard_shape.clone(),
            flat: [self.flat.start, self.flat.end],
            order: self.order(),
        }
    }
}

/// The tensors rank `rank` of `layout` keeps, in its store's order: every tensor of its stages'
/// shard, whole or (ZeRO ≥ 1 over more than one replica) its owned piece. A tensor's replicas are
/// the shard's dp × cp copies, or under expert parallelism (`ep`) a routed expert's dp × cp / ep
/// copies on the devices holding that expert. Without ZeRO sharding its replicas hold identical
/// copies and only the first keeps it (others keep nothing of it).
///
/// With `lora` the tensors are the LoRA adapters (the frozen base is not trained, so not saved).
pub fn rank_holdings(
    cfg: &ModelConfig,
    lora: Option<&LoraConfig>,
    layout: &Layout,
    rank: usize,
) -> Result<Vec<Holding>> {
    let (pp, vpp) = (layout.pp.max(1), layout.vpp.max(1));
    let world = layout.world_size();
    if rank >= world {
        return Err(EngineError::Invalid(format!(
            "rank {rank} of layout `{layout}`, which has {world} devices"
        )));
    }
    let grid = layout.rank_grid(world);
    let (t, s) = (grid.coords(rank).tp, grid.coords(rank).pp);
    let ep = layout.ep.max(1);
    // Each tensor's replicas and this rank's place among them: the shard's, or a routed expert's.
    let dense = (layout.replicas(), grid.replica_index(rank));
    let (expert_replicas, expert_index) = grid.expert_replica_ranks(rank, ep);
    let routed = (expert_replicas.len(), expert_index);
    let partition = StagePartition::for_layout(cfg, layout)?;
    let ranges: Vec<Range<usize>> = (0..vpp)
        .map(|k| partition.layers[k * pp + s].clone())
        .collect();
    let shard = TpShard::of_layout(cfg, layout, t)?;
    let local =
        shard
            .local_config(cfg)
            .expert_shard(grid.expert_shard(rank, ep, layout.expert_blocks()));
    let (global, mine) = match lora {
        Some(l) => (l.adapter_specs(cfg), l.adapter_specs(&local)),
        None => (cfg.param_specs(), local.param_specs()),
    };
    let mut out = Vec::new();
    for spec in mine
        .into_iter()
        .filter(|spec| ranges.iter().any(|r| cfg.stage_owns(&spec.name, r)))
    {
        let (replicas, d) = match cfg.routed_expert_of(&spec.name) {
            Some(_) => routed,
            None => dense,
        };
        let sharded = layout.zero >= 1 && replicas > 1;
        if !sharded && d > 0 {
            continue;
        }
        let shape = global
            .iter()
            .find(|g| g.name == spec.name)
            .map(|g| g.shape.clone())
            .expect("a shard's tensors are the model's");
        let n = spec.numel();
        out.push(Holding {
            tp_slice: shard.slice(cfg, &spec.name)?,
            flat: if sharded { owned(n, replicas, d) } else { 0..n },
            name: spec.name,
            shape,
            shard_shape: spec.shape,
        });
    }
    Ok(out)
}

/// The manifest's tensor list for `layout`: every model tensor with the pieces each rank's file
/// holds (`kinds`: the parameters, and the moments once the optimizer has stepped).
pub fn manifest_tensors(
    cfg: &ModelConfig,
    lora: Option<&LoraConfig>,
    layout: &Layout,
    kinds: &[Kind],
) -> Result<Vec<TensorEntry>> {
    let specs = match lora {
        Some(l) => l.adapter_specs(cfg),
        None => cfg.param_specs(),
    };
    let mut tensors: Vec<TensorEntry> = specs
        .into_iter()
        .map(|s| TensorEntry {
            name: s.name,
            shape: s.shape,
            dtype: "F32".into(),
            pieces: Vec::new(),
        })
        .collect();
    for rank in 0..layout.world_size() {
        let file = super::rank_file_name(rank);
        for h in rank_holdings(cfg, lora, layout, rank)? {
            let entry = tensors
                .iter_mut()
                .find(|t| t.name == h.name)
                .expect("a holding names a model tensor");
            for &k in kinds {
                entry.pieces.push(h.piece(k, &file));
            }
        }
    }
    Ok(tensors)
}

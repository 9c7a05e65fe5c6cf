//! Where a device's shard of each tensor comes from. A model in memory cuts it from the whole
//! tensor; a model on disk or on an object store reads only the rows and columns the shard keeps
//! (see `hf::ModelWeights`), so each device reads its own bytes and no process holds the model.

use super::slice::Slice;
use crate::error::Result;
use crate::kernels::nf4::Nf4Matrix;
use crate::transformer::ParamStore;
use ferrotron_core::model::ParamSpec;
use std::ops::Range;
use std::sync::Arc;

/// Elements of a flattened tensor: each range of flat indices, then that many zeros of padding.
pub type Runs = [(Range<usize>, usize)];

/// A model's tensors, by store order, read in parts.
pub trait WeightSource: Sync {
    /// Every tensor's name and global shape.
    fn specs(&self) -> &[ParamSpec];
    /// The elements `runs` of tensor `i`, concatenated, and the bytes this read took from storage
    /// (0 for a model in memory).
    fn read_runs(&self, i: usize, runs: &Runs) -> Result<(Vec<f32>, u64)>;
    /// The tensor-parallel shard `slice` of tensor `i`, and the bytes read: its elements in the
    /// shard's order (a source that stores shards itself reads them its own way).
    fn read_shard(&self, i: usize, slice: &Slice) -> Result<(Vec<f32>, u64)> {
        self.read_runs(i, &slice.runs(&self.specs()[i].shape))
    }
    /// Tensor `i` as 4-bit codes (a QLoRA base), when it is held so.
    fn nf4(&self, _i: usize) -> Option<&Arc<Nf4Matrix>> {
        None
    }
    /// Bytes any reader of this source reads once, whatever it keeps (the files' headers).
    fn fixed_bytes(&self) -> u64 {
        0
    }
}

impl WeightSource for ParamStore {
    fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn read_runs(&self, i: usize, runs: &Runs) -> Result<(Vec<f32>, u64)> {
        let t = &self.tensors[i];
        let mut out = Vec::with_capacity(runs.iter().map(|(r, pad)| r.len() + pad).sum());
        for (r, pad) in runs {
            out.extend_from_slice(&t[r.clone()]);
            out.resize(out.len() + pad, 0.0);
        }
        Ok((out, 0))
    }

    fn nf4(&self, i: usize) -> Option<&Arc<Nf4Matrix>> {
        self.nf4[i].as_ref()
    }
}

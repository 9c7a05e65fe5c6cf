//! The collectives a shard of the model calls: at the edges of its tensor-parallel regions
//! (Megatron's f and g operators); when its sequences are split (context parallelism), for
//! attention across the split and the positions of its tokens; and when its experts are split
//! (expert parallelism), to send tokens to their experts and back. The executor calls them
//! unconditionally; for the unsplit model every one is the identity or the local kernel
//! ([`Unsplit`]), and the parallel layer implements them over process groups.

use crate::kernels::{AttnGradInputs, AttnShape, Backend, Qkv, QkvGrads};

/// What a shard of the model needs from its tensor-parallel group.
///
/// Without sequence parallelism the hidden states between split regions are whole on every device:
/// `gather_rows` returns `None` and `reduce` is an all-reduce. With it, each device holds a contiguous
/// block of the rows (`row_block`): `gather_rows` is an all-gather and `reduce` a reduce-scatter.
pub trait ShardCollectives {
    /// Devices in the tensor-parallel group (1: the unsplit model).
    fn size(&self) -> usize;
    /// This device's place in the tensor-parallel group.
    fn index(&self) -> usize {
        0
    }
    /// This device's block of the rows of a hidden state as (index, blocks); (0, 1) when rows are whole.
    fn row_block(&self) -> (usize, usize);
    /// Every row of a hidden state whose rows are sharded (the input of a column-parallel layer, the
    /// gradient at a row-parallel layer's output); `None` when `x` already holds every row.
    fn gather_rows(&self, x: &[f32]) -> Option<Vec<f32>>;
    /// Sums the group's partial results (a row-parallel layer's output, a column-parallel layer's input
    /// gradient, the vocab-parallel embedding), keeping this device's rows under sequence parallelism.
    fn reduce(&self, x: Vec<f32>) -> Vec<f32>;
    /// Element-wise maximum over the group (vocab-parallel cross-entropy).
    fn max(&self, x: &mut [f32]);
    /// Element-wise sum over the group, in f64 (vocab-parallel cross-entropy).
    fn sum(&self, x: &mut [f64]);

    /// The positions in their sequences of this device's `local` tokens per sequence (context
    /// parallelism holds parts of each sequence).
    fn positions(&self, local: usize) -> Vec<u32> {
        (0..local as u32).collect()
    }
    /// Tokens per whole sequence, of which this device holds `local`.
    fn sequence_length(&self, local: usize) -> usize {
        local
    }
    /// Causal attention of this device's queries over their whole sequences (see
    /// [`Backend::attention_forward`]; `lse` is only for [`ShardCollectives::attention_backward`]).
    fn attention_forward(
        &self,
        be: &dyn Backend,
        s: AttnShape,
        x: Qkv,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        be.attention_forward(s, x, out, lse)
    }
    /// The gradients at this device's Q, K and V (see [`Backend::attention_backward`]).
    fn attention_backward(
        &self,
        be: &dyn Backend,
        s: AttnShape,
        inputs: AttnGradInputs,
        grads: QkvGrads,
    ) {
        be.attention_backward(s, inputs, grads)
    }

    /// Expert parallelism: `counts[j]` (one count per expert device j holds) go to device j of the
    /// expert-parallel group; returns what each device sent here, in group order.
    fn expert_counts(&self, counts: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
        counts
    }
    /// Expert parallelism: `send[j]` goes to device j of the expert-parallel group; returns what
    /// each device sent here, in group order (`lengths[j]` elements from device j).
    fn expert_exchange(&self, send: Vec<Vec<f32>>, _lengths: &[usize]) -> Vec<Vec<f32>> {
        send
    }
}

/// The unsplit model: one device, nothing to exchange.
pub struct Unsplit;

impl ShardCollectives for Unsplit {
    fn size(&self) -> usize {
        1
    }
    fn row_block(&self) -> (usize, usize) {
        (0, 1)
    }
    fn gather_rows(&self, _x: &[f32]) -> Option<Vec<f32>> {
        None
    }
    fn reduce(&self, x: Vec<f32>) -> Vec<f32> {
        x
    }
    fn max(&self, _x: &mut [f32]) {}
    fn sum(&self, _x: &mut [f64]) {}
}

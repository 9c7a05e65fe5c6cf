//! Data parallelism with ZeRO stages 0–3 over the dp group of one device.
//!
//! Every tensor of the device's (tensor- and pipeline-parallel) shard is cut, for ZeRO, into dp equal
//! pieces (padded with zeros to a multiple of dp); dp rank d owns piece d.
//! - **ZeRO-0**: parameters, gradients and Adam moments whole on every replica; gradients all-reduced
//!   in buckets (a unit's tensors, as soon as their last contribution of the step is in, overlapping
//!   the rest of the backward pass).
//! - **ZeRO-1**: Adam moments (and the f32 master, which in f32 training is the parameter itself) only
//!   for the owned piece; gradients reduce-scattered in buckets, the owned piece updated, parameters
//!   all-gathered after the step.
//! - **ZeRO-2**: gradients sharded too: each unit's gradient exists whole only while its backward runs,
//!   then is reduce-scattered into the owned piece (every micro-batch: accumulation across micro-batches
//!   happens in the pieces, so pipelining stays correct).
//! - **ZeRO-3**: parameters sharded too: a unit's parameters are all-gathered just before the executor
//!   uses them (forward, and again in backward) and freed after.

use super::tensor::TpGroup;
use crate::comm::{Comm, Group, Pending};
use crate::half_storage::HalfParts;
use crate::memory::{self, Term};
use crate::optim::AdamW;
use crate::transformer::{ParamStore, Unit};
use ferrotron_core::model::ModelConfig;
use std::collections::HashMap;
use std::ops::Range;

pub use crate::transformer::units_of;

use crate::pieces::push_padded_piece;
pub(crate) use crate::pieces::{owned, piece};

/// Rank `rank`'s piece of each tensor, padded, concatenated.
fn own_pieces(tensors: &[&[f32]], dp: usize, rank: usize) -> Vec<f32> {
    // Sized once (a collected flat_map would grow by doubling, copying itself).
    let n = tensors.iter().map(|t| piece(t.len(), dp, rank).len()).sum();
    let mut out = Vec::with_capacity(n);
    tensors
        .iter()
        .for_each(|t| push_padded_piece(&mut out, t, dp, rank));
    out
}

/// What a rank owns of one tensor of its shard: the range of the flattened tensor, and there the f32
/// master values and the Adam moments.
pub struct OwnedState {
    pub flat: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

/// One device's parameters, gradients and optimizer state under ZeRO stage `stage` over `dp` replicas.
pub struct ZeroState {
    pub stage: u8,
    dp: usize,
    dp_rank: usize,
    dp_group: Group,
    /// Every tensor whole (ZeRO 0–2); under ZeRO-3 empty except while its unit is gathered.
    params: ParamStore,
    /// Whole gradients (ZeRO 0–1, accumulated over the step); under ZeRO-2/3 empty except while a
    /// unit's backward runs.
    grads: ParamStore,
    /// ZeRO-3: this rank's pieces of the parameters, the only lasting copy.
    param_pieces: Vec<Vec<f32>>,
    /// ZeRO-2/3: this rank's pieces of the step's reduced gradients (ZeRO-1 files its reduced
    /// pieces in place, in the whole gradients).
    grad_pieces: Vec<Vec<f32>>,
    /// Tensor indices of each unit this device holds.
    units: HashMap<Unit, Vec<usize>>,
    /// Per tensor: unit visits with gradients still to come this step, and whether it was reduced.
    visits_left: Vec<usize>,
    visits_per_step: Vec<usize>,
    reduced: Vec<bool>,
    /// The bucket being reduced in the background (ZeRO 0–1) and its tensors.
    in_flight: Option<(Vec<usize>, Pending<f32>)>,
    opt: AdamW,
    /// Mixed precision: 16-bit weights and gradients, f32 master weights (then `params` is only the
    /// executor's per-unit f32 view and `grads` its per-unit f32 scratch).
    half: Option<HalfStore>,
    /// Mixed precision under an asynchronous schedule: `params` holds the whole view of the current
    /// weight version (rebuilt after each update), which forwards read and stashes keep.
    version_view: bool,
    /// The device has the process's cores to itself: its optimizer step uses them.
    threaded_update: bool,
    /// ZeRO-3: gather the pass's next unit while this one computes (on unless a benchmark compares).
    prefetch_enabled: bool,
    /// ZeRO-3 prefetch: the units the current pass has still to ask for, the gather in flight, and
    /// the unit a finished prefetch made present.
    pass: std::collections::VecDeque<Unit>,
    prefetch: Option<(Unit, Pending<f32>)>,
    present: Option<Unit>,
    /// ZeRO-2/3: the unit gradients whose pieces are on their way to their owners (see
    /// `reduce.rs::scatter_grads`), and how many such reductions this device has started.
    scatter: Option<reduce::ScatterInFlight>,
    scatters_started: u64,
}

/// The 16-bit state, in its format.
enum HalfStore {
    Bf16(HalfParts<half::bf16>),
    F16(HalfParts<half::f16>),
}

/// Runs `$body` with `$p` bound to the 16-bit state (by reference, as `$store` is), whatever its
/// format.
macro_rules! with_half {
    ($store:expr, $p:ident => $body:expr) => {
        match $store {
            $crate::parallel::data::HalfStore::Bf16($p) => $body,
            $crate::parallel::data::HalfStore::F16($p) => $body,
        }
    };
}

mod asynchronous;
mod gather;
mod grouped;
mod reduce;
mod residency;
mod update;
mod whole;

pub use asynchronous::{GroupedUpdateGrads, VersionResidency};
pub use grouped::{GroupedResidency, GroupedZero};
pub use residency::ZeroResidency;

/// Which tensors each unit of `cfg` reaches (a unit is what the executor asks for at once), and
/// how many times a step visits each tensor (once per unit per micro-batch).
fn unit_index(
    cfg: &ModelConfig,
    params: &ParamStore,
    micro_batches: usize,
) -> (HashMap<Unit, Vec<usize>>, Vec<usize>) {
    let mut units: HashMap<Unit, Vec<usize>> = HashMap::new();
    let mut visits_per_step = vec![0; params.specs.len()];
    for (i, spec) in params.specs.iter().enumerate() {
        for u in units_of(cfg, &spec.name) {
            units.entry(u).or_default().push(i);
            visits_per_step[i] += micro_batches;
        }
    }
    (units, visits_per_step)
}

/// Adam's moments for what this rank updates: every element, or with `shard = Some((dp, rank))`
/// its piece of each tensor; counted as optimizer state.
fn moments(
    adam: crate::optim::AdamWConfig,
    params: &ParamStore,
    shard: Option<(usize, usize)>,
) -> AdamW {
    let _states = memory::scope(Term::OptimizerStates);
    let sizes = params.tensors.iter().map(|t| match shard {
        Some((dp, rank)) => piece(t.len(), dp, rank).len(),
        None => t.len(),
    });
    let shapes =
        ParamStore::from_tensors(params.specs.clone(), sizes.map(|n| vec![0f32; n]).collect());
    let mut opt = AdamW::new(adam, &shapes);
    drop(shapes);
    opt.shrink();
    // Fault the moments in now, not in the first update (an asynchronous schedule's is an action).
    opt.m
        .iter_mut()
        .chain(opt.v.iter_mut())
        .for_each(|t| t.fill(0.0));
    opt
}

impl ZeroState {
    /// Takes over the device's shard `params`; `micro_batches` backward passes accumulate per step;
    /// `storage` is the 16-bit format under mixed precision.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ModelConfig,
        params: ParamStore,
        stage: u8,
        dp_group: Group,
        dp_rank: usize,
        micro_batches: usize,
        adam: crate::optim::AdamWConfig,
        storage: Option<ferrotron_core::precision::Half>,
    ) -> Self {
        let dp = dp_group.size();
        let (units, visits_per_step) = unit_index(cfg, &params, micro_batches);
        let pieces = |store: &ParamStore| -> Vec<Vec<f32>> {
            store
                .tensors
                .iter()
                .map(|t| {
                    let r = piece(t.len(), dp, dp_rank);
                    let mut p = vec![0f32; r.len()];
                    let end = r.end.min(t.len());
                    if r.start < end {
                        p[..end - r.start].copy_from_slice(&t[r.start..end]);
                    }
                    p
                })
                .collect()
        };
        let opt = moments(
            adam,
            &params,
            (stage >= 1 && dp > 1).then_some((dp, dp_rank)),
        );
        let mut param_pieces = Vec::new();
        let mut params = params;
        let n = params.specs.len();
        let (grads, grad_pieces, half) = match storage {
            Some(h) => {
                let half = match h {
                    ferrotron_core::precision::Half::Bf16 => {
                        HalfStore::Bf16(HalfParts::new(&mut params, stage, dp, dp_rank))
                    }
                    ferrotron_core::precision::Half::F16 => {
                        HalfStore::F16(HalfParts::new(&mut params, stage, dp, dp_rank))
                    }
                };
                // The executor's f32 gradients exist per unit only (scratch).
                let scratch = ParamStore::from_tensors(params.specs.clone(), vec![Vec::new(); n]);
                (scratch, Vec::new(), Some(half))
            }
            None => {
                if stage == 3 && dp > 1 {
                    let _weights = memory::scope(Term::Weights);
                    param_pieces = pieces(&params);
                    params.tensors.iter_mut().for_each(|t| *t = Vec::new());
                }
                let mut grads = ParamStore::empty(params.specs.clone());
                let _grads_term = memory::scope(Term::Gradients);
                if stage < 2 || dp == 1 {
                    // Faulted in now, not in the first backward.
                    grads.allocate_zeroed();
                }
                let grad_pieces = if stage >= 2 && dp > 1 {
                    params
                        .specs
                        .iter()
                        .map(|s| vec![0f32; piece(s.numel(), dp, dp_rank).len()])
                        .collect()
                } else {
                    Vec::new()
                };
                (grads, grad_pieces, None)
            }
        };
        Self {
            stage,
            dp,
            dp_rank,
            dp_group,
            params,
            grads,
            param_pieces,
            grad_pieces,
            units,
            visits_left: visits_per_step.clone(),
            visits_per_step,
            reduced: vec![false; n],
            in_flight: None,
            opt,
            half,
            version_view: false,
            threaded_update: false,
            prefetch_enabled: true,
            pass: Default::default(),
            prefetch: None,
            present: None,
            scatter: None,
            scatters_started: 0,
        }
    }

    /// ZeRO-3 prefetch on or off (off: every unit is gathered when asked for, nothing overlaps).
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch_enabled = on;
    }

    /// Lets the optimizer step use the process's cores (a device alone in its process).
    pub fn set_threaded_update(&mut self, threaded: bool) {
        self.threaded_update = threaded;
    }

    pub(super) fn sharded(&self) -> bool {
        self.stage >= 1 && self.dp > 1
    }

    /// The parameter specs of the device's shard.
    pub fn specs(&self) -> Vec<ferrotron_core::model::ParamSpec> {
        self.params.specs.clone()
    }

    /// Starts a step: gradients zeroed, every tensor waiting for its contributions.
    pub fn begin_step(&mut self) {
        if let Some(h) = &mut self.half {
            with_half!(h, p => p.begin_step());
            return;
        }
        if self.stage < 2 || self.dp == 1 {
            let g = &mut self.grads;
            if self.threaded_update {
                // A device with the cores to itself zeroes on all of them.
                use rayon::prelude::*;
                g.tensors
                    .par_iter_mut()
                    .flat_map(|t| t.par_chunks_mut(1 << 16))
                    .for_each(|c| c.fill(0.0));
            } else {
                g.tensors.iter_mut().for_each(|t| t.fill(0.0));
            }
        }
        self.grad_pieces.iter_mut().for_each(|p| p.fill(0.0));
        self.visits_left.clone_from(&self.visits_per_step);
        self.reduced.fill(false);
    }

    /// A residency for the executor over this state, with the device's communicator.
    pub fn residency<'s, 'c, C: Comm>(
        &'s mut self,
        tpg: &'s TpGroup<'c, C>,
    ) -> ZeroResidency<'s, 'c, C> {
        ZeroResidency { state: self, tpg }
    }

    /// The gradients this rank holds after the reduction, by tensor: whole (no sharding) or the
    /// part it owns (the same part of each tensor on every device that shares the layout).
    pub fn with_grad_view<R>(&mut self, f: impl FnOnce(&mut [&mut [f32]]) -> R) -> R {
        let (dp, dp_rank) = (self.dp, self.dp_rank);
        if let Some(h) = &mut self.half {
            return with_half!(h, parts => {
                let mut view: Vec<&mut [f32]> =
                    parts.main.iter_mut().map(|g| g.as_mut_slice()).collect();
                f(&mut view)
            });
        }
        if self.stage >= 2 && self.dp > 1 {
            let pieces = &mut self.grad_pieces;
            let mut view: Vec<&mut [f32]> = pieces.iter_mut().map(|p| p.as_mut_slice()).collect();
            f(&mut view)
        } else if self.sharded() {
            let g = &mut self.grads;
            let mut view: Vec<&mut [f32]> = g
                .tensors
                .iter_mut()
                .map(|t| {
                    let own = owned(t.len(), dp, dp_rank);
                    &mut t[own]
                })
                .collect();
            f(&mut view)
        } else {
            let g = &mut self.grads;
            let mut view: Vec<&mut [f32]> =
                g.tensors.iter_mut().map(|t| t.as_mut_slice()).collect();
            f(&mut view)
        }
    }

    /// Bytes of tensor `i`'s weights this device holds between steps (the weights term's): its
    /// 16-bit compute copy under mixed precision, its ZeRO-3 piece, or the whole f32 tensor.
    pub fn weight_bytes(&self, i: usize) -> usize {
        if let Some(h) = &self.half {
            return with_half!(h, p => p.weight_bytes(i));
        }
        if self.stage >= 3 && self.dp > 1 {
            4 * self.param_pieces[i].len()
        } else {
            4 * self.params.tensors[i].len()
        }
    }

    /// Whether the gradient view holds pieces (a share of each tensor) rather than whole tensors.
    pub fn grads_sharded(&self) -> bool {
        self.sharded()
    }
}

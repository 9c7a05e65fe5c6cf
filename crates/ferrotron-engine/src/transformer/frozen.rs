//! A frozen base model (LoRA): the parameters a chunk of the executor reads but never trains. It has
//! no gradients, no optimizer state and no master copy; under mixed precision it is stored in 16
//! bits and widened one unit at a time while that unit computes, as the trained weights are.

use super::kept::{Half, Kept};
use super::residency::{units_of, Unit};
use super::ParamStore;
use crate::kernels::CpuBackend;
use crate::memory::{self, Term};
use ferrotron_core::model::ModelConfig;
use std::collections::HashMap;

pub struct FrozenBase {
    /// The tensors in f32, or (16-bit storage) their names and shapes with empty tensors.
    store: ParamStore,
    /// 16-bit storage: every tensor, rounded.
    half: Option<Vec<Kept>>,
    /// The tensors each unit reads.
    units: HashMap<Unit, Vec<usize>>,
}

impl FrozenBase {
    /// Takes `store` (the base parameters a chunk holds), kept in f32 or rounded to `storage`.
    pub fn new(cfg: &ModelConfig, store: ParamStore, storage: Option<Half>) -> Self {
        let mut units: HashMap<Unit, Vec<usize>> = HashMap::new();
        for (i, spec) in store.specs.iter().enumerate() {
            for u in units_of(cfg, &spec.name) {
                units.entry(u).or_default().push(i);
            }
        }
        let (store, half) = match storage {
            None => (store, None),
            Some(h) => {
                let _weights = memory::scope(Term::Weights);
                let half = store
                    .tensors
                    .iter()
                    .map(|t| Kept::keep(&CpuBackend::single_threaded(), t.clone(), Some(h)))
                    .collect();
                let empty = vec![Vec::new(); store.specs.len()];
                (ParamStore::from_tensors(store.specs, empty), Some(half))
            }
        };
        Self { store, half, units }
    }

    /// The names and shapes of the tensors (what the executor resolves its indices against).
    pub fn names(&self) -> &ParamStore {
        &self.store
    }

    /// Bytes the base holds.
    pub fn bytes(&self) -> usize {
        match &self.half {
            Some(h) => h.iter().map(Kept::bytes).sum(),
            None => 4 * self.store.numel(),
        }
    }

    /// Runs `f` with `unit`'s base tensors present in f32.
    pub fn with_unit(&self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        let Some(half) = &self.half else {
            return f(&self.store);
        };
        // The widened unit is a transient working copy, as a 16-bit trained unit's f32 view is.
        let _buffers = memory::scope(Term::CommBuffers);
        let mut view = ParamStore::from_tensors(
            self.store.specs.clone(),
            vec![Vec::new(); self.store.specs.len()],
        );
        for &i in self.units.get(&unit).map_or(&[][..], Vec::as_slice) {
            view.tensors[i] = half[i].get(&CpuBackend::single_threaded()).into_owned();
        }
        f(&view)
    }
}

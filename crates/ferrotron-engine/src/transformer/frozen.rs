//! A frozen base model (LoRA): the parameters a chunk of the executor reads but never trains. It has
//! no gradients, no optimizer state and no master copy; under mixed precision it is stored in 16
//! bits, and as the trained weights are: under bf16 its matrices are read by the kernels as they
//! are, the rest (and every tensor under f16) widened one unit at a time while that unit computes.
//! A QLoRA base's projections stay NF4 under every precision: the GEMM dequantizes them tile by
//! tile.

use super::kept::Kept;
use super::residency::{units_of, Unit};
use super::ParamStore;
use crate::kernels::{bf16_convert, CpuBackend};
use crate::memory::{self, Term};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::Half;
use std::collections::HashMap;
use std::sync::Arc;

pub struct FrozenBase {
    /// The tensors in f32, or (16-bit storage) their names and shapes with empty tensors.
    store: ParamStore,
    /// 16-bit storage: every tensor, rounded (under bf16 a matrix is shared with the views instead,
    /// and `Empty` here).
    half: Option<Vec<Kept>>,
    /// bf16 storage: the matrices, which the executor's views share.
    matrices: Vec<Option<Arc<Vec<half::bf16>>>>,
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
        let mut matrices = vec![None; store.specs.len()];
        let (store, half) = match storage {
            None => (store, None),
            Some(h) => {
                let _weights = memory::scope(Term::Weights);
                let be = CpuBackend::single_threaded();
                let half = store
                    .tensors
                    .iter()
                    .zip(&store.specs)
                    .zip(matrices.iter_mut())
                    .zip(&store.nf4)
                    .map(|(((t, spec), shared), quantized)| {
                        if quantized.is_some() {
                            Kept::Empty
                        } else if h == Half::Bf16 && spec.shape.len() == 2 {
                            *shared = Some(Arc::new(bf16_convert::rounded(t)));
                            Kept::Empty
                        } else {
                            Kept::keep(&be, t.clone(), Some(h))
                        }
                    })
                    .collect();
                let empty = vec![Vec::new(); store.specs.len()];
                let mut names = ParamStore::from_tensors(store.specs, empty);
                names.nf4 = store.nf4;
                (names, Some(half))
            }
        };
        Self {
            store,
            half,
            matrices,
            units,
        }
    }

    /// The names and shapes of the tensors (what the executor resolves its indices against).
    pub fn names(&self) -> &ParamStore {
        &self.store
    }

    /// Bytes the base holds.
    pub fn bytes(&self) -> usize {
        let quantized: usize = self.store.nf4.iter().flatten().map(|m| m.bytes()).sum();
        quantized
            + match &self.half {
                Some(h) => {
                    let shared: usize = self.matrices.iter().flatten().map(|m| 2 * m.len()).sum();
                    h.iter().map(Kept::bytes).sum::<usize>() + shared
                }
                None => 4 * self.store.numel(),
            }
    }

    /// Runs `f` with `unit`'s base tensors present in f32.
    pub fn with_unit(&self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        let Some(half) = &self.half else {
            return f(&self.store);
        };
        // The widened unit is a transient working copy, as a 16-bit trained unit's f32 view is
        // (what the unit then computes counts as what it is).
        let view = {
            let _buffers = memory::scope(Term::CommBuffers);
            let mut view = ParamStore::from_tensors(
                self.store.specs.clone(),
                vec![Vec::new(); self.store.specs.len()],
            );
            for &i in self.units.get(&unit).map_or(&[][..], Vec::as_slice) {
                match (&self.store.nf4[i], &self.matrices[i]) {
                    (Some(q), _) => view.nf4[i] = Some(Arc::clone(q)),
                    (None, Some(m)) => view.bf16[i] = Some(Arc::clone(m)),
                    (None, None) => {
                        view.tensors[i] = half[i].get(&CpuBackend::single_threaded()).into_owned()
                    }
                }
            }
            view
        };
        f(&view)
    }
}

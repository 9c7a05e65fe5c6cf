//! A frozen base model (LoRA): the parameters a chunk of the executor reads but never trains. It has
//! no gradients, no optimizer state and no master copy; under mixed precision it is stored in 16
//! bits, and as the trained weights are: under bf16 its matrices are read by the kernels as they
//! are, the rest (and every tensor under f16) widened one unit at a time while that unit computes.
//! A QLoRA base's projections stay NF4 under every precision: the linear layer dequantizes them a
//! panel at a time. Under ZeRO-3 their 4-bit codes are sharded over the replicas as the trained
//! parameters are, and a unit's are all-gathered just before it computes
//! ([`FrozenBase::gather_unit`]); the quantization constants (1/32 of the codes' bytes) stay whole.

use super::kept::Kept;
use super::residency::{units_of, Unit};
use super::ParamStore;
use crate::comm::{Comm, CommError, Group};
use crate::kernels::nf4::Nf4Matrix;
use crate::kernels::{bf16_convert, CpuBackend};
use crate::memory::{self, Term};
use crate::pieces::{from_gathered, padded_piece};
use ferrotron_core::model::{ModelConfig, ParamSpec};
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
    /// ZeRO-3 over the replicas: each quantized matrix's constants and this rank's piece of its
    /// codes (the matrix itself is then not in `store`).
    sharded: Option<ShardedCodes>,
}

/// The NF4 codes of the base cut over `dp` replicas: per tensor, the matrix without its codes,
/// this rank's piece (padded) and the codes' whole length.
struct ShardedCodes {
    dp: usize,
    pieces: Vec<Option<(Nf4Matrix, Vec<u8>, usize)>>,
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
            sharded: None,
        }
    }

    /// ZeRO-3: keeps only this rank's piece (of `dp`) of every NF4 matrix's codes; the units'
    /// codes are then gathered as they compute ([`FrozenBase::gather_unit`]).
    pub fn shard_codes(mut self, dp: usize, rank: usize) -> Self {
        if dp < 2 || !self.store.is_quantized() {
            return self;
        }
        let _weights = memory::scope(Term::Weights);
        let pieces = self
            .store
            .nf4
            .iter_mut()
            .map(|q| {
                let q = q.take()?;
                let (shell, codes) = Arc::unwrap_or_clone(q).split_codes();
                Some((shell, padded_piece(&codes, dp, rank), codes.len()))
            })
            .collect();
        self.sharded = Some(ShardedCodes { dp, pieces });
        self
    }

    /// Whether `unit` reads sharded codes, so must be gathered ([`FrozenBase::gather_unit`]).
    pub fn needs_gather(&self, unit: Unit) -> bool {
        self.sharded
            .as_ref()
            .is_some_and(|s| self.unit_ids(unit).iter().any(|&i| s.pieces[i].is_some()))
    }

    /// The base tensors `unit` reads with its NF4 codes all-gathered from every replica of `group`
    /// (ZeRO-3). Without a communicator (an earlier collective failed), or when the gather fails,
    /// every code is NF4's zero: the step fails on the error, and what it computed meanwhile is
    /// discarded.
    pub fn gather_unit<C: Comm>(
        &self,
        c: Option<&mut C>,
        group: &Group,
        unit: Unit,
    ) -> (ParamStore, Result<(), CommError>) {
        let Some(sh) = &self.sharded else {
            unreachable!("gather_unit without sharded codes: see needs_gather")
        };
        let ids: Vec<usize> = self
            .unit_ids(unit)
            .iter()
            .copied()
            .filter(|&i| sh.pieces[i].is_some())
            .collect();
        // The gathered codes are a transient buffer, as a ZeRO-3 unit's gathered parameters are.
        let _buffers = memory::scope(Term::CommBuffers);
        let mine: Vec<u8> = ids
            .iter()
            .flat_map(|&i| sh.pieces[i].as_ref().map_or(&[][..], |p| &p.1[..]))
            .copied()
            .collect();
        let mut all = vec![0u8; mine.len() * sh.dp];
        let done = match c {
            Some(c) => c.all_gather(group, &mine, &mut all),
            None => Err(CommError::Usage("an earlier collective failed".into())),
        };
        if done.is_err() {
            // Two codes 7 a byte: NF4's 0.
            all.fill(0x77);
        }
        let (block, mut at) = (mine.len(), 0);
        let gathered = ids
            .iter()
            .map(|&i| {
                let (shell, piece, len) = sh.pieces[i].as_ref().expect("a sharded matrix");
                let codes = from_gathered(&all, sh.dp, block, at, *len);
                at += piece.len();
                (i, Arc::new(Nf4Matrix::with_codes(shell, codes)))
            })
            .collect();
        drop(all);
        (self.view(unit, gathered), done)
    }

    fn unit_ids(&self, unit: Unit) -> &[usize] {
        self.units.get(&unit).map_or(&[][..], Vec::as_slice)
    }

    /// The names and shapes of the tensors (what the executor resolves its indices against).
    pub fn names(&self) -> &ParamStore {
        &self.store
    }

    /// Bytes the base holds.
    pub fn bytes(&self) -> usize {
        self.bytes_where(&|_| true)
    }

    /// Bytes the base holds of the tensors `which` selects: a QLoRA projection's quantized form
    /// (under ZeRO-3 its shell and this rank's piece of the codes), under 16-bit storage each
    /// tensor's kept form (a bf16 matrix shared with the views), else the f32 tensor.
    pub fn bytes_where(&self, which: &dyn Fn(&ParamSpec) -> bool) -> usize {
        let mut total = 0;
        for (i, _) in self
            .store
            .specs
            .iter()
            .enumerate()
            .filter(|(_, s)| which(s))
        {
            if let Some((shell, piece, _)) =
                self.sharded.as_ref().and_then(|s| s.pieces[i].as_ref())
            {
                total += shell.bytes() + piece.len();
            }
            total += self.store.nf4[i].as_ref().map_or(0, |m| m.bytes());
            total += match &self.half {
                Some(h) => h[i].bytes() + self.matrices[i].as_ref().map_or(0, |m| 2 * m.len()),
                None => 4 * self.store.tensors[i].len(),
            };
        }
        total
    }

    /// Runs `f` with `unit`'s base tensors present in f32 (a unit of sharded codes is gathered
    /// instead, [`FrozenBase::gather_unit`]).
    pub fn with_unit(&self, unit: Unit, f: &mut dyn FnMut(&ParamStore)) {
        assert!(
            !self.needs_gather(unit),
            "a ZeRO-3 base's codes are gathered through its residency"
        );
        if self.half.is_none() {
            return f(&self.store);
        }
        f(&self.view(unit, Vec::new()))
    }

    /// `unit`'s tensors as the executor reads them: the NF4 matrices in `gathered` (index,
    /// matrix) or in the store, 16-bit tensors shared or widened, f32 ones as they are.
    fn view(&self, unit: Unit, gathered: Vec<(usize, Arc<Nf4Matrix>)>) -> ParamStore {
        // The widened unit is a transient working copy, as a 16-bit trained unit's f32 view is
        // (what the unit then computes counts as what it is).
        let _buffers = memory::scope(Term::CommBuffers);
        let mut view = ParamStore::from_tensors(
            self.store.specs.clone(),
            vec![Vec::new(); self.store.specs.len()],
        );
        for &i in self.unit_ids(unit) {
            match (&self.store.nf4[i], &self.matrices[i], &self.half) {
                (Some(q), ..) => view.nf4[i] = Some(Arc::clone(q)),
                (None, Some(m), _) => view.bf16[i] = Some(Arc::clone(m)),
                (None, None, Some(half)) => {
                    view.tensors[i] = half[i].get(&CpuBackend::single_threaded()).into_owned()
                }
                (None, None, None) => view.tensors[i].clone_from(&self.store.tensors[i]),
            }
        }
        for (i, q) in gathered {
            view.nf4[i] = Some(q);
        }
        view
    }
}

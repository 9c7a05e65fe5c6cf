//! Named parameter tensors (Hugging Face names and shapes), held as f32 for compute.

use crate::kernels::nf4::Nf4Matrix;
use crate::kernels::Matrix;
use ferrotron_core::model::{is_projection_weight, ModelConfig, ParamSpec, WeightLayout};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use std::collections::HashMap;
use std::sync::Arc;

/// One tensor per parameter, in the order of [`ModelConfig::param_specs`].
#[derive(Debug, Clone, PartialEq)]
pub struct ParamStore {
    pub specs: Vec<ParamSpec>,
    pub tensors: Vec<Vec<f32>>,
    /// Under bf16 compute, a matrix's bf16 compute copy, shared with the mixed-precision state that
    /// owns it (its f32 tensor is then empty): the GEMM reads it as it is.
    pub bf16: Vec<Option<Arc<Vec<half::bf16>>>>,
    /// A QLoRA base: a projection's weight quantized to NF4 (`[out, in]`, whatever the checkpoint's
    /// layout; its f32 tensor is then empty).
    pub nf4: Vec<Option<Arc<Nf4Matrix>>>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    pub fn zeros(specs: Vec<ParamSpec>) -> Self {
        let tensors = specs.iter().map(|s| vec![0.0; s.numel()]).collect();
        Self::from_tensors(specs, tensors)
    }

    /// A store of `specs` without storage: the bookkeeping (names, shapes, index) alone, made
    /// before a memory account's scope so that the scope counts the tensors alone.
    pub fn empty(specs: Vec<ParamSpec>) -> Self {
        let n = specs.len();
        Self::from_tensors(specs, vec![Vec::new(); n])
    }

    /// Allocates every tensor zeroed and writes it now (its pages in memory before first use).
    pub fn allocate_zeroed(&mut self) {
        for (t, s) in self.tensors.iter_mut().zip(&self.specs) {
            *t = vec![0.0; s.numel()];
            t.fill(0.0);
        }
    }

    /// A store of `tensors` named and shaped by `specs` (a shard's pieces may be any length).
    pub fn from_tensors(specs: Vec<ParamSpec>, tensors: Vec<Vec<f32>>) -> Self {
        assert_eq!(specs.len(), tensors.len(), "one tensor per spec");
        let index = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        let bf16 = vec![None; specs.len()];
        let nf4 = vec![None; specs.len()];
        Self {
            specs,
            tensors,
            bf16,
            nf4,
            index,
        }
    }

    /// Tensor `i` as a matrix (a linear layer's weight, an embedding table): its bf16 compute copy
    /// where there is one.
    pub fn matrix(&self, i: usize) -> Matrix<'_> {
        match (&self.nf4[i], &self.bf16[i]) {
            (Some(w), _) => Matrix::Nf4(w),
            (None, Some(w)) => Matrix::Bf16(w),
            (None, None) => Matrix::F32(&self.tensors[i]),
        }
    }

    /// Quantizes every projection weight to NF4 (a QLoRA base), one tensor at a time: each f32
    /// tensor is freed as soon as its quantized form exists.
    pub fn quantize_nf4(&mut self, cfg: &ModelConfig) {
        for i in 0..self.specs.len() {
            self.quantize_tensor_nf4(cfg, i);
        }
    }

    /// Quantizes tensor `i` to NF4 if it is a projection's weight (what transformers' 4-bit loading
    /// quantizes), freeing its f32 values. A Conv1D weight (`[in, out]`) is transposed first, as
    /// transformers does.
    pub fn quantize_tensor_nf4(&mut self, cfg: &ModelConfig, i: usize) {
        let spec = &self.specs[i];
        if !is_projection_weight(cfg, &spec.name) || self.nf4[i].is_some() {
            return;
        }
        let t = std::mem::take(&mut self.tensors[i]);
        let (r, c) = (spec.shape[0], spec.shape[1]);
        let m = match spec.layout {
            WeightLayout::InOut => Nf4Matrix::quantize(&transposed(&t, r, c), c, r),
            _ => Nf4Matrix::quantize(&t, r, c),
        };
        self.nf4[i] = Some(Arc::new(m));
    }

    /// The store with every NF4 tensor dequantized to f32, in its checkpoint layout.
    pub fn dequantized(&self) -> Self {
        let mut out = self.clone();
        for (i, q) in self.nf4.iter().enumerate() {
            let Some(q) = q else { continue };
            let w = q.dequantized();
            out.tensors[i] = match self.specs[i].layout {
                WeightLayout::InOut => transposed(&w, q.rows, q.cols),
                _ => w,
            };
            out.nf4[i] = None;
        }
        out
    }

    /// Whether any tensor is NF4.
    pub fn is_quantized(&self) -> bool {
        self.nf4.iter().any(Option::is_some)
    }

    /// The store as bf16 compute reads it (a reference's compute copy): matrices rounded to bf16 and
    /// shared with the GEMM as they are, norm weights and biases rounded and widened back.
    pub fn bf16_compute_copy(&self) -> Self {
        use crate::kernels::bf16_convert::{rounded, widened};
        let mut out = Self::from_tensors(self.specs.clone(), vec![Vec::new(); self.specs.len()]);
        for (i, t) in self.tensors.iter().enumerate() {
            if self.specs[i].shape.len() == 2 {
                out.bf16[i] = Some(Arc::new(rounded(t)));
            } else {
                out.tensors[i] = widened(&rounded(t));
            }
        }
        out
    }

    pub fn zeros_like(&self) -> Self {
        Self::zeros(self.specs.clone())
    }

    /// Fresh weights as Hugging Face initialises these models: normal(0, 0.02) matrices and
    /// embeddings, unit norm weights, zero biases. Deterministic in `seed`.
    pub fn init_random(cfg: &ModelConfig, seed: u64) -> Self {
        let mut store = Self::zeros(cfg.param_specs());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let normal = Normal::new(0.0f32, 0.02).expect("valid normal");
        for (spec, t) in store.specs.iter().zip(store.tensors.iter_mut()) {
            let is_norm = spec.name.contains("norm") || spec.name.contains(".ln_");
            if spec.name.ends_with(".bias") {
                continue;
            } else if is_norm {
                t.fill(1.0);
            } else {
                t.iter_mut().for_each(|x| *x = normal.sample(&mut rng));
            }
        }
        store
    }

    /// A store of the parameters `keep` selects, copied.
    pub fn subset(&self, keep: impl Fn(&str) -> bool) -> Self {
        let picked: Vec<usize> = (0..self.specs.len())
            .filter(|&i| keep(&self.specs[i].name))
            .collect();
        let mut out = Self::from_tensors(
            picked.iter().map(|&i| self.specs[i].clone()).collect(),
            picked.iter().map(|&i| self.tensors[i].clone()).collect(),
        );
        for (k, &i) in picked.iter().enumerate() {
            out.nf4[k].clone_from(&self.nf4[i]);
        }
        out
    }

    /// Splits the store in two, moving its tensors (no copies): those `pick` selects, and the
    /// rest; each with the store indices its tensors had.
    pub fn split(self, pick: impl Fn(&str) -> bool) -> [(Self, Vec<usize>); 2] {
        let picked: Vec<bool> = self.specs.iter().map(|s| pick(&s.name)).collect();
        let mut tensors: Vec<Option<Vec<f32>>> = self.tensors.into_iter().map(Some).collect();
        let mut nf4: Vec<Option<Option<Arc<Nf4Matrix>>>> = self.nf4.into_iter().map(Some).collect();
        let specs = self.specs;
        [true, false].map(|side| {
            let at: Vec<usize> = (0..specs.len()).filter(|&i| picked[i] == side).collect();
            let mut store = Self::from_tensors(
                at.iter().map(|&i| specs[i].clone()).collect(),
                at.iter()
                    .map(|&i| tensors[i].take().expect("moved once"))
                    .collect(),
            );
            store.nf4 = at
                .iter()
                .map(|&i| nf4[i].take().expect("moved once"))
                .collect();
            (store, at)
        })
    }

    pub fn id(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.id(name).map(|i| self.tensors[i].as_slice())
    }

    /// Parameters the store stands for, by their shapes (a quantized tensor's too).
    pub fn parameters(&self) -> usize {
        self.specs.iter().map(ParamSpec::numel).sum()
    }

    /// Values held in f32.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(Vec::len).sum()
    }

    pub fn zero_(&mut self) {
        self.tensors.iter_mut().for_each(|t| t.fill(0.0));
    }
}

/// The `[cols, rows]` transpose of the row-major `[rows, cols]` matrix `t`.
fn transposed(t: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; t.len()];
    for (r, row) in t.chunks_exact(cols.max(1)).enumerate() {
        row.iter()
            .enumerate()
            .for_each(|(c, &v)| out[c * rows + r] = v);
    }
    out
}

#![allow(dead_code)]
//! Shared helpers for the engine's integration tests.

#[allow(dead_code)]
mod run_metrics;
mod stale_dirs;
use ferrotron_core::model::ModelConfig;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::transformer::{ParamStore, TokenBatch, Transformer};
#[allow(unused_imports)]
pub use run_metrics::{metric_losses, metrics_records};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A fresh, empty directory for test `tag` of this test binary and process (the directories of
/// earlier runs of this binary removed first: see `stale_dirs.rs`).
pub fn temp_dir(tag: &str) -> PathBuf {
    let prefix = format!("ferrotron-{}-", env!("CARGO_CRATE_NAME"));
    stale_dirs::remove_stale(&prefix);
    let d = std::env::temp_dir().join(format!("{prefix}{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Term `term` measured (`got`) within 10% of the planner's (`want`) where either is at least 5%
/// of the device's `total` (#43's rule: the terms that decide whether a layout fits).
pub fn assert_term_near(what: &str, term: &str, (got, want): (u64, u64), total: u64) {
    if got.max(want) as f64 >= 0.05 * total as f64 {
        let e = (got as f64 / want.max(1) as f64 - 1.0).abs();
        assert!(
            e <= 0.10,
            "{what}: {term} measured {got} vs predicted {want}"
        );
    }
}

/// Every term of a device's measured peaks against the planner's by [`assert_term_near`].
pub fn assert_large_terms_near(
    what: &str,
    got: &ferrotron_core::plan::MemoryTerms,
    want: &ferrotron_core::plan::MemoryTerms,
) {
    for ((term, a), (_, w)) in got.terms().into_iter().zip(want.terms()) {
        assert_term_near(what, term, (a, w), got.total);
    }
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub struct Reference {
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    pub batch: TokenBatch,
    path: PathBuf,
}

impl Reference {
    pub fn load(model: &str) -> Self {
        Self::from_file(fixture(model).join("reference_grads.safetensors"))
    }

    /// The LoRA reference of `model` (`tests/fixtures/lora/<model>/lora_reference.safetensors`).
    pub fn lora(model: &str) -> Self {
        Self::from_file(
            fixture("lora")
                .join(model)
                .join("lora_reference.safetensors"),
        )
    }

    pub fn from_file(path: PathBuf) -> Self {
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let ids_view = st.tensor("input_ids").unwrap();
        let shape = ids_view.shape().to_vec();
        let ids: Vec<u32> = ids_view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            if name == "input_ids" {
                continue;
            }
            let data: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::F64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
                    .collect(),
                // Codes (a quantized base's), exact as f32.
                safetensors::Dtype::U8 => view.data().iter().map(|&b| b as f32).collect(),
                d => panic!("unexpected dtype {d:?}"),
            };
            tensors.insert(name, (view.shape().to_vec(), data));
        }
        let _ = hf::read_tensors_f32; // keep the public reader in use for other tests
        Reference {
            tensors,
            batch: TokenBatch {
                ids,
                batch: shape[0],
                seq: shape[1],
            },
            path,
        }
    }

    pub fn get(&self, name: &str) -> &[f32] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference lacks {name}"))
            .1
    }

    /// The f64 reference values, read at full precision.
    pub fn get_f64(&self, _model: &str, name: &str) -> Vec<f64> {
        let bytes = std::fs::read(&self.path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let v = st.tensor(name).unwrap();
        v.data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

/// The unsplit model's loss and every gradient on `batch`, on one thread.
pub fn unsplit(cfg: &ModelConfig, params: &ParamStore, batch: &TokenBatch) -> (f64, ParamStore) {
    let mut grads = params.zeros_like();
    let loss = Transformer::new(cfg, params).forward_backward(
        &CpuBackend::single_threaded(),
        params,
        &mut grads,
        batch,
    );
    (loss, grads)
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

pub fn rel_err_f64(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Worst per-tensor relative gradient error of `grads` against `grad_f32.<name>` in the reference.
pub fn worst_grad_err(grads: &ParamStore, reference: &Reference) -> (String, f64) {
    grads
        .specs
        .iter()
        .zip(&grads.tensors)
        .map(|(s, g)| {
            (
                s.name.clone(),
                rel_err(g, reference.get(&format!("grad_f32.{}", s.name))),
            )
        })
        .fold((String::new(), 0.0), |a, b| if b.1 > a.1 { b } else { a })
}

/// The loss's and every gradient's relative error of `got` against `want`: the worst, and where.
pub fn worst_run_err(
    got: &ferrotron_engine::parallel::PipelineRun,
    want: &ferrotron_engine::parallel::PipelineRun,
) -> (String, f64) {
    let loss = (got.loss - want.loss).abs() / want.loss.abs();
    got.grads
        .specs
        .iter()
        .zip(got.grads.tensors.iter().zip(&want.grads.tensors))
        .map(|(s, (g, w))| (s.name.clone(), rel_err(g, w)))
        .fold(
            ("loss".to_string(), loss),
            |a, b| if b.1 > a.1 { b } else { a },
        )
}

/// `batch` sequences of `seq` ids drawn uniformly from the vocabulary, deterministic in `seed`.
pub fn random_batch(vocab: usize, batch: usize, seq: usize, seed: u64) -> TokenBatch {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    TokenBatch {
        ids: (0..batch * seq)
            .map(|_| rng.gen_range(0..vocab as u32))
            .collect(),
        batch,
        seq,
    }
}

/// The planner's view of the engine: everything f32, the ferrotron activation model, this machine.
pub fn f32_plan_input(
    cfg: &ferrotron_core::model::ModelConfig,
    seq: usize,
    batch: usize,
) -> ferrotron_core::plan::PlanInput {
    use ferrotron_core::plan::{PlanInput, PlanModel, StateDtypes};
    let cluster = ferrotron_core::topology::Cluster::parse("this-machine").unwrap();
    PlanInput {
        precision: StateDtypes::parse("weights=fp32,grads=fp32,master=fp32,optimizer=fp32")
            .unwrap(),
        memory_reserve: 0.0,
        ..PlanInput::new(PlanModel::Shape(cfg.clone()), cluster, seq, batch)
    }
}

/// A LoRA model (its base, f32 or NF4, and PEFT's adapters) with its PEFT reference.
pub struct LoraCase {
    pub cfg: ModelConfig,
    pub base: ParamStore,
    pub adapters: ferrotron_engine::lora::Adapters,
    pub reference: Reference,
}

/// f32 tolerances against PEFT, as for the model's own gradients: PEFT's f32 and f64 adapter
/// gradients differ by a few 1e-6 per tensor, and an independent f32 implementation sums in other
/// orders.
pub const LORA_GRAD_TOL: f64 = 1e-5;
pub const LORA_LOSS_TOL: f64 = 1e-6;

/// The loss and every adapter gradient of `layout` against the reference's f32 values (PEFT's);
/// returns the worst relative gradient error.
pub fn check_lora(c: &LoraCase, model: &str, layout: &str) -> f64 {
    use ferrotron_core::model::PEFT_PREFIX;
    let parsed = ferrotron_core::layout::LayoutSpec::parse(layout)
        .unwrap()
        .layout;
    let trained = ferrotron_engine::transformer::Trained::lora(
        &c.base,
        &c.adapters.config,
        &c.adapters.params,
    );
    let (loss, grads, _) = ferrotron_engine::runtime::layout_step_of(
        &c.cfg,
        trained,
        &c.reference.batch,
        &parsed,
        &CpuBackend::default(),
    )
    .unwrap_or_else(|e| panic!("{model} {layout}: {e}"));
    let want = c.reference.get("loss_f32")[0] as f64;
    let loss_err = (loss - want).abs() / want;
    assert!(
        loss_err <= LORA_LOSS_TOL,
        "{model} {layout}: loss {loss} vs PEFT {want} ({loss_err:.2e})"
    );
    assert_eq!(grads.specs.len(), c.adapters.params.specs.len());
    let mut worst = 0f64;
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        let name = format!("grad_f32.{PEFT_PREFIX}{}", spec.name);
        let e = rel_err(g, c.reference.get(&name));
        assert!(
            e <= LORA_GRAD_TOL,
            "{model} {layout}: {} rel err {e:.3e}",
            spec.name
        );
        worst = worst.max(e);
    }
    println!("{model} {layout}: loss rel {loss_err:.1e}, worst adapter gradient {worst:.1e}");
    worst
}

/// The adapter gradients of the unsplit step against the reference's f64 values: the bound holds
/// against the exact gradients too.
pub fn check_lora_f64(c: &LoraCase, model: &str) {
    use ferrotron_core::model::PEFT_PREFIX;
    let trained = ferrotron_engine::transformer::Trained::lora(
        &c.base,
        &c.adapters.config,
        &c.adapters.params,
    );
    let (_, grads, _) = ferrotron_engine::runtime::layout_step_of(
        &c.cfg,
        trained,
        &c.reference.batch,
        &Default::default(),
        &CpuBackend::default(),
    )
    .unwrap();
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        let name = format!("grad_f64.{PEFT_PREFIX}{}", spec.name);
        let e = rel_err_f64(g, &c.reference.get_f64(model, &name));
        assert!(e <= LORA_GRAD_TOL, "{model}: {} vs f64 {e:.3e}", spec.name);
    }
}

/// A short fine-tuning run of `model` on `layout` for LoRA and QLoRA tests: the built-in corpus,
/// batch 8 × 32, peak learning rate `lr` warming up over 2 steps to a floor of 1e-3, clipping at 0.5,
/// no evaluation during the run. Adam's eps is 1e-6: at 1e-8, g/(|g| + eps) turns f32 rounding of
/// near-zero gradients into visible differences between layouts (as in data_parallel.rs). The
/// caller adds the adapters.
pub fn lora_run_config(
    tag: &str,
    model: &str,
    layout: &str,
    steps: usize,
    lr: f64,
) -> ferrotron_engine::runtime::TrainConfig {
    let corpus = temp_dir(&format!("{tag}-data")).join("manual.txt");
    std::fs::write(&corpus, &ferrotron_engine::data::BUILTIN_CORPUS[..80_000]).unwrap();
    let mut c = ferrotron_engine::runtime::TrainConfig::default();
    c.input.model = model.to_string();
    c.input.data = corpus.display().to_string();
    c.optimizer.steps = steps;
    c.optimizer.batch_size = 8;
    c.input.seq_len = 32;
    c.optimizer.lr = lr;
    c.optimizer.min_lr = 1e-3;
    c.optimizer.warmup_steps = 2;
    c.optimizer.adam_eps = 1e-6;
    c.optimizer.grad_clip = 0.5;
    c.logging.eval_every = 0;
    c.logging.eval_batches = 2;
    c.parallelism.layout = layout.parse().unwrap();
    c.checkpointing.out_dir = temp_dir(tag);
    c
}

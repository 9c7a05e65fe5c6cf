//! Data parallelism with ZeRO 0–3, composed with tensor and pipeline parallelism, computes the unsplit
//! step: loss and every gathered gradient, and the parameters after AdamW steps.

mod common;

use common::*;
use ferrotron_core::layout::{Layout, LayoutSpec};
use ferrotron_core::model::ModelConfig;
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::comm::ThreadWorld;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use ferrotron_engine::parallel::{pipeline_step, MeshStep};
use ferrotron_engine::transformer::{ParamStore, TokenBatch, Transformer};
use std::time::Duration;

const TOL: f64 = 1e-5;

const LAYOUTS: [&str; 4] = ["dp=2,tp=2,pp=2", "dp=4,pp=2", "dp=2,tp=4", "dp=8"];

#[test]
fn every_zero_stage_on_the_3d_mesh_gives_the_unsplit_gradients() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = random_batch(cfg.vocab_size, 8, 16, 3);
        let mut want = params.zeros_like();
        let want_loss = Transformer::new(&cfg, &params).forward_backward(
            &CpuBackend::single_threaded(),
            &params,
            &mut want,
            &batch,
        );
        for spec in LAYOUTS {
            for zero in 0..=3 {
                let l = LayoutSpec::parse(&format!("{spec},zero={zero},mbs=1"))
                    .unwrap()
                    .layout;
                let part = StagePartition::for_model(&cfg, l.pp * l.vpp).unwrap();
                let r = pipeline_step(&cfg, &params, &batch, &l, &part, Duration::from_secs(60))
                    .unwrap_or_else(|e| panic!("{model} {l}: {e}"));
                let e = (r.loss - want_loss).abs() / want_loss;
                assert!(e <= TOL, "{model} {l}: loss {e:e}");
                for (s, g) in r.grads.specs.iter().zip(&r.grads.tensors) {
                    let e = rel_err(g, want.get(&s.name).unwrap());
                    assert!(e <= TOL, "{model} {l}: {} {e:e}", s.name);
                }
            }
        }
    }
}

/// The unsplit reference: `steps` AdamW steps with global-norm clipping.
fn unsplit_training(
    cfg: &ModelConfig,
    params: &ParamStore,
    batches: &[TokenBatch],
    adam: AdamWConfig,
    lr: &LrSchedule,
    clip: f64,
) -> (Vec<f64>, ParamStore) {
    let be = CpuBackend::single_threaded();
    let mut p = params.clone();
    let mut opt = AdamW::new(adam, &p);
    let mut losses = Vec::new();
    for (k, b) in batches.iter().enumerate() {
        let mut g = p.zeros_like();
        losses.push(Transformer::new(cfg, &p).forward_backward(&be, &p, &mut g, b));
        clip_grad_norm(&mut g, clip);
        opt.step(&mut p, &g, lr.lr(k) as f32);
    }
    (losses, p)
}

/// The same steps on the mesh: returns the losses and the gathered parameters.
fn mesh_training(
    cfg: &ModelConfig,
    params: &ParamStore,
    batches: &[TokenBatch],
    l: &Layout,
    adam: AdamWConfig,
    lr: &LrSchedule,
    clip: f64,
) -> (Vec<f64>, ParamStore) {
    let part = StagePartition::for_model(cfg, l.pp * l.vpp).unwrap();
    let step = MeshStep::new(cfg, params, &batches[0], l, &part).unwrap();
    let world = step.world();
    let results = ThreadWorld::new(world)
        .timeout(Duration::from_secs(60))
        .run(|c| -> ferrotron_engine::error::Result<_> {
            let mut step = MeshStep::new(cfg, params, &batches[0], l, &part)?;
            let mut losses = Vec::new();
            let dev = step.train_device(
                c,
                batches.len(),
                &|k| batches[k].clone(),
                adam,
                lr,
                clip,
                &mut |_, _, _, r| {
                    losses.push(r.loss);
                    Ok(())
                },
            )?;
            let full = step.gather_params(c, &dev)?;
            Ok((losses, full))
        });
    let mut out = None;
    for (rank, r) in results.into_iter().enumerate() {
        let (losses, full) = r
            .unwrap()
            .unwrap_or_else(|e| panic!("{l} rank {rank}: {e}"));
        if rank == 0 {
            out = Some((losses, full.unwrap()));
        }
    }
    out.unwrap()
}

#[test]
fn five_adamw_steps_on_the_mesh_give_the_unsplit_parameters() {
    // Adam's update of an element is g/(|g| + eps) times the rate: where |g| is near eps its slope is
    // 1/(4·eps), so f32 rounding of a gradient near 1e-8 (the order of its tensor's rounding, ~1e-7
    // of the norm) moves that one element by a good part of the learning rate. With PyTorch's
    // eps = 1e-8 one such element of `o_proj` (gradient 2.7e-8 split vs 3.3e-8 unsplit; every other
    // element within 4e-9) makes the tensor differ by 1.5e-5 after one step at tp = 4. eps = 1e-6
    // (BERT's) keeps every element's update a smooth function of its gradient, which is what this
    // test is about: the split computes the same gradients, clipping and update.
    let adam = AdamWConfig {
        eps: 1e-6,
        ..AdamWConfig::default()
    };
    let lr = LrSchedule {
        peak_lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 2,
        total_steps: 5,
    };
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batches: Vec<TokenBatch> = (0..5)
            .map(|k| random_batch(cfg.vocab_size, 8, 16, 100 + k))
            .collect();
        // A clip below the gradients' norm, so that clipping acts on every step.
        let clip = 0.5;
        let (want_losses, want) = unsplit_training(&cfg, &params, &batches, adam, &lr, clip);
        for spec in LAYOUTS {
            for zero in 0..=3 {
                let l = LayoutSpec::parse(&format!("{spec},zero={zero},mbs=1"))
                    .unwrap()
                    .layout;
                let (losses, got) = mesh_training(&cfg, &params, &batches, &l, adam, &lr, clip);
                for (k, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
                    assert!(
                        (a - b).abs() / b <= TOL,
                        "{model} {l}: step {k} loss {a} vs {b}"
                    );
                }
                for (s, p) in got.specs.iter().zip(&got.tensors) {
                    let e = rel_err(p, want.get(&s.name).unwrap());
                    assert!(e <= TOL, "{model} {l}: {} after 5 steps {e:e}", s.name);
                }
            }
        }
    }
}

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
use ferrotron_engine::parallel::{pipeline_step, MeshStep, Training};
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
            let mut dev = step.train_device(
                c,
                &Training {
                    steps: batches.len(),
                    batch_of: &|k| batches[k].clone(),
                    adam,
                    lr,
                    clip,
                    stop: &|| false,
                },
                &mut |_, _, _, r| {
                    losses.push(r.loss);
                    Ok(())
                },
            )?;
            let full = step.gather_params(c, &mut dev)?;
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

#[test]
fn mixed_precision_composes_with_every_zero_stage_on_the_3d_mesh() {
    use ferrotron_core::precision::MixedPrecision;
    use ferrotron_engine::parallel::LossScaling;
    let adam = AdamWConfig::default();
    let lr = LrSchedule {
        peak_lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 1,
        total_steps: 5,
    };
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batches: Vec<TokenBatch> = (0..5)
        .map(|k| random_batch(cfg.vocab_size, 8, 16, 200 + k))
        .collect();
    let (want, _) = unsplit_training(&cfg, &params, &batches, adam, &lr, 1.0);
    let scaling = LossScaling {
        initial: 1024.0,
        growth_interval: 1000,
        inject_nonfinite_at: None,
    };
    for precision in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        for zero in 0..=3 {
            let l = LayoutSpec::parse(&format!("dp=2,tp=2,pp=2,zero={zero},mbs=1"))
                .unwrap()
                .layout;
            let part = StagePartition::for_model(&cfg, 2).unwrap();
            let results = ThreadWorld::new(8).timeout(Duration::from_secs(60)).run(
                |c| -> ferrotron_engine::error::Result<Vec<f64>> {
                    let mut step = MeshStep::new(&cfg, &params, &batches[0], &l, &part)?
                        .with_precision(precision)
                        .with_loss_scaling(scaling);
                    let mut losses = Vec::new();
                    step.train_device(
                        c,
                        &Training {
                            steps: 5,
                            batch_of: &|k| batches[k].clone(),
                            adam,
                            lr: &lr,
                            clip: 1.0,
                            stop: &|| false,
                        },
                        &mut |_, _, _, r| {
                            losses.push(r.loss);
                            Ok(())
                        },
                    )?;
                    Ok(losses)
                },
            );
            let losses = results.into_iter().next().unwrap().unwrap().unwrap();
            // 16-bit weights, gradients and activations: the losses follow f32 training closely.
            for (k, (a, b)) in losses.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() / b <= 5e-3,
                    "{precision:?} {l} step {k}: {a} vs f32 {b}"
                );
            }
        }
    }
}

#[test]
fn mixed_precision_moves_half_the_bytes() {
    use ferrotron_core::precision::MixedPrecision;
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = random_batch(cfg.vocab_size, 8, 16, 9);
    let lr = LrSchedule {
        peak_lr: 1e-3,
        min_lr: 1e-3,
        warmup_steps: 0,
        total_steps: 1,
    };
    let l = LayoutSpec::parse("dp=2,tp=2,pp=2,zero=1,mbs=1")
        .unwrap()
        .layout;
    let part = StagePartition::for_model(&cfg, 2).unwrap();
    let bytes = |precision: MixedPrecision| -> Vec<[u64; 3]> {
        ThreadWorld::new(8)
            .run(|c| -> ferrotron_engine::error::Result<[u64; 3]> {
                let mut step =
                    MeshStep::new(&cfg, &params, &batch, &l, &part)?.with_precision(precision);
                let mut sent = [0; 3];
                step.train_device(
                    c,
                    &Training {
                        steps: 1,
                        batch_of: &|_| batch.clone(),
                        adam: Default::default(),
                        lr: &lr,
                        clip: 0.0,
                        stop: &|| false,
                    },
                    &mut |_, _, _, r| {
                        let by = |g: &str| r.stats.bytes_sent_by_group(g);
                        sent = [by("tp"), by("dp"), by("p2p")];
                        Ok(())
                    },
                )?;
                Ok(sent)
            })
            .into_iter()
            .map(|r| r.unwrap().unwrap())
            .collect()
    };
    let (full, half) = (bytes(MixedPrecision::F32), bytes(MixedPrecision::Bf16));
    for (d, (f, h)) in full.iter().zip(&half).enumerate() {
        for (g, name) in ["tp", "dp", "pp"].iter().enumerate() {
            // Weights, gradients and activations move in 2 bytes; the loss's row statistics (f32,
            // f64) and the replicated-gradient sums stay wider.
            let r = h[g] as f64 / f[g] as f64;
            assert!(
                (0.45..=0.6).contains(&r),
                "device {d} {name}: {} vs {} bytes ({r:.3})",
                h[g],
                f[g]
            );
        }
    }
}

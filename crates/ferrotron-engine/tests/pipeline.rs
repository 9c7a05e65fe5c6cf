//! The pipeline runtime computes the unsplit model's loss and gradients, on the PyTorch reference batch
//! and on larger random batches, for every executed schedule, even and uneven partitions.

mod common;

use common::*;
use ferrotron_core::layout::{Layout, Schedule};
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::parallel::pipeline_step;
use ferrotron_engine::transformer::{ParamStore, TokenBatch, Transformer};
use rand::{Rng, SeedableRng};
use std::time::Duration;

const TOL: f64 = 1e-5;

fn layout(schedule: Schedule, mbs: usize, pp: usize) -> Layout {
    Layout {
        pp,
        micro_batch_size: mbs,
        schedule,
        ..Layout::default()
    }
}

fn compare(
    name: &str,
    loss: f64,
    grads: &ParamStore,
    want_loss: f64,
    want: &dyn Fn(&str) -> Vec<f32>,
) {
    let e = (loss - want_loss).abs() / want_loss.abs();
    assert!(e <= 1e-6, "{name}: loss {loss} vs {want_loss} ({e:e})");
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        let e = rel_err(g, &want(&spec.name));
        assert!(e <= TOL, "{name}: {} rel err {e:e}", spec.name);
    }
}

#[test]
fn pipelines_match_pytorch_on_the_reference_batch() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let reference = Reference::load(model);
        let ref_loss = reference.get("loss_f32")[0] as f64;
        for pp in [2, 4] {
            for schedule in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Zbh1] {
                for mbs in [1, 2] {
                    let part = StagePartition::for_model(&cfg, pp).unwrap();
                    let run = pipeline_step(
                        &cfg,
                        &params,
                        &reference.batch,
                        &layout(schedule, mbs, pp),
                        &part,
                        Duration::from_secs(30),
                    )
                    .unwrap();
                    compare(
                        &format!("{model} pp{pp} {schedule:?} mbs{mbs}"),
                        run.loss,
                        &run.grads,
                        ref_loss,
                        &|n| reference.get(&format!("grad_f32.{n}")).to_vec(),
                    );
                }
            }
        }
    }
}

#[test]
fn pipelines_match_the_unsplit_model_on_larger_batches_and_uneven_partitions() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = TokenBatch {
            ids: (0..8 * 24).map(|_| rng.gen_range(0..512)).collect(),
            batch: 8,
            seq: 24,
        };
        let mut unsplit = params.zeros_like();
        let want_loss = Transformer::new(&cfg, &params).forward_backward(
            &CpuBackend::default(),
            &params,
            &mut unsplit,
            &batch,
        );
        let want = |n: &str| unsplit.get(n).unwrap().to_vec();
        let partitions = [
            StagePartition::for_model(&cfg, 2).unwrap(),
            StagePartition::for_model(&cfg, 4).unwrap(),
            StagePartition::explicit(vec![0..3, 3..4], 4).unwrap(),
            StagePartition::explicit(vec![0..1, 1..4], 4).unwrap(),
        ];
        for (pp, vpp, mbs) in [(2, 2, 1), (2, 2, 2), (4, 1, 1)] {
            let part = StagePartition::for_model(&cfg, pp * vpp).unwrap();
            let l = Layout {
                schedule: if vpp > 1 {
                    Schedule::Interleaved
                } else {
                    Schedule::OneFOneB
                },
                ..interleaved(mbs, pp, vpp)
            };
            let run =
                pipeline_step(&cfg, &params, &batch, &l, &part, Duration::from_secs(30)).unwrap();
            compare(
                &format!("{model} interleaved pp{pp} vpp{vpp} mbs{mbs}"),
                run.loss,
                &run.grads,
                want_loss,
                &want,
            );
        }
        for part in &partitions {
            for schedule in [Schedule::Gpipe, Schedule::OneFOneB, Schedule::Zbh1] {
                for mbs in [1, 2] {
                    let l = layout(schedule, mbs, part.stages());
                    let run =
                        pipeline_step(&cfg, &params, &batch, &l, part, Duration::from_secs(30))
                            .unwrap();
                    compare(
                        &format!("{model} {:?} {schedule:?} mbs{mbs}", part.layers),
                        run.loss,
                        &run.grads,
                        want_loss,
                        &want,
                    );
                }
            }
        }
    }
}

#[test]
fn stage_zero_stashes_m_micro_batches_under_gpipe_and_p_under_1f1b() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = TokenBatch {
        ids: (0..8 * 16).map(|i| (i * 5 % 512) as u32).collect(),
        batch: 8,
        seq: 16,
    };
    let part = StagePartition::for_model(&cfg, 4).unwrap();
    let g = pipeline_step(
        &cfg,
        &params,
        &batch,
        &layout(Schedule::Gpipe, 1, 4),
        &part,
        Duration::from_secs(30),
    )
    .unwrap();
    let f = pipeline_step(
        &cfg,
        &params,
        &batch,
        &layout(Schedule::OneFOneB, 1, 4),
        &part,
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(g.peak_stashed, vec![8, 8, 8, 8]);
    assert_eq!(f.peak_stashed, vec![4, 3, 2, 1]);
    // Boundary traffic: every micro-batch crosses each of the 3 boundaries forward and backward.
    let boundary = (16 * cfg.hidden_size * 4) as u64;
    assert_eq!(f.stats[1].bytes_sent_by_group("p2p"), 2 * 8 * boundary);
}

#[test]
fn a_partition_that_does_not_fit_the_layout_is_refused_clearly() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = Reference::load("llama_tiny").batch;
    let part = StagePartition::for_model(&cfg, 2).unwrap();
    let e = pipeline_step(
        &cfg,
        &params,
        &batch,
        &interleaved(1, 2, 2),
        &part,
        Duration::from_secs(5),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("2 ranges") && e.contains("pp·vpp = 4"), "{e}");
}

fn interleaved(mbs: usize, pp: usize, vpp: usize) -> Layout {
    Layout {
        pp,
        vpp,
        micro_batch_size: mbs,
        schedule: Schedule::Interleaved,
        ..Layout::default()
    }
}

#[test]
fn interleaved_pipelines_match_pytorch_on_the_reference_batch() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let reference = Reference::load(model);
        let ref_loss = reference.get("loss_f32")[0] as f64;
        // 2 devices × 2 chunks of one layer: the tied GPT-2 head sits on device 1's second chunk.
        let part = StagePartition::for_model(&cfg, 4).unwrap();
        let run = pipeline_step(
            &cfg,
            &params,
            &reference.batch,
            &interleaved(1, 2, 2),
            &part,
            Duration::from_secs(30),
        )
        .unwrap();
        compare(
            &format!("{model} pp2 vpp2"),
            run.loss,
            &run.grads,
            ref_loss,
            &|n| reference.get(&format!("grad_f32.{n}")).to_vec(),
        );
        assert_eq!(run.peak_stashed.len(), 2);
    }
}

#[test]
fn pipelines_with_recompute_match_pytorch() {
    use ferrotron_core::layout::Recompute;
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let reference = Reference::load(model);
        let ref_loss = reference.get("loss_f32")[0] as f64;
        for recompute in [Recompute::Full, Recompute::Selective] {
            for (pp, vpp) in [(2, 1), (4, 1), (2, 2)] {
                let schedule = if vpp > 1 {
                    Schedule::Interleaved
                } else {
                    Schedule::OneFOneB
                };
                let l = Layout {
                    recompute,
                    schedule,
                    ..interleaved(1, pp, vpp)
                };
                let part = StagePartition::for_model(&cfg, pp * vpp).unwrap();
                let run = pipeline_step(
                    &cfg,
                    &params,
                    &reference.batch,
                    &l,
                    &part,
                    Duration::from_secs(30),
                )
                .unwrap();
                compare(
                    &format!("{model} pp{pp} vpp{vpp} {recompute:?}"),
                    run.loss,
                    &run.grads,
                    ref_loss,
                    &|n| reference.get(&format!("grad_f32.{n}")).to_vec(),
                );
            }
        }
    }
}

#[test]
fn the_timeline_exports_as_a_valid_chrome_trace() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = TokenBatch {
        ids: (0..8 * 16).map(|i| (i * 5 % 512) as u32).collect(),
        batch: 8,
        seq: 16,
    };
    let part = StagePartition::for_model(&cfg, 4).unwrap();
    let run = pipeline_step(
        &cfg,
        &params,
        &batch,
        &layout(Schedule::OneFOneB, 1, 4),
        &part,
        Duration::from_secs(30),
    )
    .unwrap();
    let text = serde_json::to_string(&run.chrome_trace()).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for stage in 0..4 {
        let track: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["tid"] == stage && e["ph"] == "X")
            .collect();
        let count = |cat: &str| track.iter().filter(|e| e["cat"] == cat).count();
        assert_eq!(
            (count("forward"), count("backward")),
            (8, 8),
            "stage {stage}"
        );
        // Valid order: non-overlapping in time, and each micro-batch's backward after its forward.
        for w in track.windows(2) {
            let end = w[0]["ts"].as_f64().unwrap() + w[0]["dur"].as_f64().unwrap();
            assert!(
                end <= w[1]["ts"].as_f64().unwrap() + 1e-6,
                "stage {stage}: overlapping events"
            );
        }
        for mb in 0..8 {
            let at = |cat: &str| {
                track
                    .iter()
                    .position(|e| e["cat"] == cat && e["args"]["micro_batch"] == mb)
                    .unwrap()
            };
            assert!(
                at("forward") < at("backward"),
                "stage {stage} micro-batch {mb}"
            );
        }
    }
}

//! Tensor parallelism computes the unsplit model: loss and every gathered gradient against the unsplit
//! run and the PyTorch f32 reference, with and without sequence parallelism, combined with pipeline
//! stages; shards are exact slices; a vocabulary that does not split is padded harmlessly.

mod common;

use common::*;
use ferrotron_core::layout::{Layout, Recompute, Schedule};
use ferrotron_core::model::{preset, ModelConfig};
use ferrotron_core::schedule::StagePartition;
use ferrotron_engine::hf;
use ferrotron_engine::parallel::tensor::gather_tensor;
use ferrotron_engine::parallel::{pipeline_step, PipelineRun, TpShard};
use ferrotron_engine::storage::Location;
use ferrotron_engine::transformer::{ParamStore, TokenBatch};
use std::time::Duration;

/// f32 arithmetic, summed in a different order: relative error per tensor.
const TOL: f64 = 1e-5;

fn tp_layout(tp: usize, pp: usize, sp: bool, mbs: usize) -> Layout {
    Layout {
        tp,
        pp,
        sequence_parallel: sp,
        micro_batch_size: mbs,
        schedule: Schedule::OneFOneB,
        ..Layout::default()
    }
}

fn run(cfg: &ModelConfig, params: &ParamStore, batch: &TokenBatch, l: &Layout) -> PipelineRun {
    let part = StagePartition::for_model(cfg, l.pp * l.vpp).unwrap();
    pipeline_step(cfg, params, batch, l, &part, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{l}: {e}"))
}

fn assert_close(what: &str, loss: f64, grads: &ParamStore, want_loss: f64, want: &ParamStore) {
    let e = (loss - want_loss).abs() / want_loss.abs();
    assert!(e <= TOL, "{what}: loss {loss} vs {want_loss} ({e:e})");
    for (spec, g) in grads.specs.iter().zip(&grads.tensors) {
        let e = rel_err(g, want.get(&spec.name).unwrap());
        assert!(e <= TOL, "{what}: {} rel err {e:e}", spec.name);
    }
}

#[test]
fn tensor_parallel_matches_pytorch_and_the_unsplit_model() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let reference = Reference::load(model);
        let ref_loss = reference.get("loss_f32")[0] as f64;
        let (base_loss, base) = unsplit(&cfg, &params, &reference.batch);
        for tp in [2, 4] {
            for sp in [false, true] {
                let l = tp_layout(tp, 1, sp, reference.batch.batch);
                let r = run(&cfg, &params, &reference.batch, &l);
                let what = format!("{model} {l}");
                assert_close(&what, r.loss, &r.grads, base_loss, &base);
                let e = (r.loss - ref_loss).abs() / ref_loss;
                assert!(e <= TOL, "{what}: loss vs PyTorch {e:e}");
                let (name, worst) = worst_grad_err(&r.grads, &reference);
                assert!(worst <= TOL, "{what}: {name} vs PyTorch {worst:e}");
            }
        }
    }
}

#[test]
fn tensor_and_pipeline_parallel_together_with_recompute_and_micro_batches() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let batch = random_batch(cfg.vocab_size, 4, 16, 7);
        let (base_loss, base) = unsplit(&cfg, &params, &batch);
        let cases = [
            (tp_layout(2, 2, false, 1), Recompute::None),
            (tp_layout(2, 2, true, 2), Recompute::Selective),
            (tp_layout(4, 2, true, 1), Recompute::Full),
            (
                Layout {
                    schedule: Schedule::Zbh1,
                    ..tp_layout(2, 2, true, 1)
                },
                Recompute::None,
            ),
            (
                Layout {
                    schedule: Schedule::Interleaved,
                    vpp: 2,
                    ..tp_layout(2, 2, false, 1)
                },
                Recompute::None,
            ),
        ];
        for (l, recompute) in cases {
            let l = Layout { recompute, ..l };
            let r = run(&cfg, &params, &batch, &l);
            assert_close(&format!("{model} {l}"), r.loss, &r.grads, base_loss, &base);
        }
    }
}

#[test]
fn shards_are_exact_slices_and_gather_back_bit_for_bit() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        for tp in [2, 4] {
            let shards: Vec<ParamStore> = (0..tp)
                .map(|r| {
                    let shard = TpShard::new(&cfg, tp, r, false).unwrap();
                    let (store, read) = shard.shard_store(&cfg, &params, &|_| true).unwrap();
                    assert_eq!(read, 0, "a model in memory reads nothing");
                    // Read from the files, the shard is the same, and only its bytes are read.
                    let location = Location::Local(fixture(model));
                    let stored = hf::ModelWeights::open(&location, &cfg).unwrap();
                    let (from_files, read) = shard.shard_store(&cfg, &stored, &|_| true).unwrap();
                    assert_eq!(
                        from_files.tensors, store.tensors,
                        "{model} tp={tp} rank {r}"
                    );
                    assert_eq!(read, 4 * from_files.parameters() as u64 - padding(&store));
                    store
                })
                .collect();
            for (id, spec) in params.specs.iter().enumerate() {
                let parts: Vec<&[f32]> =
                    shards.iter().map(|s| s.get(&spec.name).unwrap()).collect();
                let back = gather_tensor(&cfg, spec, &parts).unwrap();
                assert_eq!(back, params.tensors[id], "{model} tp={tp}: {}", spec.name);
            }
            // Spot checks against slices taken by hand, independent of the slicing code.
            let h = cfg.hidden_size;
            let full = |n: &str| params.get(n).unwrap();
            let r = tp - 1;
            match model {
                "llama_tiny" => {
                    let q = cfg.q_dim() / tp;
                    let name = "model.layers.1.self_attn.q_proj.weight";
                    assert_eq!(
                        shards[r].get(name).unwrap(),
                        &full(name)[r * q * h..(r + 1) * q * h]
                    );
                    let name = "model.layers.1.self_attn.o_proj.weight";
                    let want: Vec<f32> = full(name)
                        .chunks(cfg.q_dim())
                        .flat_map(|row| row[r * q..(r + 1) * q].to_vec())
                        .collect();
                    assert_eq!(shards[r].get(name).unwrap(), &want[..]);
                    // tp = 4 > 2 KV heads: devices 2 and 3 both hold KV head 1.
                    let name = "model.layers.0.self_attn.k_proj.weight";
                    let (kv, hd) = (cfg.num_kv_heads, cfg.head_dim);
                    let (first, count) = if kv >= tp {
                        (r * kv / tp, kv / tp)
                    } else {
                        (r / (tp / kv), 1)
                    };
                    assert_eq!(
                        shards[r].get(name).unwrap(),
                        &full(name)[first * hd * h..(first + count) * hd * h]
                    );
                }
                _ => {
                    let q = h / tp;
                    let name = "transformer.h.0.attn.c_attn.weight";
                    let want: Vec<f32> = full(name)
                        .chunks(3 * h)
                        .flat_map(|row| {
                            (0..3)
                                .flat_map(move |k| row[k * h + r * q..k * h + (r + 1) * q].to_vec())
                        })
                        .collect();
                    assert_eq!(shards[r].get(name).unwrap(), &want[..]);
                }
            }
            let emb = cfg.embedding_name();
            let rows = cfg.vocab_size / tp;
            assert_eq!(
                shards[r].get(emb).unwrap(),
                &full(emb)[r * rows * h..(r + 1) * rows * h]
            );
        }
    }
    // Fresh initialisation sharded the same way: the shard of the initialised model.
    let cfg = preset("llama-tiny").unwrap();
    let params = ParamStore::init_random(&cfg, 3);
    let shard = TpShard::new(&cfg, 2, 1, false)
        .unwrap()
        .shard_store(&cfg, &params, &|_| true)
        .unwrap()
        .0;
    let name = "model.layers.2.mlp.up_proj.weight";
    let f = cfg.intermediate_size / 2;
    assert_eq!(
        shard.get(name).unwrap(),
        &params.get(name).unwrap()[f * cfg.hidden_size..]
    );
}

#[test]
fn a_vocabulary_that_does_not_split_is_padded_without_changing_anything() {
    // A copy of the tiny models' shape with 509 tokens: not a multiple of 2 or 4.
    for name in ["llama-tiny", "gpt2-tiny"] {
        let cfg = ModelConfig {
            vocab_size: 509,
            ..preset(name).unwrap()
        };
        let params = ParamStore::init_random(&cfg, 11);
        let batch = random_batch(cfg.vocab_size, 2, 24, 5);
        // Make sure the ids reach into the last (partly padded) shard.
        let mut batch = batch;
        batch.ids[3] = 508;
        batch.ids[30] = 508;
        let (base_loss, base) = unsplit(&cfg, &params, &batch);
        for tp in [2, 4] {
            for sp in [false, true] {
                let l = tp_layout(tp, 1, sp, 2);
                let r = run(&cfg, &params, &batch, &l);
                assert_close(
                    &format!("{name} vocab 509 {l}"),
                    r.loss,
                    &r.grads,
                    base_loss,
                    &base,
                );
            }
        }
    }
}

#[test]
fn replicated_gradients_are_identical_across_the_group() {
    // Without sequence parallelism the norms' gradients agree by construction; with it they are
    // summed; KV heads replicated at tp = 4 are summed over their two holders. Either way, every
    // device's copy must be the same complete gradient: compare the copies directly.
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = random_batch(cfg.vocab_size, 2, 16, 9);
    let part = StagePartition::for_model(&cfg, 1).unwrap();
    for sp in [false, true] {
        let l = tp_layout(4, 1, sp, 2);
        let step =
            ferrotron_engine::parallel::MeshStep::new(&cfg, &params, &batch, &l, &part).unwrap();
        let results = ferrotron_engine::comm::ThreadWorld::new(4).run(|c| step.run_device(c, 0));
        let results: Vec<_> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
        for name in ["model.layers.0.input_layernorm.weight", "model.norm.weight"] {
            let first = results[0].grads.get(name).unwrap();
            for r in &results[1..] {
                assert_eq!(r.grads.get(name).unwrap(), first, "sp={sp}: {name}");
            }
        }
        let k = "model.layers.3.self_attn.k_proj.weight";
        assert_eq!(
            results[0].grads.get(k),
            results[1].grads.get(k),
            "sp={sp}: {k}"
        );
        assert_eq!(
            results[2].grads.get(k),
            results[3].grads.get(k),
            "sp={sp}: {k}"
        );
    }
}

#[test]
fn layouts_that_do_not_split_the_model_are_refused_clearly() {
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let batch = random_batch(cfg.vocab_size, 2, 16, 1);
    let part = StagePartition::for_model(&cfg, 1).unwrap();
    let err = |l: &Layout| {
        pipeline_step(&cfg, &params, &batch, l, &part, Duration::from_secs(10))
            .err()
            .unwrap_or_else(|| panic!("{l} accepted"))
            .to_string()
    };
    let e = err(&tp_layout(3, 1, false, 1));
    assert!(e.contains("4 attention heads do not divide over 3"), "{e}");
    let e = err(&tp_layout(8, 1, false, 1));
    assert!(e.contains("tp=8"), "{e}");
    // 16 tokens per micro-batch do not split into 3 sequence blocks (on a 6-head model).
    let cfg6 = ModelConfig {
        num_heads: 6,
        num_kv_heads: 6,
        head_dim: 16,
        hidden_size: 96,
        ..preset("gpt2-tiny").unwrap()
    };
    let p6 = ParamStore::init_random(&cfg6, 1);
    let b6 = TokenBatch {
        ids: vec![1; 14],
        batch: 1,
        seq: 14,
    };
    let e = pipeline_step(
        &cfg6,
        &p6,
        &b6,
        &tp_layout(3, 1, true, 1),
        &part,
        Duration::from_secs(10),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("do not split over tp=3"), "{e}");
}

#[test]
fn tp_of_three_and_six_on_a_six_head_model() {
    // Every tp that divides the heads: 3 and 6 on a GPT-2 shape with 6 heads, an MLP of 256 columns
    // (uneven over 3 and 6) and a vocabulary of 512 (padded for 3 and 6).
    let cfg = ModelConfig {
        num_heads: 6,
        num_kv_heads: 6,
        head_dim: 16,
        hidden_size: 96,
        intermediate_size: 256,
        ..preset("gpt2-tiny").unwrap()
    };
    let params = ParamStore::init_random(&cfg, 4);
    let batch = random_batch(cfg.vocab_size, 2, 18, 2);
    let (base_loss, base) = unsplit(&cfg, &params, &batch);
    for tp in [3, 6] {
        for sp in [false, true] {
            let l = tp_layout(tp, 1, sp, 2);
            let r = run(&cfg, &params, &batch, &l);
            assert_close(
                &format!("gpt2 6 heads {l}"),
                r.loss,
                &r.grads,
                base_loss,
                &base,
            );
        }
    }
}

/// The bytes of a shard that are padding (vocabulary padding rows, never read).
fn padding(shard: &ParamStore) -> u64 {
    let zeros_at_end = |t: &[f32]| t.iter().rev().take_while(|x| **x == 0.0).count();
    shard
        .specs
        .iter()
        .zip(&shard.tensors)
        .filter(|(s, _)| {
            s.name.contains("embed") || s.name.contains("wte") || s.name == "lm_head.weight"
        })
        .map(|(_, t)| 4 * zeros_at_end(t) as u64)
        .sum()
}

//! The planner's ferrotron activation model is what the engine keeps: prediction equals measurement.

mod common;

use common::*;
use ferrotron_core::layout::Layout;
use ferrotron_core::plan::stage_activation_stash;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
use ferrotron_engine::parallel::Training;
use ferrotron_engine::transformer::{TokenBatch, Transformer};

#[test]
fn predicted_activation_bytes_equal_the_measured_stash() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        for (mbs, seq) in [(1, 16), (2, 32), (3, 7)] {
            let batch = TokenBatch {
                ids: (0..mbs * seq).map(|i| (i * 7 % 512) as u32).collect(),
                batch: mbs,
                seq,
            };
            let measured = Transformer::new(&cfg, &params)
                .forward(&CpuBackend::default(), &params, &batch)
                .stashed_bytes();
            let input = f32_plan_input(&cfg, seq, mbs);
            let layout = Layout {
                micro_batch_size: mbs,
                ..Layout::default()
            };
            let predicted = stage_activation_stash(&input, &layout, 0, 1);
            assert_eq!(predicted, measured as f64, "{model} mbs {mbs} seq {seq}");
        }
    }
}

fn mesh_run(
    cfg: &ferrotron_core::model::ModelConfig,
    params: &ferrotron_engine::transformer::ParamStore,
    batch: &TokenBatch,
    l: &Layout,
) -> ferrotron_engine::parallel::PipelineRun {
    let part = ferrotron_core::schedule::StagePartition::for_model(cfg, l.pp * l.vpp).unwrap();
    ferrotron_engine::parallel::pipeline_step(
        cfg,
        params,
        batch,
        l,
        &part,
        std::time::Duration::from_secs(60),
    )
    .unwrap()
}

#[test]
fn measured_tensor_parallel_bytes_equal_the_planners_figure() {
    use ferrotron_core::layout::LayoutSpec;
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let (b, seq) = (4, 16);
        let batch = TokenBatch {
            ids: (0..b * seq).map(|i| (i * 13 % 512) as u32).collect(),
            batch: b,
            seq,
        };
        let input = f32_plan_input(&cfg, seq, b);
        for spec in [
            "tp=2,mbs=2",
            "tp=4,mbs=1",
            "tp=2,sp=true,mbs=2",
            "tp=4,sp=true,mbs=4",
            "tp=2,pp=2,mbs=1",
            "tp=2,pp=2,sp=true,mbs=2,recompute=full",
            "tp=4,recompute=selective,mbs=2",
        ] {
            let l = LayoutSpec::parse(spec).unwrap().layout;
            let run = mesh_run(&cfg, &params, &batch, &l);
            for (d, stats) in run.stats.iter().enumerate() {
                let stage = d / l.tp;
                let predicted = ferrotron_core::plan::tp_bytes_per_device(&input, &cfg, &l, stage);
                let measured = stats.bytes_sent_by_group("tp") as f64;
                assert_eq!(measured, predicted, "{model} {spec}: device {d}");
            }
            // The plan's stable figure is the busiest device's.
            let plan = ferrotron_core::plan::evaluate(&input, &l).unwrap();
            let busiest = run
                .stats
                .iter()
                .map(|s| s.bytes_sent_by_group("tp"))
                .max()
                .unwrap();
            assert_eq!(
                plan.comm_bytes_per_step.tp, busiest as f64,
                "{model} {spec}"
            );
        }
    }
}

#[test]
fn activation_memory_per_device_drops_as_the_planner_predicts_under_tp_and_sp() {
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, params) = hf::load_model(&fixture(model)).unwrap();
        let (b, seq) = (2, 32);
        let batch = TokenBatch {
            ids: (0..b * seq).map(|i| (i * 5 % 512) as u32).collect(),
            batch: b,
            seq,
        };
        let input = f32_plan_input(&cfg, seq, b);
        let mut per_device = Vec::new();
        for (tp, sp) in [(1, false), (2, false), (4, false), (2, true), (4, true)] {
            let l = Layout {
                tp,
                sequence_parallel: sp,
                micro_batch_size: b,
                ..Layout::default()
            };
            let predicted = stage_activation_stash(&input, &l, 0, 1) as u64;
            let run = mesh_run(&cfg, &params, &batch, &l);
            for (d, &measured) in run.peak_stash_bytes.iter().enumerate() {
                assert_eq!(
                    measured as u64, predicted,
                    "{model} tp={tp} sp={sp}: device {d}"
                );
            }
            per_device.push(predicted);
        }
        // Splitting shrinks every device's stash, and sequence parallelism shrinks it further.
        assert!(
            per_device[1] < per_device[0] && per_device[2] < per_device[1],
            "{per_device:?}"
        );
        assert!(
            per_device[3] < per_device[1] && per_device[4] < per_device[2],
            "{per_device:?}"
        );
    }
}

#[test]
fn measured_data_parallel_bytes_match_the_planners_figure() {
    use ferrotron_core::layout::LayoutSpec;
    // Llama (untied): every parameter belongs to one unit. Shards are padded to a multiple of dp,
    // which the planner does not count: within 1%.
    let (cfg, params) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let (b, seq) = (8, 16);
    let batch = TokenBatch {
        ids: (0..b * seq).map(|i| (i * 11 % 512) as u32).collect(),
        batch: b,
        seq,
    };
    let input = f32_plan_input(&cfg, seq, b);
    for spec in [
        "dp=2",
        "dp=4,tp=2",
        "dp=2,zero=1",
        "dp=4,zero=2,mbs=2",
        "dp=2,tp=2,zero=3",
    ] {
        let l = LayoutSpec::parse(spec).unwrap().layout;
        let part = ferrotron_core::schedule::StagePartition::for_model(&cfg, 1).unwrap();
        let plan = ferrotron_core::plan::evaluate(&input, &l).unwrap();
        // One optimizer step (its reductions and, under ZeRO 1–2, the parameters' all-gather).
        let sent = ferrotron_engine::comm::ThreadWorld::new(l.world_size()).run(|c| {
            let mut step =
                ferrotron_engine::parallel::MeshStep::new(&cfg, &params, &batch, &l, &part)?;
            let lr = ferrotron_engine::optim::LrSchedule {
                peak_lr: 1e-3,
                min_lr: 1e-3,
                warmup_steps: 0,
                total_steps: 1,
            };
            let mut dp_bytes = 0;
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
                    dp_bytes = r.stats.bytes_sent_by_group("dp");
                    Ok(())
                },
            )?;
            Ok::<_, ferrotron_engine::EngineError>(dp_bytes)
        });
        for (d, r) in sent.into_iter().enumerate() {
            let measured = r.unwrap().unwrap() as f64;
            let e = measured / plan.comm_bytes_per_step.dp - 1.0;
            assert!(
                e.abs() <= 0.01,
                "{spec} device {d}: measured {measured} vs planned {}",
                plan.comm_bytes_per_step.dp
            );
        }
    }
}

#[test]
fn lora_bytes_equal_the_planners_figures() {
    use ferrotron_core::layout::LayoutSpec;
    use ferrotron_engine::lora::Adapters;
    use ferrotron_engine::transformer::Trained;
    // LoRA adds no collective inside the layers; after the step each replicated adapter half (a
    // column-parallel base's A, a row-parallel base's B) is summed over the tensor-parallel group,
    // and only the adapters cross the data-parallel group.
    for model in ["llama_tiny", "gpt2_tiny"] {
        let (cfg, base) = hf::load_model(&fixture(model)).unwrap();
        let adapters = Adapters::load_peft(&fixture("lora").join(model), &cfg).unwrap();
        let (b, seq) = (4, 16);
        let batch = TokenBatch {
            ids: (0..b * seq).map(|i| (i * 13 % 512) as u32).collect(),
            batch: b,
            seq,
        };
        let input = ferrotron_core::plan::PlanInput {
            lora: Some(adapters.config.clone()),
            ..f32_plan_input(&cfg, seq, b)
        };
        for spec in ["tp=2,mbs=2", "tp=4,sp=true,mbs=1", "tp=2,pp=2,mbs=1"] {
            let l = LayoutSpec::parse(spec).unwrap().layout;
            let part = ferrotron_core::schedule::StagePartition::for_model(&cfg, l.pp).unwrap();
            let trained = Trained::lora(&base, &adapters.config, &adapters.params);
            let run = ferrotron_engine::parallel::pipeline_steps_of(
                &cfg,
                trained,
                &batch,
                &l,
                &part,
                std::time::Duration::from_secs(60),
                0,
            )
            .unwrap();
            for (d, stats) in run.stats.iter().enumerate() {
                let stage = d / l.tp;
                let predicted = ferrotron_core::plan::tp_bytes_per_device(&input, &cfg, &l, stage);
                let measured = stats.bytes_sent_by_group("tp") as f64;
                assert_eq!(measured, predicted, "LoRA {model} {spec}: device {d}");
            }
        }
    }
}

#[test]
fn lora_data_parallel_bytes_match_the_planners_figure() {
    use ferrotron_core::layout::LayoutSpec;
    use ferrotron_engine::lora::Adapters;
    // Only the adapters are reduced and (ZeRO 1–3) gathered; within 1% (pieces are padded).
    let (cfg, base) = hf::load_model(&fixture("llama_tiny")).unwrap();
    let adapters = Adapters::load_peft(&fixture("lora").join("llama_tiny"), &cfg).unwrap();
    let (b, seq) = (8, 16);
    let batch = TokenBatch {
        ids: (0..b * seq).map(|i| (i * 11 % 512) as u32).collect(),
        batch: b,
        seq,
    };
    let input = ferrotron_core::plan::PlanInput {
        lora: Some(adapters.config.clone()),
        ..f32_plan_input(&cfg, seq, b)
    };
    for spec in [
        "dp=2",
        "dp=2,zero=1",
        "dp=4,zero=2,mbs=2",
        "dp=2,tp=2,zero=3",
    ] {
        let l = LayoutSpec::parse(spec).unwrap().layout;
        let part = ferrotron_core::schedule::StagePartition::for_model(&cfg, 1).unwrap();
        let plan = ferrotron_core::plan::evaluate(&input, &l).unwrap();
        let sent = ferrotron_engine::comm::ThreadWorld::new(l.world_size()).run(|c| {
            let mut step = ferrotron_engine::parallel::MeshStep::new(
                &cfg,
                &adapters.params,
                &batch,
                &l,
                &part,
            )?
            .with_lora(&base, &adapters.config);
            let lr = ferrotron_engine::optim::LrSchedule {
                peak_lr: 1e-3,
                min_lr: 1e-3,
                warmup_steps: 0,
                total_steps: 1,
            };
            let mut dp_bytes = 0;
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
                    dp_bytes = r.stats.bytes_sent_by_group("dp");
                    Ok(())
                },
            )?;
            Ok::<_, ferrotron_engine::EngineError>(dp_bytes)
        });
        for (d, r) in sent.into_iter().enumerate() {
            let measured = r.unwrap().unwrap() as f64;
            let e = measured / plan.comm_bytes_per_step.dp - 1.0;
            assert!(
                e.abs() <= 0.01,
                "LoRA {spec} device {d}: measured {measured} vs planned {}",
                plan.comm_bytes_per_step.dp
            );
        }
    }
}

//! The planner's ferrotron activation model is what the engine keeps: prediction equals measurement.

mod common;

use common::*;
use ferrotron_core::layout::Layout;
use ferrotron_core::plan::{
    stage_memory, ActivationModel, OptimizerKind, PlanInput, PlanModel, Precision,
};
use ferrotron_core::topology::Cluster;
use ferrotron_engine::hf;
use ferrotron_engine::kernels::CpuBackend;
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
            let input = PlanInput {
                model: PlanModel::Shape(cfg.clone()),
                cluster: Cluster::parse("this-machine").unwrap(),
                seq,
                global_batch: mbs,
                precision: Precision::parse("weights=fp32,grads=fp32,master=fp32,optimizer=fp32")
                    .unwrap(),
                optimizer: OptimizerKind::Adam,
                activation_model: ActivationModel::Ferrotron,
                lora_rank: None,
                memory_reserve: 0.0,
                force_cross_node_tp: false,
            };
            let layout = Layout {
                micro_batch_size: mbs,
                ..Layout::default()
            };
            let predicted = stage_memory(&input, &layout, 0, 1).activations;
            assert_eq!(predicted, measured as u64, "{model} mbs {mbs} seq {seq}");
        }
    }
}

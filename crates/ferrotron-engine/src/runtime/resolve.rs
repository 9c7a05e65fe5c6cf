//! From settings to layouts: the planner's view of the run (the job's devices, the batch, the
//! precision), and the layouts to try, the given one checked or `auto`'s choices.

use super::config::{parse_bytes, TrainConfig};
use crate::error::{EngineError, Result};
use ferrotron_core::layout::LayoutSpec;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::plan::{evaluate, search, why_no_layout, Plan, PlanInput, PlanModel};
use ferrotron_core::topology::Cluster;

/// The cluster cut to the `devices` a job has (an MPI world): whole nodes of the cluster's size, or
/// one node of `devices` when fewer than a node. Anything else cannot be placed.
pub fn cluster_for_job(mut cluster: Cluster, devices: usize) -> Result<Cluster> {
    let per_node = cluster.devices_per_node;
    if devices == 0 {
        return Err(EngineError::Invalid("the job has no devices".into()));
    }
    if devices <= per_node {
        cluster.nodes = 1;
        cluster.devices_per_node = devices;
    } else if devices.is_multiple_of(per_node) {
        cluster.nodes = devices / per_node;
    } else {
        return Err(EngineError::Invalid(format!(
            "the job has {devices} ranks, which do not fill whole nodes of {per_node} devices \
             (cluster `{}`): run a multiple of {per_node} ranks, or give a cluster whose nodes \
             match the job",
            cluster.name
        )));
    }
    Ok(cluster)
}

/// The planner's view of this run: the model's shape, the cluster (cut to the job's devices when
/// they are fixed, with the configured device memory), the batch, the precision and the engine's
/// activation model.
pub fn plan_input(
    cfg: &TrainConfig,
    model: &ModelConfig,
    job_devices: Option<usize>,
) -> Result<PlanInput> {
    let mut cluster = Cluster::parse(&cfg.parallelism.cluster)?;
    if let Some(n) = job_devices {
        cluster = cluster_for_job(cluster, n)?;
    }
    if let Some(m) = &cfg.parallelism.device_memory {
        cluster.device_memory_bytes = parse_bytes(m)?;
    }
    // `layout = "auto"` keeps `PlanInput::new`'s tenth of each device free: the activation model
    // and the communication buffers are estimates (within ~10% of what the tracking allocator
    // measures).
    Ok(PlanInput {
        precision: cfg.numerics.precision.state_dtypes(),
        force_cross_node_tp: cfg.parallelism.force_cross_node_tp,
        ..PlanInput::new(
            PlanModel::Shape(model.clone()),
            cluster,
            cfg.input.seq_len,
            cfg.optimizer.batch_size,
        )
    })
}

/// The layouts to try, in order: the given one (checked against the model, batch and cluster), or
/// under `auto` the planner's layouts that fit the job's devices, fastest first. When none does,
/// the error says why for each way to cut the devices.
pub fn resolve_layout(spec: &LayoutSpec, input: &PlanInput) -> Result<Vec<Plan>> {
    if !spec.is_auto() {
        // The model's own divisibility first (heads, KV heads), then the cluster's rules in the
        // planner's evaluation, which is the run's prediction.
        if let PlanModel::Shape(model) = &input.model {
            crate::parallel::TpShard::check(model, spec.layout.tp)?;
        }
        return Ok(vec![evaluate(input, &spec.layout)?]);
    }
    let devices = input.cluster.world_size();
    let mut candidates =
        search(input).map_err(|e| EngineError::Invalid(format!("layout auto: {e}")))?;
    // The keys given beside `auto` hold: only candidates that keep them.
    let fitting = candidates.len();
    candidates.retain(|p| spec.admits(&p.layout));
    if candidates.is_empty() && fitting > 0 {
        return Err(EngineError::Invalid(format!(
            "layout `{}`: none of the {fitting} layouts that fit the job's {devices} devices keeps \
             the keys given beside `auto`; give fewer keys, or `auto` alone",
            spec.text
        )));
    }
    if candidates.is_empty() {
        let reasons = why_no_layout(input);
        return Err(EngineError::Invalid(format!(
            "layout auto: no layout of the job's {devices} devices fits {} per device{}",
            crate::memory::format_bytes(input.cluster.device_memory_bytes),
            if reasons.is_empty() {
                " (every cut keeps the rules; the model state and activations are too large)"
                    .to_string()
            } else {
                format!(":\n{}", reasons.join("\n"))
            }
        )));
    }
    Ok(candidates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_is_cut_to_the_job_s_devices() {
        let eight = Cluster::parse("dgx-a100-80g,nodes=2").unwrap();
        let one_node = cluster_for_job(eight.clone(), 3).unwrap();
        assert_eq!((one_node.nodes, one_node.devices_per_node), (1, 3));
        let two_nodes = cluster_for_job(eight.clone(), 16).unwrap();
        assert_eq!((two_nodes.nodes, two_nodes.devices_per_node), (2, 8));
        let e = cluster_for_job(eight.clone(), 12).unwrap_err().to_string();
        assert!(e.contains("12 ranks") && e.contains("nodes of 8"), "{e}");
        assert!(cluster_for_job(eight, 0).is_err());
    }
}

//! Where a command's devices run: threads in this process, or one MPI rank per device; and what a
//! one-step command (`grads`, `verify`) trains: the model, or LoRA adapters on it (`--adapter`).

use anyhow::Result;
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_core::precision::BaseQuantization;
use ferrotron_engine::parallel::PipelineRun;
use ferrotron_engine::storage::Location;
use ferrotron_engine::transformer::{ParamStore, TokenBatch, Trained};

/// One step under `layout`, this process being device `rank` of the MPI job: rank 0 gets the loss
/// and gathered gradients, every other rank `None`. A failure on any rank ends the whole job.
#[cfg(feature = "mpi")]
pub fn mpi_layout_step(
    cfg: &ModelConfig,
    trained: Trained,
    batch: &TokenBatch,
    layout: &Layout,
) -> Result<Option<(f64, ParamStore, PipelineRun)>> {
    use ferrotron_engine::comm::{Comm, MpiComm};
    let mut c = MpiComm::init(None)?;
    match ferrotron_engine::runtime::layout_step_on(&mut c, cfg, trained, batch, layout) {
        Ok(r) => Ok(r),
        Err(e) => c.abort(&format!("{e} (job of {} ranks)", c.world_size()), 1),
    }
}

#[cfg(not(feature = "mpi"))]
pub fn mpi_layout_step(
    _cfg: &ModelConfig,
    _trained: Trained,
    _batch: &TokenBatch,
    _layout: &Layout,
) -> Result<Option<(f64, ParamStore, PipelineRun)>> {
    "mpi"
        .parse::<ferrotron_engine::comm::CommBackend>()
        .map(|_| None)
        .map_err(anyhow::Error::msg)
}

/// A model directory and, with `--adapter`, PEFT adapters on it: what `grads` and `verify` step.
pub struct StepModel {
    pub cfg: ModelConfig,
    pub params: ParamStore,
    pub adapters: Option<ferrotron_engine::lora::Adapters>,
}

impl StepModel {
    /// `quantize`: QLoRA, the base's projections stored in NF4 (only beside adapters).
    pub fn load(
        model: &std::path::Path,
        adapter: Option<&std::path::Path>,
        quantize: Option<BaseQuantization>,
    ) -> Result<Self> {
        // A local directory or an s3:// prefix.
        let model = Location::parse(&model.to_string_lossy())?;
        model.check_reachable()?;
        let cfg = ferrotron_engine::hf::read_config_at(&model)?;
        let adapters = adapter
            .map(|dir| ferrotron_engine::lora::Adapters::load_peft(dir, &cfg))
            .transpose()?;
        if let (Some(q), None) = (quantize, &adapters) {
            anyhow::bail!(
                "--quantize-base {q} quantizes a frozen base: give --adapter too (the gradients \
                 of a 4-bit base are not computed)"
            )
        }
        // QLoRA: the projections quantized as they are read.
        let params = ferrotron_engine::hf::load_params_as(&model, &cfg, quantize)?;
        Ok(Self {
            cfg,
            params,
            adapters,
        })
    }

    /// What the step trains (its gradients are of these parameters).
    pub fn trained(&self) -> Trained<'_> {
        match &self.adapters {
            Some(a) => Trained::lora(&self.params, &a.config, &a.params),
            None => Trained::full(&self.params),
        }
    }

    /// The name a gradient is written under: the Hugging Face parameter name, or an adapter's
    /// name in `adapter_model.safetensors`.
    pub fn grad_name(&self, name: &str) -> String {
        match &self.adapters {
            Some(_) => format!("grad.{}{name}", ferrotron_core::model::PEFT_PREFIX),
            None => format!("grad.{name}"),
        }
    }
}

//! Where a command's devices run: threads in this process, or one MPI rank per device.

use anyhow::{bail, Result};
use ferrotron_core::layout::Layout;
use ferrotron_core::model::ModelConfig;
use ferrotron_engine::parallel::PipelineRun;
use ferrotron_engine::transformer::{ParamStore, TokenBatch};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Threads,
    Mpi,
}

impl Backend {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "threads" => Ok(Self::Threads),
            "mpi" if cfg!(feature = "mpi") => Ok(Self::Mpi),
            "mpi" => bail!(
                "--backend mpi: this ferrotron was built without MPI; build it with \
                 `cargo build --release --features mpi` (needs OpenMPI) and run it under mpirun"
            ),
            other => bail!("--backend `{other}`: expected `threads` or `mpi`"),
        }
    }
}

/// One step under `layout`, this process being device `rank` of the MPI job: rank 0 gets the loss
/// and gathered gradients, every other rank `None`. A failure on any rank ends the whole job.
#[cfg(feature = "mpi")]
pub fn mpi_layout_step(
    cfg: &ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
) -> Result<Option<(f64, ParamStore, PipelineRun)>> {
    use ferrotron_engine::comm::{Comm, MpiComm};
    let mut c = MpiComm::init(None)?;
    match ferrotron_engine::runtime::layout_step_on(&mut c, cfg, params, batch, layout) {
        Ok(r) => Ok(r),
        Err(e) => c.abort(&format!("{e} (job of {} ranks)", c.world_size()), 1),
    }
}

#[cfg(not(feature = "mpi"))]
pub fn mpi_layout_step(
    _cfg: &ModelConfig,
    _params: &ParamStore,
    _batch: &TokenBatch,
    _layout: &Layout,
) -> Result<Option<(f64, ParamStore, PipelineRun)>> {
    Backend::parse("mpi").map(|_| None)
}

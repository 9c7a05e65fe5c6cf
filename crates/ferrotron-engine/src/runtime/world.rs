//! Where a run's devices are: threads of this process, or one MPI rank each. The training loop
//! ([`super::device_loop::run_device`]) is the same on both; the world decides how many devices
//! the job has, which process reports, and how the devices are started.

use super::config::TrainConfig;
use super::device_loop::{layout_facts, run_device, with_prediction};
use super::metrics::RunOutcome;
use super::metrics::{MetricsWriter, StepFigures, StepReport};
use super::training_run::TrainingRun;
use crate::comm::{ClockSource, ThreadWorld};
use crate::error::{EngineError, Result};
use crate::memory;
use std::path::Path;
use std::sync::{mpsc, Mutex};
use std::time::Duration;

/// How long a device on threads waits for a peer before it names the peer and gives up (unless
/// `peer_timeout` says).
const PEER_TIMEOUT: Duration = Duration::from_secs(600);

/// The devices of a job.
pub enum World {
    /// Every device a thread of this process; as many as the layout has.
    Threads,
    /// This process is one device of an MPI job of `world_size` ranks.
    #[cfg(feature = "mpi")]
    Mpi(Box<crate::comm::MpiComm>),
}

/// This process's rank as the MPI launcher set it in the environment (OpenMPI, MPICH, PMIx), known
/// before the job is joined: what lets only rank 0 print before training starts.
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

impl World {
    /// The world `cfg.backend` names (under MPI: joins the job).
    pub fn open(cfg: &TrainConfig) -> Result<Self> {
        match cfg.parallelism.backend {
            #[cfg(feature = "mpi")]
            crate::comm::CommBackend::Mpi => {
                let comm = crate::comm::MpiComm::init(
                    cfg.parallelism.peer_timeout.map(Duration::from_secs_f64),
                )?;
                super::rank_status::start(crate::comm::Comm::rank(&comm));
                Ok(World::Mpi(Box::new(comm)))
            }
            _ => Ok(World::Threads),
        }
    }

    /// The devices the job has, when that is fixed by how it was started (the MPI world size);
    /// `None` on threads, where the run starts as many as its layout needs.
    pub fn fixed_devices(&self) -> Option<usize> {
        match self {
            World::Threads => None,
            #[cfg(feature = "mpi")]
            World::Mpi(c) => Some(crate::comm::Comm::world_size(c.as_ref())),
        }
    }

    /// Whether this process reports the run (writes metrics, the model, the summary).
    /// `e`, which ends the run on this process alone: under MPI the whole job ends with it (the
    /// other ranks would otherwise wait for this one until their peer timeout).
    pub(super) fn fail_alone(&self, e: EngineError) -> EngineError {
        #[cfg(feature = "mpi")]
        if let World::Mpi(c) = self {
            super::rank_status::note(&format!("error: {e}"));
            c.abort(&e.to_string(), e.exit_code());
        }
        e
    }

    pub fn reporter(&self) -> bool {
        match self {
            World::Threads => true,
            #[cfg(feature = "mpi")]
            World::Mpi(c) => crate::comm::Comm::rank(c.as_ref()) == 0,
        }
    }

    /// Kernel threads for each device: a device alone in its process uses the cores; several
    /// devices in one process compute on one thread each.
    pub fn kernel_threads(&self, cfg: &TrainConfig, devices: usize) -> usize {
        match self {
            World::Threads if devices == 1 => cfg.kernel_threads(),
            _ => 1,
        }
    }

    /// Runs every device of `run`; the reporting process writes `metrics_path` (when `metrics` is
    /// given) and returns the outcome, every other process `None`.
    pub(super) fn run(
        &mut self,
        run: &TrainingRun,
        metrics: Option<std::fs::File>,
        metrics_path: &Path,
        on_step: &mut dyn FnMut(&StepReport),
    ) -> Result<Option<RunOutcome>> {
        let layout = run.layout;
        let world = layout.world_size();
        if let Some(n) = self.fixed_devices() {
            if n != world {
                return Err(EngineError::Invalid(format!(
                    "layout `{layout}` needs {world} devices, the job has {n} ranks"
                )));
            }
        }
        let (partition, coords, predicted) = layout_facts(run)?;
        let writer = metrics.map(|f| MetricsWriter::new(run, f, metrics_path, &coords, &predicted));
        let out = match self {
            World::Threads => on_threads(run, &partition, writer, on_step),
            #[cfg(feature = "mpi")]
            World::Mpi(c) => {
                let mut writer = writer;
                let mut sink = |f: StepFigures| match writer.as_mut() {
                    Some(w) => w.step(f, on_step),
                    None => Ok(()),
                };
                // One device per process: its counters are its own (account = its rank).
                let params = run_device(run, &partition, c.as_mut(), 0, &mut sink);
                match (params, writer) {
                    (Ok(Some(p)), Some(w)) => Ok(Some(w.finish(p))),
                    (Ok(_), _) => Ok(None),
                    // Every device learns of an out-of-memory at the same step and returns (so
                    // `auto` can try the next layout on every rank); any other failure ends the job.
                    // A preempted run stops on every rank at the same step, its checkpoint saved.
                    (
                        Err(
                            e @ (EngineError::OutOfMemory { .. }
                            | EngineError::PeerOutOfMemory(_)
                            | EngineError::Preempted { .. }),
                        ),
                        _,
                    ) => Err(e),
                    (Err(e), _) => {
                        // Rank 0 says what the flight records say (the others' are written as
                        // they give up) before the job ends.
                        let e = if crate::comm::Comm::rank(c.as_ref()) == 0 {
                            let out = &run.cfg.checkpointing.out_dir;
                            let wait = std::time::Duration::from_secs(5);
                            super::hang::explain(out, run.layout.world_size(), wait, e)
                        } else {
                            e
                        };
                        super::rank_status::note(&format!("error: {e}"));
                        c.abort(&e.to_string(), 1) // `abort` names the rank
                    }
                }
            }
        };
        out.map_err(|e| with_prediction(e, &layout, &coords, &predicted))
    }
}

/// Every device on a thread of its own; device 0's figures travel to this thread, which owns the
/// metrics file and the callback.
fn on_threads(
    run: &TrainingRun,
    partition: &ferrotron_core::schedule::StagePartition,
    writer: Option<MetricsWriter>,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<Option<RunOutcome>> {
    let world = run.layout.world_size();
    if world > memory::MAX_DEVICES {
        return Err(EngineError::Invalid(format!(
            "layout `{}` has {world} devices; one process accounts for at most {}",
            run.layout,
            memory::MAX_DEVICES
        )));
    }
    let mut writer = writer.expect("the threads backend reports its runs");
    let accounts = memory::Accounts::claim(world);
    let (tx, rx) = mpsc::channel::<Option<StepFigures>>();
    let tx = Mutex::new(tx);
    // A device alone in the process computes on several threads: its clock is elapsed time.
    let clock = if run.kernel_threads > 1 {
        ClockSource::Wall
    } else {
        ClockSource::ThreadCpu
    };
    let results = std::thread::scope(|scope| -> Result<_> {
        let (tx, accounts) = (&tx, &accounts);
        let devices = scope.spawn(move || {
            let timeout = run
                .cfg
                .parallelism
                .peer_timeout
                .map_or(PEER_TIMEOUT, Duration::from_secs_f64);
            let results = ThreadWorld::new(world)
                .timeout(timeout)
                .clock(clock)
                .run(|c| {
                    let mut sink = |f: StepFigures| {
                        let _ = tx.lock().expect("no panics").send(Some(f));
                        Ok(())
                    };
                    run_device(run, partition, c, accounts.base, &mut sink)
                });
            let _ = tx.lock().expect("no panics").send(None);
            results
        });
        while let Ok(Some(f)) = rx.recv() {
            writer.step(f, on_step)?;
        }
        Ok(devices.join().expect("the device threads are joined"))
    })?;
    first_error_or_model(results).map(|p| Some(writer.finish(p)))
}

/// The model device 0 gathered, or the error that ended the run: a device's own out-of-memory
/// before its peers' reports of it, the first device's error otherwise.
fn first_error_or_model(
    results: Vec<crate::comm::CommResult<Result<Option<crate::transformer::ParamStore>>>>,
) -> Result<crate::transformer::ParamStore> {
    let mut params = None;
    let mut first_error = None;
    for (r, res) in results.into_iter().enumerate() {
        match res.map_err(|e| EngineError::Invalid(format!("device {r}: {e}")))? {
            Ok(Some(p)) => params = Some(p),
            Ok(None) => {}
            // Every device stopped at the same step, with the same error.
            Err(e @ (EngineError::OutOfMemory { .. } | EngineError::Preempted { .. })) => {
                return Err(e)
            }
            Err(e @ EngineError::PeerOutOfMemory(_)) => {
                first_error.get_or_insert(e);
            }
            Err(e) => {
                first_error.get_or_insert(EngineError::Invalid(format!("device {r}: {e}")));
            }
        }
    }
    match (first_error, params) {
        (Some(e), _) => Err(e),
        (None, Some(p)) => Ok(p),
        (None, None) => Err(EngineError::Invalid("device 0 returned no model".into())),
    }
}

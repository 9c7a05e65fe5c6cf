//! Whole tensors from the devices' shards: the trained model onto rank 0, and one step's loss and
//! gradients collected from every device (for `grads`, `verify` and `profile`).

use super::MeshStep;
use crate::comm::{Comm, CommStats};
use crate::error::{EngineError, Result};
use crate::memory;
use crate::parallel::pipeline::{DeviceResult, PipelineRun};
use crate::parallel::tensor::gather_tensor;
use crate::transformer::ParamStore;
use ferrotron_core::rank::Coords;

impl MeshStep<'_> {
    /// The whole model's parameters, gathered from every device onto rank 0 (`None` elsewhere).
    /// Every device must call it.
    pub fn gather_params<C: Comm>(
        &self,
        c: &mut C,
        dev: &mut super::Device,
    ) -> Result<Option<ParamStore>> {
        let mine = dev.zero.full_params(c)?;
        self.gather_to_root(c, mine, 1 << 61)
    }

    /// Whether device `rank` is among those whose stores together hold every tensor: the first
    /// replica of each shard, or under expert parallelism the first expert-parallel group of
    /// replicas (between them, every expert).
    fn holds_first_copies(&self, rank: usize) -> bool {
        self.mesh.replica_index(rank) < self.layout.ep.max(1)
    }

    /// The model's whole tensors from the stores of the devices that hold first copies
    /// (`store_of(rank)`): each tensor from the first replica holding it, its tensor-parallel
    /// shards joined (under `etp=1` a routed expert's from the one device of the group holding
    /// it whole).
    fn assemble<'s>(&self, store_of: &dyn Fn(usize) -> &'s ParamStore) -> Result<ParamStore> {
        let mut full = ParamStore::zeros(self.params.specs().to_vec());
        let mut done = vec![false; full.specs.len()];
        let (cp, ep) = (self.mesh.cp, self.layout.ep.max(1));
        for pp in 0..self.mesh.pp {
            for d in 0..ep {
                let ranks: Vec<usize> = (0..self.mesh.tp)
                    .map(|tp| {
                        let (cp, dp) = (d % cp, d / cp);
                        self.mesh.rank_of(Coords { tp, cp, dp, pp })
                    })
                    .collect();
                let whole_experts = self.layout.expert_blocks() > 1;
                for &holder in &ranks {
                    for spec in &store_of(holder).specs {
                        let id = full.id(&spec.name).expect("model parameter");
                        if std::mem::replace(&mut done[id], true) {
                            continue;
                        }
                        let held = |r: usize| {
                            store_of(r)
                                .get(&spec.name)
                                .expect("a stage's devices hold its parameters")
                        };
                        let shards: Vec<&[f32]> =
                            if whole_experts && self.cfg.routed_expert_of(&spec.name).is_some() {
                                vec![held(holder)]
                            } else {
                                ranks.iter().map(|&r| held(r)).collect()
                            };
                        full.tensors[id] = gather_tensor(self.cfg, &full.specs[id], &shards)?;
                    }
                }
            }
        }
        Ok(full)
    }

    /// Sends the whole-shard stores of the devices holding first copies to rank 0, which
    /// assembles the model's tensors.
    fn gather_to_root<C: Comm>(
        &self,
        c: &mut C,
        mine: ParamStore,
        tag: u64,
    ) -> Result<Option<ParamStore>> {
        if c.rank() != 0 {
            if self.holds_first_copies(c.rank()) {
                for (i, t) in mine.tensors.iter().enumerate() {
                    c.send(0, t, tag + i as u64)?;
                }
            }
            return Ok(None);
        }
        let mut stores = std::collections::HashMap::new();
        stores.insert(0, mine);
        for r in (1..self.world()).filter(|&r| self.holds_first_copies(r)) {
            let mut s = ParamStore::zeros(self.device_specs(r)?);
            for (i, t) in s.tensors.iter_mut().enumerate() {
                c.recv(r, t, tag + i as u64)?;
            }
            stores.insert(r, s);
        }
        Ok(Some(self.assemble(&|r| &stores[&r])?))
    }

    /// Runs this process's device of the step and collects every device's loss and gradients on
    /// rank 0, which returns the combined run (every other rank returns `None`). The entry for
    /// backends with one device per process (MPI); other ranks' communication statistics stay with
    /// them.
    pub fn run_collected<C: Comm>(&self, c: &mut C) -> Result<Option<PipelineRun>> {
        if c.world_size() != self.world() {
            return Err(EngineError::Invalid(format!(
                "layout `{}` needs {} devices, the job has {} ranks",
                self.layout,
                self.world(),
                c.world_size()
            )));
        }
        let wall = std::time::Instant::now();
        let mine = self.run_device(c, 0)?;
        // Tags above any pipeline tag (those fit in 48 bits).
        const COLLECT: u64 = 1 << 60;
        if c.rank() != 0 {
            let head = [
                mine.loss,
                mine.end,
                mine.stats.compute_time_s,
                mine.peak as f64,
                mine.peak_bytes as f64,
            ];
            c.send(0, &head, COLLECT)?;
            for (i, t) in mine.grads.tensors.iter().enumerate() {
                c.send(0, t, COLLECT + 1 + i as u64)?;
            }
            return Ok(None);
        }
        let mut results = vec![mine];
        for r in 1..self.world() {
            let mut head = [0f64; 5];
            c.recv(r, &mut head, COLLECT)?;
            let mut grads = ParamStore::zeros(self.device_specs(r)?);
            for (i, t) in grads.tensors.iter_mut().enumerate() {
                c.recv(r, t, COLLECT + 1 + i as u64)?;
            }
            results.push(DeviceResult {
                loss: head[0],
                grads,
                stats: CommStats {
                    rank: r,
                    compute_time_s: head[2],
                    ..CommStats::default()
                },
                peak: head[3] as usize,
                peak_bytes: head[4] as usize,
                end: head[1],
                timeline: Vec::new(),
                memory: memory::DeviceMemory::default(),
            });
        }
        self.combine(results, wall.elapsed().as_secs_f64())
            .map(Some)
    }

    /// Combines every device's result (in rank order) into the step's loss and whole gradients.
    pub fn combine(&self, results: Vec<DeviceResult>, wall_time_s: f64) -> Result<PipelineRun> {
        let full = self.assemble(&|r| &results[r].grads)?;
        let mut run = PipelineRun {
            loss: 0.0,
            grads: ParamStore::zeros(Vec::new()),
            stats: Vec::new(),
            peak_stashed: Vec::new(),
            peak_stash_bytes: Vec::new(),
            device_time_s: Vec::new(),
            compute_time_s: Vec::new(),
            wall_time_s,
            timeline: Vec::new(),
            grid: *self.mesh,
            memory: Vec::new(),
        };
        for r in results {
            run.loss += r.loss;
            run.compute_time_s.push(r.stats.compute_time_s);
            run.stats.push(r.stats);
            run.peak_stashed.push(r.peak);
            run.peak_stash_bytes.push(r.peak_bytes);
            run.device_time_s.push(r.end);
            run.timeline.push(r.timeline);
            run.memory.push(r.memory);
        }
        run.loss /= self.total_tokens as f64;
        run.grads = full;
        Ok(run)
    }
}

//! Fitting a cluster's time constants to measured runs: each run is priced by the planner (the same
//! schedule simulation and cost model as `plan`), and the constants named by [`FitParam`] are moved
//! to minimise the runs' squared log errors. The memory and byte arithmetic is exact and is not fitted.

use super::{evaluate, AttentionKernel, Plan, PlanInput, PlanModel, StateDtypes};
use crate::error::{ConfigError, Result};
use crate::layout::Layout;
use crate::topology::Cluster;

/// What was measured of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Measured {
    /// Seconds per optimizer step.
    StepTime(f64),
    /// Hardware FLOP/s per device (recomputation counted), in TFLOP/s, as papers report them.
    TflopsPerDevice(f64),
}

/// One measured run: what ran, on how many nodes of the cluster, and what it achieved.
#[derive(Debug, Clone)]
pub struct MeasuredRun {
    pub name: String,
    pub model: PlanModel,
    pub layout: Layout,
    pub seq: usize,
    pub global_batch: usize,
    pub nodes: usize,
    pub precision: StateDtypes,
    /// What its attention kept for backward (published runs before FlashAttention materialised
    /// the probabilities; this engine's runs do not).
    pub attention: AttentionKernel,
    pub measured: Measured,
}

impl MeasuredRun {
    /// The planner's input for this run on `cluster` (its node count replaced by the run's).
    pub fn input(&self, cluster: &Cluster) -> PlanInput {
        let mut c = cluster.clone();
        c.nodes = self.nodes;
        PlanInput {
            precision: self.precision,
            attention: self.attention,
            memory_reserve: 0.0,
            ..PlanInput::new(self.model.clone(), c, self.seq, self.global_batch)
        }
    }

    /// The planner's figure for what was measured (step seconds or TFLOP/s per device).
    pub fn predict(&self, cluster: &Cluster) -> Result<f64> {
        let p: Plan = evaluate(&self.input(cluster), &self.layout)?;
        if p.step_time_s <= 0.0 {
            return Err(ConfigError::Invalid(format!(
                "run `{}`: the model is a bare parameter count, which has no time model (give its shape)",
                self.name
            )));
        }
        Ok(match self.measured {
            Measured::StepTime(_) => p.step_time_s,
            Measured::TflopsPerDevice(_) => p.tflops_per_device,
        })
    }

    pub fn value(&self) -> f64 {
        match self.measured {
            Measured::StepTime(v) | Measured::TflopsPerDevice(v) => v,
        }
    }

    /// Relative error of the prediction on `cluster`: predicted / measured − 1.
    pub fn error(&self, cluster: &Cluster) -> Result<f64> {
        Ok(self.predict(cluster)? / self.value() - 1.0)
    }
}

/// A time constant calibration may move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitParam {
    GemmEfficiency,
    GemmHalfWidth,
    AttentionEfficiency,
    LinkEfficiency,
    DpOverlap,
    MemoryBandwidth,
    IntraLatency,
    InterLatency,
}

impl FitParam {
    pub const ALL: [FitParam; 8] = [
        FitParam::GemmEfficiency,
        FitParam::GemmHalfWidth,
        FitParam::AttentionEfficiency,
        FitParam::LinkEfficiency,
        FitParam::DpOverlap,
        FitParam::MemoryBandwidth,
        FitParam::IntraLatency,
        FitParam::InterLatency,
    ];

    /// The name used by `--fit` and the cluster file.
    pub fn name(self) -> &'static str {
        match self {
            FitParam::GemmEfficiency => "gemm_efficiency_max",
            FitParam::GemmHalfWidth => "gemm_half_width",
            FitParam::AttentionEfficiency => "attention_efficiency",
            FitParam::LinkEfficiency => "link_efficiency",
            FitParam::DpOverlap => "dp_overlap",
            FitParam::MemoryBandwidth => "memory_bandwidth_bytes_per_s",
            FitParam::IntraLatency => "intra_node.latency_s",
            FitParam::InterLatency => "inter_node.latency_s",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s || p.name().split('.').next() == Some(s))
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "--fit: `{s}` is not a time constant (known: {})",
                    Self::ALL.map(|p| p.name()).join(", ")
                ))
            })
    }

    pub fn get(self, c: &Cluster) -> f64 {
        match self {
            FitParam::GemmEfficiency => c.calibration.gemm_efficiency_max,
            FitParam::GemmHalfWidth => c.calibration.gemm_half_width,
            FitParam::AttentionEfficiency => c.calibration.attention_efficiency,
            FitParam::LinkEfficiency => c.calibration.link_efficiency,
            FitParam::DpOverlap => c.calibration.dp_overlap,
            FitParam::MemoryBandwidth => c.memory_bandwidth_bytes_per_s,
            FitParam::IntraLatency => c.intra_node.latency_s,
            FitParam::InterLatency => c.inter_node.latency_s,
        }
    }

    /// Sets the constant, kept in its valid range (fractions in (0, 1], attention's efficiency in
    /// (0, 2], the rest positive).
    pub fn set(self, c: &mut Cluster, v: f64) {
        let fraction = v.clamp(1e-4, 1.0);
        match self {
            FitParam::GemmEfficiency => c.calibration.gemm_efficiency_max = fraction,
            FitParam::GemmHalfWidth => c.calibration.gemm_half_width = v.max(1e-3),
            FitParam::AttentionEfficiency => {
                c.calibration.attention_efficiency =
                    v.clamp(1e-4, crate::topology::MAX_ATTENTION_EFFICIENCY)
            }
            FitParam::LinkEfficiency => c.calibration.link_efficiency = fraction,
            FitParam::DpOverlap => c.calibration.dp_overlap = v.clamp(0.0, 1.0),
            FitParam::MemoryBandwidth => c.memory_bandwidth_bytes_per_s = v.max(1.0),
            FitParam::IntraLatency => c.intra_node.latency_s = v.max(0.0),
            FitParam::InterLatency => c.inter_node.latency_s = v.max(0.0),
        }
    }
}

/// The constants a fit moves when none are named: all of them, in [`FitParam::ALL`]'s order (n runs
/// move the first n − 1, the GEMM curve first, which any step-time data pin down; the prior holds
/// a constant the runs do not determine near the starting cluster's). On Narayanan et al.'s ten
/// runs each comes to a physical value: the memory bandwidth within 0.2% of the A100's HBM2e, no
/// overlap of the data-parallel reduction (as Megatron-LM ran then).
pub const DEFAULT_FIT: [FitParam; 8] = FitParam::ALL;

/// How strongly a fit is held to the starting constants (per squared log-ratio), so that a few runs
/// cannot push constants the data do not determine to absurd values.
const PRIOR_WEIGHT: f64 = 1e-4;

/// Mean squared log error of `runs` on `cluster`, plus the prior's pull towards `start`.
fn objective(runs: &[MeasuredRun], cluster: &Cluster, start: &Cluster, params: &[FitParam]) -> f64 {
    let mut sum = 0.0;
    for r in runs {
        match r.predict(cluster) {
            Ok(p) if p.is_finite() && p > 0.0 => sum += (p / r.value()).ln().powi(2),
            _ => return f64::INFINITY,
        }
    }
    let prior: f64 = params
        .iter()
        .map(|p| {
            let (a, b) = (p.get(cluster), p.get(start));
            if a > 0.0 && b > 0.0 {
                (a / b).ln().powi(2)
            } else {
                (a - b).powi(2)
            }
        })
        .sum();
    sum / runs.len().max(1) as f64 + PRIOR_WEIGHT * prior
}

/// `start` with `params` moved to fit `runs` (Nelder–Mead over the constants' logarithms; a constant
/// at zero moves additively).
pub fn fit(runs: &[MeasuredRun], start: &Cluster, params: &[FitParam]) -> Result<Cluster> {
    if runs.is_empty() {
        return Err(ConfigError::Invalid("calibrate: no measured runs".into()));
    }
    for r in runs {
        r.predict(start)
            .map_err(|e| ConfigError::Invalid(format!("run `{}`: {e}", r.name)))?;
    }
    if params.is_empty() {
        return Ok(start.clone());
    }
    let logs: Vec<bool> = params.iter().map(|p| p.get(start) > 0.0).collect();
    let apply = |x: &[f64]| {
        let mut c = start.clone();
        for ((p, &v), &log) in params.iter().zip(x).zip(&logs) {
            p.set(&mut c, if log { v.exp() } else { v });
        }
        c
    };
    let x0: Vec<f64> = params
        .iter()
        .zip(&logs)
        .map(|(p, &log)| if log { p.get(start).ln() } else { p.get(start) })
        .collect();
    let cost = |x: &[f64]| objective(runs, &apply(x), start, params);
    let best = nelder_mead(&x0, 0.3, 400, cost);
    Ok(apply(&best))
}

/// Minimises `f` from `x0` (simplex of side `step`), at most `iterations` steps.
fn nelder_mead(x0: &[f64], step: f64, iterations: usize, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let n = x0.len();
    let mut simplex: Vec<(Vec<f64>, f64)> = (0..=n)
        .map(|i| {
            let mut x = x0.to_vec();
            if i > 0 {
                x[i - 1] += step;
            }
            let v = f(&x);
            (x, v)
        })
        .collect();
    let along = |a: &[f64], b: &[f64], t: f64| -> Vec<f64> {
        a.iter().zip(b).map(|(a, b)| a + t * (b - a)).collect()
    };
    for _ in 0..iterations {
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        if (simplex[n].1 - simplex[0].1).abs() < 1e-12 {
            break;
        }
        let centroid: Vec<f64> = (0..n)
            .map(|j| simplex[..n].iter().map(|(x, _)| x[j]).sum::<f64>() / n as f64)
            .collect();
        let worst = simplex[n].0.clone();
        let reflected = along(&centroid, &worst, -1.0);
        let fr = f(&reflected);
        if fr < simplex[0].1 {
            let expanded = along(&centroid, &worst, -2.0);
            let fe = f(&expanded);
            simplex[n] = if fe < fr {
                (expanded, fe)
            } else {
                (reflected, fr)
            };
        } else if fr < simplex[n - 1].1 {
            simplex[n] = (reflected, fr);
        } else {
            let contracted = along(&centroid, &worst, 0.5);
            let fc = f(&contracted);
            if fc < simplex[n].1 {
                simplex[n] = (contracted, fc);
            } else {
                let best = simplex[0].0.clone();
                for point in simplex.iter_mut().skip(1) {
                    let x = along(&best, &point.0, 0.5);
                    let v = f(&x);
                    *point = (x, v);
                }
            }
        }
    }
    simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
    simplex.swap_remove(0).0
}

/// Each run's error before and after fitting on all runs, and when left out of the fit.
#[derive(Debug, Clone)]
pub struct RunErrors {
    pub name: String,
    pub measured: f64,
    pub before: f64,
    pub after: f64,
    /// Predicted by constants fitted to the other runs (none with a single run).
    pub left_out: Option<f64>,
}

/// Fits on every run, then once more leaving each run out in turn.
pub fn fit_with_errors(
    runs: &[MeasuredRun],
    start: &Cluster,
    params: &[FitParam],
) -> Result<(Cluster, Vec<RunErrors>)> {
    let fitted = fit(runs, start, params)?;
    let mut out = Vec::with_capacity(runs.len());
    for (i, r) in runs.iter().enumerate() {
        let left_out = if runs.len() > 1 {
            let others: Vec<MeasuredRun> = runs
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, r)| r.clone())
                .collect();
            Some(r.error(&fit(&others, start, params)?)?)
        } else {
            None
        };
        out.push(RunErrors {
            name: r.name.clone(),
            measured: r.value(),
            before: r.error(start)?,
            after: r.error(&fitted)?,
            left_out,
        });
    }
    Ok((fitted, out))
}

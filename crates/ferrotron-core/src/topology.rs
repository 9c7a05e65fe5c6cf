//! What a cluster is: nodes of devices, their memory and speed, and the two classes of link between
//! them. The planner prices layouts on it; the simulated interconnect of the threads backend charges by it.

use crate::error::{ConfigError, Result};

/// One class of link (inside a node, or between nodes).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Link {
    /// Bytes per second per device per direction.
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
}

/// The efficiency factors the time model uses. They live with the hardware they describe, each with
/// where it comes from; nothing in the planner adjusts individual results.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// Fraction of peak FLOP/s the largest GEMMs reach.
    pub gemm_efficiency_max: f64,
    /// Per-device GEMM width (√(h · h/tp)) at which GEMMs reach half of `gemm_efficiency_max`:
    /// efficiency = max · w / (w + half_width). Narrow GEMMs are launch- and memory-bound.
    pub gemm_half_width: f64,
    /// Fraction of the nominal link bandwidth that collectives achieve.
    pub link_efficiency: f64,
    /// Fraction of the data-parallel gradient reduction hidden behind the backward pass.
    pub dp_overlap: f64,
    /// Fraction of peak FLOP/s attention's QKᵀ and PV products reach, against their whole count
    /// (every query against every key, as model FLOPs count them): a causal kernel skips about half
    /// of them, so it can reach up to [`MAX_ATTENTION_EFFICIENCY`].
    #[serde(default = "default_attention_efficiency")]
    pub attention_efficiency: f64,
    /// The step time's relative error on this hardware as measured (the mean |error| of runs left
    /// out of the fit, else of the fit itself): predictions closer than this do not rank. None where
    /// it was never measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time_error: Option<f64>,
}

/// The largest attention efficiency: a causal kernel computes about half the products the planner
/// counts, so against that count it may run at up to twice the peak.
pub const MAX_ATTENTION_EFFICIENCY: f64 = 2.0;

fn default_attention_efficiency() -> f64 {
    0.5
}

/// A cluster given without its memory bandwidth gets this many FLOPs per byte (an A100's ratio).
pub const DEFAULT_FLOPS_PER_MEMORY_BYTE: f64 = 150.0;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Cluster {
    pub name: String,
    pub nodes: usize,
    pub devices_per_node: usize,
    pub device_memory_bytes: u64,
    /// Dense peak of one device in the compute precision (bf16 tensor cores on GPUs).
    pub peak_flops: f64,
    /// What memory-bound operations (norms, activations, the optimizer step) stream, bytes/s.
    #[serde(default)]
    pub memory_bandwidth_bytes_per_s: f64,
    pub intra_node: Link,
    pub inter_node: Link,
    pub calibration: Calibration,
}

/// Where ferrotron caches what it computed once per machine: `$XDG_CACHE_HOME/ferrotron` or
/// `~/.cache/ferrotron`.
pub fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ferrotron")
}

/// This CPU's model name and core count: a calibration holds only on the CPU it measured.
pub fn cpu_fingerprint() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model}, {cores} cores")
}

/// Where `calibrate --this-machine` caches this CPU's cluster file.
pub fn this_machine_cache() -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    cpu_fingerprint().hash(&mut h);
    cache_dir().join(format!("this-machine-{:016x}.toml", h.finish()))
}

/// The cached calibration of this CPU, when one was made (a cache that cannot be read is ignored:
/// the next `calibrate --this-machine` rewrites it).
fn this_machine_calibrated() -> Option<Cluster> {
    let path = this_machine_cache();
    path.is_file()
        .then(|| Cluster::read_file(&path).ok())
        .flatten()
        .map(|mut c| {
            c.name = "this-machine".into();
            c
        })
}

/// True when a `--cluster` item names a cluster file rather than a preset.
fn is_cluster_file(item: &str) -> bool {
    item.ends_with(".toml") || std::path::Path::new(item).is_file()
}

pub const CLUSTER_PRESETS: &[&str] = &["dgx-a100-80g", "dgx-h100-80g", "this-machine"];

const GB: f64 = 1e9;
const GIB: u64 = 1 << 30;

/// The most devices a cluster may have (a million: ten times the largest training clusters).
pub const MAX_DEVICES: usize = 1 << 20;

impl Cluster {
    pub fn world_size(&self) -> usize {
        self.nodes * self.devices_per_node
    }
    /// Rank r sits on node r / devices_per_node (the design's placement rule).
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.devices_per_node
    }

    /// This machine before `calibrate --this-machine` has measured it: one 2-core VM's figures (one
    /// core's f32 GEMM speed, ~100 GFLOP/s; shared memory as the link, ~10 GB/s memcpy). Its links
    /// are also the interconnect the calibration measures the threads backend against, whatever an
    /// earlier calibration found (measuring against a measured latency would add the overhead again
    /// at every calibration).
    pub fn this_machine_uncalibrated() -> Cluster {
        Cluster {
            name: "this-machine".into(),
            nodes: 1,
            devices_per_node: 8,
            device_memory_bytes: 3 * GIB,
            peak_flops: 100e9,
            memory_bandwidth_bytes_per_s: 10.0 * GB,
            intra_node: Link {
                bandwidth_bytes_per_s: 10.0 * GB,
                latency_s: 2e-6,
            },
            inter_node: Link {
                bandwidth_bytes_per_s: 1.0 * GB,
                latency_s: 50e-6,
            },
            calibration: Calibration {
                gemm_efficiency_max: 0.9,
                gemm_half_width: 32.0,
                link_efficiency: 1.0,
                dp_overlap: 0.0,
                attention_efficiency: 0.5,
                step_time_error: None,
            },
        }
    }

    /// A named machine (one node unless `nodes` is overridden).
    pub fn preset(name: &str) -> Result<Self> {
        Ok(match name {
            // DGX A100 80GB: 8 × A100 (312 TFLOP/s dense bf16), NVLink 3 / NVSwitch 600 GB/s
            // bidirectional per GPU = 300 GB/s per direction; 8 × HDR 200 Gb/s InfiniBand per node
            // = 25 GB/s per GPU per direction. The GEMM curve is fitted to the weak-scaling runs of
            // Narayanan et al. 2021 (Table 1) with this time model (`calibrate --fit
            // gemm_efficiency_max,gemm_half_width`), the other constants are the hardware's figures
            // and no overlap of the data-parallel reduction (as Megatron-LM ran then): every row
            // within 7.1% (see `plan::tests::narayanan_table1`). Fitting every constant to the table
            // (`calibrate --runs`) brings them to 1.4% mean.
            "dgx-a100-80g" => Cluster {
                name: name.into(),
                nodes: 1,
                devices_per_node: 8,
                device_memory_bytes: 80 * GIB,
                peak_flops: 312e12,
                // HBM2e of the 80 GB A100 SXM.
                memory_bandwidth_bytes_per_s: 2039.0 * GB,
                intra_node: Link {
                    bandwidth_bytes_per_s: 300.0 * GB,
                    latency_s: 5e-6,
                },
                inter_node: Link {
                    bandwidth_bytes_per_s: 25.0 * GB,
                    latency_s: 10e-6,
                },
                calibration: Calibration {
                    gemm_efficiency_max: 0.658,
                    gemm_half_width: 200.0,
                    link_efficiency: 0.8,
                    dp_overlap: 0.0,
                    attention_efficiency: 0.5,
                    // These constants' mean error on that table (`calibrate --runs` prints it as
                    // the error before the fit; the CI checks the two agree).
                    step_time_error: Some(0.0275),
                },
            },
            // DGX H100: 8 × H100 SXM (989 TFLOP/s dense bf16), NVLink 4 900 GB/s bidirectional =
            // 450 GB/s per direction; 8 × NDR 400 Gb/s = 50 GB/s per GPU. Same GEMM curve shape as
            // A100 (not separately fitted: no published table of the same kind).
            "dgx-h100-80g" => Cluster {
                name: name.into(),
                nodes: 1,
                devices_per_node: 8,
                device_memory_bytes: 80 * GIB,
                peak_flops: 989e12,
                memory_bandwidth_bytes_per_s: 3350.0 * GB,
                intra_node: Link {
                    bandwidth_bytes_per_s: 450.0 * GB,
                    latency_s: 5e-6,
                },
                inter_node: Link {
                    bandwidth_bytes_per_s: 50.0 * GB,
                    latency_s: 10e-6,
                },
                calibration: Calibration {
                    gemm_efficiency_max: 0.658,
                    gemm_half_width: 200.0,
                    link_efficiency: 0.8,
                    dp_overlap: 0.0,
                    attention_efficiency: 0.5,
                    step_time_error: None,
                },
            },
            // This machine running ferrotron's threads backend: 8 virtual devices, each a thread; what
            // `ferrotron calibrate --this-machine` measured on this CPU when it has run (cached per
            // CPU), the uncalibrated figures before that.
            "this-machine" => {
                this_machine_calibrated().unwrap_or_else(Cluster::this_machine_uncalibrated)
            }
            other => {
                return Err(ConfigError::Field {
                    file: "--cluster".into(),
                    field: "preset".into(),
                    msg: format!(
                        "unknown cluster preset `{other}` (known: {})",
                        CLUSTER_PRESETS.join(", ")
                    ),
                })
            }
        })
    }

    /// Every constant in range; each failure names its key.
    fn check(&self) -> Result<()> {
        let bad = |field: &str, msg: String| ConfigError::Field {
            file: "--cluster".into(),
            field: field.into(),
            msg,
        };
        for (field, ok) in [
            ("nodes", self.nodes > 0),
            ("devices_per_node", self.devices_per_node > 0),
            ("memory_gib", self.device_memory_bytes > 0),
            ("peak_tflops", self.peak_flops > 0.0),
            ("intra_gbs", self.intra_node.bandwidth_bytes_per_s > 0.0),
            (
                "inter_gbs",
                self.inter_node.bandwidth_bytes_per_s > 0.0 || self.nodes == 1,
            ),
            (
                "gemm_efficiency",
                self.calibration.gemm_efficiency_max > 0.0
                    && self.calibration.gemm_efficiency_max <= 1.0,
            ),
            (
                "link_efficiency",
                self.calibration.link_efficiency > 0.0 && self.calibration.link_efficiency <= 1.0,
            ),
            ("dp_overlap", self.calibration.dp_overlap <= 1.0),
            ("gemm_half_width", self.calibration.gemm_half_width > 0.0),
            (
                "attention_efficiency",
                self.calibration.attention_efficiency > 0.0
                    && self.calibration.attention_efficiency <= MAX_ATTENTION_EFFICIENCY,
            ),
            (
                "step_time_error",
                self.calibration
                    .step_time_error
                    .is_none_or(|e| (0.0..1.0).contains(&e)),
            ),
        ] {
            if !ok {
                return Err(bad(field, "missing, zero or out of range".into()));
            }
        }
        if self.nodes.saturating_mul(self.devices_per_node) > MAX_DEVICES {
            return Err(bad(
                "nodes",
                format!(
                    "{} nodes × {} devices is beyond the {MAX_DEVICES} devices the planner handles",
                    self.nodes, self.devices_per_node
                ),
            ));
        }
        Ok(())
    }

    /// A cluster file (TOML, as `ferrotron calibrate` writes it).
    pub fn read_file(path: &std::path::Path) -> Result<Self> {
        let bad = |msg: String| ConfigError::Field {
            file: path.to_path_buf(),
            field: "cluster".into(),
            msg,
        };
        let text = crate::bounded::read_to_string(path, crate::bounded::SETTINGS)
            .map_err(|e| bad(format!("cannot read: {e}")))?;
        let mut c: Cluster = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if c.memory_bandwidth_bytes_per_s <= 0.0 {
            c.memory_bandwidth_bytes_per_s = c.peak_flops / DEFAULT_FLOPS_PER_MEMORY_BYTE;
        }
        // The same checks as an inline spec: every constant in range.
        c.check().map_err(|e| bad(e.to_string()))?;
        Ok(c)
    }

    /// The cluster as a file `read_file` takes back: every constant named with its unit.
    pub fn to_toml(&self, header: &str) -> String {
        let body = toml::to_string_pretty(self).expect("a cluster serializes");
        let mut out = String::new();
        for line in header.lines() {
            out.push_str(&format!("# {line}\n"));
        }
        out.push_str(
            "# Units: bytes, bytes per second, seconds, FLOP/s; efficiencies and dp_overlap are \
             fractions;\n# gemm_half_width is the GEMM width √(n·k) at which GEMMs reach half of \
             gemm_efficiency_max.\n",
        );
        out.push_str(&body);
        out
    }

    /// `dgx-a100-80g`, `dgx-a100-80g,nodes=192`, `cluster.toml,nodes=4` (a cluster file), or inline
    /// `nodes=2,devices_per_node=8,memory_gib=80,peak_tflops=312,intra_gbs=300,inter_gbs=25`
    /// (optional: `intra_latency_us`, `inter_latency_us`, `memory_gbs` (default: peak / 150 FLOP per
    /// byte), `gemm_efficiency`, `gemm_half_width`, `attention_efficiency`, `link_efficiency`,
    /// `dp_overlap`).
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = |field: &str, msg: String| ConfigError::Field {
            file: "--cluster".into(),
            field: field.into(),
            msg,
        };
        let mut items = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .peekable();
        let mut c = match items.peek() {
            Some(first) if is_cluster_file(first) => {
                let c = Cluster::read_file(std::path::Path::new(first))?;
                items.next();
                c
            }
            Some(first) if !first.contains('=') => {
                let c = Cluster::preset(first)?;
                items.next();
                c
            }
            _ => Cluster {
                name: "custom".into(),
                nodes: 0,
                devices_per_node: 0,
                device_memory_bytes: 0,
                peak_flops: 0.0,
                memory_bandwidth_bytes_per_s: 0.0,
                intra_node: Link {
                    bandwidth_bytes_per_s: 0.0,
                    latency_s: 5e-6,
                },
                inter_node: Link {
                    bandwidth_bytes_per_s: 0.0,
                    latency_s: 10e-6,
                },
                calibration: Calibration {
                    gemm_efficiency_max: 0.6,
                    gemm_half_width: 160.0,
                    link_efficiency: 0.8,
                    dp_overlap: 0.0,
                    attention_efficiency: 0.5,
                    step_time_error: None,
                },
            },
        };
        let mut seen = Vec::new();
        for item in items {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| bad(item, "expected key=value".into()))?;
            if seen.contains(&k.trim()) {
                return Err(bad(k, "given twice".into()));
            }
            seen.push(k.trim());
            let x: f64 = v
                .trim()
                .parse()
                .map_err(|_| bad(k, format!("`{v}` is not a number")))?;
            if !(x.is_finite() && x >= 0.0) {
                return Err(bad(k, format!("`{v}` must be a non-negative number")));
            }
            let whole = || -> Result<usize> {
                if x.fract() == 0.0 && x >= 1.0 && x <= MAX_DEVICES as f64 {
                    Ok(x as usize)
                } else {
                    Err(bad(
                        k,
                        format!("`{v}` must be a whole number from 1 to {MAX_DEVICES}"),
                    ))
                }
            };
            // A hardware or efficiency constant changed: the error measured with the old ones no
            // longer holds (more nodes of the same devices keep it).
            if !["nodes", "memory_gib"].contains(&k.trim()) {
                c.calibration.step_time_error = None;
            }
            match k.trim() {
                "nodes" => c.nodes = whole()?,
                "devices_per_node" => c.devices_per_node = whole()?,
                "memory_gib" => c.device_memory_bytes = (x * GIB as f64) as u64,
                "peak_tflops" => c.peak_flops = x * 1e12,
                "intra_gbs" => c.intra_node.bandwidth_bytes_per_s = x * GB,
                "inter_gbs" => c.inter_node.bandwidth_bytes_per_s = x * GB,
                "intra_latency_us" => c.intra_node.latency_s = x * 1e-6,
                "inter_latency_us" => c.inter_node.latency_s = x * 1e-6,
                "gemm_efficiency" => c.calibration.gemm_efficiency_max = x,
                "gemm_half_width" => c.calibration.gemm_half_width = x,
                "link_efficiency" => c.calibration.link_efficiency = x,
                "dp_overlap" => c.calibration.dp_overlap = x,
                "attention_efficiency" => c.calibration.attention_efficiency = x,
                "memory_gbs" => c.memory_bandwidth_bytes_per_s = x * GB,
                other => return Err(bad(other, "unknown cluster key".into())),
            }
        }
        if c.memory_bandwidth_bytes_per_s == 0.0 {
            c.memory_bandwidth_bytes_per_s = c.peak_flops / DEFAULT_FLOPS_PER_MEMORY_BYTE;
        }
        c.check()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_inline_and_errors() {
        let c = Cluster::parse("dgx-a100-80g,nodes=192").unwrap();
        assert_eq!(c.world_size(), 1536);
        let c = Cluster::parse(
            "nodes=2,devices_per_node=4,memory_gib=24,peak_tflops=100,intra_gbs=100,inter_gbs=10",
        )
        .unwrap();
        assert_eq!((c.world_size(), c.device_memory_bytes), (8, 24 << 30));
        for (spec, field) in [
            ("dgx-z", "dgx-z"),
            ("dgx-a100-80g,nodes=-1", "nodes"),
            ("nodes=2", "devices_per_node"),
            ("dgx-a100-80g,foo=1", "foo"),
        ] {
            let e = Cluster::parse(spec).unwrap_err().to_string();
            assert!(e.contains(field), "{spec}: {e}");
        }
    }
}

//! One `Layout` describes how a run is cut: the device mesh (dp × pp × tp, interleaving vpp), micro-
//! batching, schedule, ZeRO stage, recompute and sequence parallelism. The `--layout` spec is its text form.

use crate::error::{ConfigError, Result};
use crate::model::ModelConfig;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
    Zbh1,
    /// PipeDream (Narayanan et al., SOSP 2019): 1F1B without flushes, each stage updating after
    /// every backward, weight stashing. Asynchronous: it changes the optimizer's semantics.
    #[serde(rename = "pipedream")]
    PipeDream,
    /// PipeDream-2BW (Narayanan et al., ICML 2021): 1F1B without flushes, one update per m
    /// micro-batches, two weight versions, `W(t+1) = W(t) − ν·∇f(W(t−1))`. Asynchronous.
    #[serde(rename = "2bw")]
    TwoBw,
}

impl Schedule {
    pub const NAMES: &'static [&'static str] =
        &["gpipe", "1f1b", "interleaved", "zbh1", "pipedream", "2bw"];
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "gpipe" => Self::Gpipe,
            "1f1b" => Self::OneFOneB,
            "interleaved" => Self::Interleaved,
            "zbh1" => Self::Zbh1,
            "pipedream" => Self::PipeDream,
            "2bw" => Self::TwoBw,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Interleaved => "interleaved",
            Self::Zbh1 => "zbh1",
            Self::PipeDream => "pipedream",
            Self::TwoBw => "2bw",
        }
    }
    /// Whether the schedule runs without flushes across optimizer steps, so that micro-batches see
    /// weights some updates old (a change of the optimizer's semantics, not only of timing).
    pub fn is_async(self) -> bool {
        matches!(self, Self::PipeDream | Self::TwoBw)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    /// Recompute attention's core in backward (Korthikanti et al. 2022). The engine's
    /// memory-efficient attention always does, keeping no probabilities: there it equals `None`.
    Selective,
    /// Keep each layer's input only and run the layer forward again in backward.
    Full,
}

impl Recompute {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Self::None,
            "selective" => Self::Selective,
            "full" => Self::Full,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Selective => "selective",
            Self::Full => "full",
        }
    }
}

/// How a context-parallel group exchanges what attention needs across the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpComm {
    /// Ring attention: K/V blocks travel around the group while each device attends to the block
    /// in hand; their gradients travel back in the backward.
    #[default]
    Ring,
    /// Ulysses: an all-to-all turns sequence shards into head shards before attention (each device
    /// attends whole sequences with some heads) and back after.
    A2a,
}

impl CpComm {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ring" => Some(Self::Ring),
            "a2a" => Some(Self::A2a),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::A2a => "a2a",
        }
    }
}

/// The most pipeline stages a layout may name one by one (`stages=5+6+…`).
pub const MAX_NAMED_STAGES: usize = 256;

/// Layers per (virtual) pipeline stage as the user named them, `stages=5+6+6+…` in stage order. A
/// fixed-size array keeps `Layout` a plain value; it serializes as the list of counts.
#[derive(Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "Vec<usize>", try_from = "Vec<usize>")]
pub struct NamedStages {
    len: usize,
    counts: [u32; MAX_NAMED_STAGES],
}

impl NamedStages {
    pub fn new(counts: &[usize]) -> Result<Self> {
        let bad = |msg: String| ConfigError::Field {
            file: "--layout".into(),
            field: "stages".into(),
            msg,
        };
        if counts.is_empty() || counts.len() > MAX_NAMED_STAGES {
            return Err(bad(format!(
                "name from 1 to {MAX_NAMED_STAGES} stages, not {}",
                counts.len()
            )));
        }
        let mut out = NamedStages {
            len: counts.len(),
            counts: [0; MAX_NAMED_STAGES],
        };
        for (slot, &c) in out.counts.iter_mut().zip(counts) {
            if c == 0 || c > MAX_LAYOUT_SIZE {
                return Err(bad(format!(
                    "every stage needs from 1 to {MAX_LAYOUT_SIZE} layers, not {c}"
                )));
            }
            *slot = c as u32;
        }
        Ok(out)
    }

    /// `5+6+6`.
    pub fn parse(text: &str) -> Result<Self> {
        let counts: Vec<usize> = text
            .split('+')
            .map(|c| {
                c.trim().parse().map_err(|_| ConfigError::Field {
                    file: "--layout".into(),
                    field: "stages".into(),
                    msg: format!("`{text}` is not layer counts joined by `+` (e.g. 5+6+6)"),
                })
            })
            .collect::<Result<_>>()?;
        Self::new(&counts)
    }

    /// Layers of each stage, in stage order.
    pub fn counts(&self) -> Vec<usize> {
        self.counts[..self.len]
            .iter()
            .map(|&c| c as usize)
            .collect()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn total(&self) -> usize {
        self.counts().iter().sum()
    }
}

impl From<NamedStages> for Vec<usize> {
    fn from(n: NamedStages) -> Self {
        n.counts()
    }
}

impl TryFrom<Vec<usize>> for NamedStages {
    type Error = ConfigError;
    fn try_from(v: Vec<usize>) -> Result<Self> {
        Self::new(&v)
    }
}

impl fmt::Debug for NamedStages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for NamedStages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.counts().iter().map(|c| c.to_string()).collect();
        write!(f, "{}", parts.join("+"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// Context parallelism: every sequence split over this many devices.
    #[serde(default = "one")]
    pub cp: usize,
    #[serde(default)]
    pub cp_comm: CpComm,
    /// Expert parallelism: a mixture of experts' experts divided over this many of the replicas
    /// (dp·cp), which exchange tokens with all-to-alls (see [`crate::rank::RankGrid::expert_ranks`]).
    #[serde(default = "one")]
    pub ep: usize,
    /// The experts' tensor-parallel split (Megatron-Core's expert tensor parallelism): `None`, every
    /// expert's columns over the tp group as the dense MLP's; `Some(1)` (`etp=1`), every expert
    /// whole on one device of the group, which divides the experts instead (see
    /// [`Layout::expert_blocks`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<usize>,
    pub vpp: usize,
    pub zero: u8,
    pub micro_batch_size: usize,
    pub schedule: Schedule,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    /// Layers per virtual stage when the user named them; otherwise the layers are split by compute
    /// (`StagePartition::for_layout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<NamedStages>,
}

fn one() -> usize {
    1
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            cp_comm: CpComm::Ring,
            ep: 1,
            etp: None,
            vpp: 1,
            zero: 0,
            micro_batch_size: 1,
            schedule: Schedule::OneFOneB,
            sequence_parallel: false,
            recompute: Recompute::None,
            stages: None,
        }
    }
}

/// A parsed `--layout`: either a concrete layout (keys may still say `auto`) or "let the planner choose".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutSpec {
    /// The spec as written (trimmed): what a settings file records and `Display` prints.
    pub text: String,
    pub layout: Layout,
    /// Keys whose value was `auto` (or the whole spec was `auto`): the planner fills them.
    pub auto_keys: Vec<String>,
    /// Keys the user wrote explicitly.
    pub given_keys: Vec<String>,
}

/// The largest value of a layout's integer keys: products of a few of them stay far from overflow.
pub const MAX_LAYOUT_SIZE: usize = 1 << 20;

pub const LAYOUT_KEYS: &[&str] = &[
    "dp",
    "tp",
    "pp",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "vpp",
    "zero",
    "mbs",
    "schedule",
    "sp",
    "recompute",
    "stages",
];

impl Default for LayoutSpec {
    /// One device.
    fn default() -> Self {
        Self::parse("").expect("the empty spec parses")
    }
}

impl fmt::Display for LayoutSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for LayoutSpec {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

crate::serde_as_text!(LayoutSpec);

impl LayoutSpec {
    /// Whether the planner chooses some of the layout (`auto`, or a key that says `auto`).
    pub fn is_auto(&self) -> bool {
        !self.auto_keys.is_empty()
    }

    /// Whether layout `l` (a planner's candidate) agrees with every key given explicitly (not
    /// `auto`): what `plan` and `train` keep of the search when some keys are given. Named
    /// stages are the search's to split by compute and are not compared.
    pub fn admits(&self, l: &Layout) -> bool {
        let want = &self.layout;
        self.given_keys
            .iter()
            .filter(|k| !self.auto_keys.contains(k))
            .all(|k| match k.as_str() {
                "dp" => l.dp == want.dp,
                "tp" => l.tp == want.tp,
                "pp" => l.pp == want.pp,
                "cp" => l.cp == want.cp,
                "cp_comm" => l.cp <= 1 || l.cp_comm == want.cp_comm,
                "ep" => l.ep == want.ep,
                "etp" => (l.etp == Some(1)) == (want.etp == Some(1)),
                "vpp" => l.vpp == want.vpp,
                "zero" => l.zero == want.zero,
                "mbs" => l.micro_batch_size == want.micro_batch_size,
                "schedule" => l.schedule == want.schedule,
                "sp" => l.sequence_parallel == want.sequence_parallel,
                "recompute" => l.recompute == want.recompute,
                _ => true,
            })
    }

    /// Parses `dp=2,tp=2,pp=2,cp=1,cp_comm=ring,ep=1,vpp=1,zero=1,mbs=1,schedule=1f1b,sp=false,
    /// recompute=none` (any subset),
    /// optionally `stages=5+6+…` (layers per virtual stage), or `auto`.
    pub fn parse(spec: &str) -> Result<Self> {
        let mut out = LayoutSpec {
            text: spec.trim().to_string(),
            layout: Layout::default(),
            auto_keys: Vec::new(),
            given_keys: Vec::new(),
        };
        let spec = spec.trim();
        if spec == "auto" {
            out.auto_keys = LAYOUT_KEYS
                .iter()
                .filter(|&&k| k != "stages")
                .map(|s| s.to_string())
                .collect();
            return Ok(out);
        }
        let bad = |key: &str, msg: String| ConfigError::Field {
            file: "--layout".into(),
            field: key.to_string(),
            msg,
        };
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| bad(item, "expected key=value".into()))?;
            let (key, value) = (key.trim(), value.trim());
            if !LAYOUT_KEYS.contains(&key) {
                return Err(bad(
                    key,
                    format!("unknown key (known: {})", LAYOUT_KEYS.join(", ")),
                ));
            }
            if out.given_keys.iter().any(|k| k == key) {
                return Err(bad(key, "given twice".into()));
            }
            out.given_keys.push(key.to_string());
            if value == "auto" {
                // Stages split by compute is the default, not a choice left to the planner.
                if key != "stages" {
                    out.auto_keys.push(key.to_string());
                }
                continue;
            }
            let positive = |v: &str| -> Result<usize> {
                match v.parse::<usize>() {
                    Ok(n) if n > MAX_LAYOUT_SIZE => Err(bad(
                        key,
                        format!("{n} is beyond the largest size handled ({MAX_LAYOUT_SIZE})"),
                    )),
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(bad(key, format!("`{v}` is not a positive integer"))),
                }
            };
            let l = &mut out.layout;
            match key {
                "dp" => l.dp = positive(value)?,
                "tp" => l.tp = positive(value)?,
                "pp" => l.pp = positive(value)?,
                "cp" => l.cp = positive(value)?,
                "ep" => l.ep = positive(value)?,
                "etp" => l.etp = Some(positive(value)?),
                "cp_comm" => {
                    l.cp_comm = CpComm::parse(value)
                        .ok_or_else(|| bad(key, format!("`{value}` is not ring or a2a")))?
                }
                "vpp" => l.vpp = positive(value)?,
                "mbs" => l.micro_batch_size = positive(value)?,
                "zero" => {
                    l.zero = match value.parse::<u8>() {
                        Ok(z) if z <= 3 => z,
                        _ => return Err(bad(key, format!("`{value}` is not a ZeRO stage (0-3)"))),
                    }
                }
                "schedule" => {
                    l.schedule = Schedule::parse(value).ok_or_else(|| {
                        bad(
                            key,
                            format!(
                                "`{value}` is not a schedule ({})",
                                Schedule::NAMES.join(", ")
                            ),
                        )
                    })?
                }
                "sp" => {
                    l.sequence_parallel = match value {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => return Err(bad(key, format!("`{value}` is not true or false"))),
                    }
                }
                "recompute" => {
                    l.recompute = Recompute::parse(value).ok_or_else(|| {
                        bad(key, format!("`{value}` is not none, selective or full"))
                    })?
                }
                "stages" => l.stages = Some(NamedStages::parse(value)?),
                _ => unreachable!("key list checked above"),
            }
        }
        out.refuse_meaningless()?;
        Ok(out)
    }

    /// Refuses keys given that would do nothing, or something other than they say, beside the
    /// others as given (a key the planner chooses, `auto`, is not judged).
    fn refuse_meaningless(&self) -> Result<()> {
        let given = |k: &str| self.given_keys.iter().any(|g| g == k);
        let fixed = |k: &str| !self.auto_keys.iter().any(|a| a == k);
        let l = &self.layout;
        let refuse = |msg: String| {
            Err(ConfigError::Field {
                file: "--layout".into(),
                field: self.text.clone(),
                msg,
            })
        };
        if given("sp") && l.sequence_parallel && l.tp == 1 && fixed("tp") {
            return refuse("sp=true with tp=1 splits nothing (sequence parallelism splits the norms' and dropouts' activations over the tp group): drop sp, or give tp ≥ 2".into());
        }
        if given("ep") && l.ep > 1 && fixed("ep") && fixed("dp") && fixed("cp") {
            let replicas = l.dp * l.cp;
            if !replicas.is_multiple_of(l.ep) {
                return refuse(format!("ep={} carves the expert-parallel group from the dp·cp = {replicas} replicas, and {} does not divide {replicas}: give a dp that ep divides", l.ep, l.ep));
            }
        }
        if let Some(etp) = l.etp.filter(|_| fixed("etp") && fixed("tp")) {
            if etp != 1 && etp != l.tp {
                return refuse(format!("etp={etp}: the experts are split over all of the tp={} devices (the default, etp={}) or over none of them (etp=1, each expert whole on one device, the tp group dividing the experts)", l.tp, l.tp));
            }
            if etp == 1 && l.tp == 1 {
                return refuse("etp=1 with tp=1 changes nothing (the experts are whole without tensor parallelism): drop etp, or give tp ≥ 2".into());
            }
        }
        if given("zero") && l.zero > 0 && l.dp * l.cp == 1 && fixed("dp") && fixed("cp") {
            return refuse(format!("zero={} with one replica (dp×cp = 1) has nothing to shard over: drop zero, or give dp ≥ 2", l.zero));
        }
        let pipelined = matches!(
            l.schedule,
            Schedule::Zbh1 | Schedule::Interleaved | Schedule::PipeDream | Schedule::TwoBw
        );
        if given("schedule") && pipelined && l.pp == 1 && fixed("pp") {
            return refuse(format!("schedule={} needs a pipeline, and pp=1 has none{}: drop the schedule, or give pp ≥ 2", l.schedule.name(), if l.schedule.is_async() { " (it would train on delayed weights for nothing)" } else { "" }));
        }
        if given("schedule") && l.schedule == Schedule::Interleaved && l.vpp == 1 && fixed("vpp") {
            return refuse("schedule=interleaved with vpp=1 is 1f1b: give vpp ≥ 2 (virtual stages per device), or schedule=1f1b".into());
        }
        Ok(())
    }
}

impl Layout {
    /// The layout's ranks on nodes of `devices_per_node` devices (see [`crate::rank`]).
    pub fn rank_grid(&self, devices_per_node: usize) -> crate::rank::RankGrid {
        crate::rank::RankGrid {
            tp: self.tp.max(1),
            cp: self.cp.max(1),
            dp: self.dp.max(1),
            pp: self.pp.max(1),
            devices_per_node: devices_per_node.max(1),
        }
    }

    /// Devices the layout needs (saturating: four keys of up to 2²⁰ each can exceed a `usize`,
    /// and such a layout is refused as needing more devices than any cluster has).
    pub fn world_size(&self) -> usize {
        self.dp
            .saturating_mul(self.tp)
            .saturating_mul(self.pp)
            .saturating_mul(self.cp.max(1))
    }

    /// The replicas of each model shard: dp × cp devices hold the same parameters and see different
    /// tokens; their gradients sum and ZeRO shards over them.
    pub fn replicas(&self) -> usize {
        self.dp.max(1).saturating_mul(self.cp.max(1))
    }
    /// How many blocks the tensor-parallel group divides every layer's routed experts into: tp
    /// under `etp=1` (device t of the group holds the t-th block, each expert whole, and its
    /// expert-parallel group divides that block), 1 otherwise (every device some columns of each).
    pub fn expert_blocks(&self) -> usize {
        match self.etp {
            Some(1) => self.tp.max(1),
            _ => 1,
        }
    }

    /// Whether `cfg` (with or without experts) runs on this layout's split of the experts, or the
    /// key at fault and why: [`ModelConfig::experts_split`] at this layout's ep, replicas and
    /// expert blocks. The one statement of the rule: the planner and the engine both ask it.
    pub fn experts_fit(
        &self,
        cfg: &ModelConfig,
    ) -> std::result::Result<(), (&'static str, String)> {
        cfg.experts_split(self.ep.max(1), self.replicas(), self.expert_blocks())
    }

    /// True when the layout runs on one device, unsplit.
    pub fn is_single_device(&self) -> bool {
        self.world_size() == 1 && self.vpp == 1
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp={},tp={},pp={},vpp={},zero={},mbs={},schedule={},sp={},recompute={}",
            self.dp,
            self.tp,
            self.pp,
            self.vpp,
            self.zero,
            self.micro_batch_size,
            self.schedule.name(),
            self.sequence_parallel,
            self.recompute.name()
        )?;
        if self.cp > 1 {
            write!(f, ",cp={},cp_comm={}", self.cp, self.cp_comm.name())?;
        }
        if self.ep > 1 {
            write!(f, ",ep={}", self.ep)?;
        }
        if let Some(etp) = self.etp {
            write!(f, ",etp={etp}")?;
        }
        match &self.stages {
            Some(st) => write!(f, ",stages={st}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_defaults_and_round_trips() {
        let s = LayoutSpec::parse("dp=2,tp=2,pp=2,zero=1,schedule=interleaved,vpp=2").unwrap();
        assert_eq!(s.layout.world_size(), 8);
        assert_eq!(s.layout.schedule, Schedule::Interleaved);
        let again = LayoutSpec::parse(&s.layout.to_string()).unwrap();
        assert_eq!(again.layout, s.layout);
        assert_eq!(LayoutSpec::parse("").unwrap().layout, Layout::default());
        assert_eq!(
            LayoutSpec::parse("auto").unwrap().auto_keys.len(),
            LAYOUT_KEYS.len() - 1
        );
    }

    #[test]
    fn expert_parallel_key_parses_prints_and_takes_no_devices_of_its_own() {
        let s = LayoutSpec::parse("dp=4,ep=2,zero=3").unwrap();
        assert_eq!((s.layout.ep, s.layout.world_size()), (2, 4));
        assert!(s.layout.to_string().ends_with(",ep=2"));
        assert_eq!(
            LayoutSpec::parse(&s.layout.to_string()).unwrap().layout,
            s.layout
        );
        assert!(!Layout::default().to_string().contains("ep="));
        let mut old = serde_json::to_value(Layout::default()).unwrap();
        old.as_object_mut().unwrap().remove("ep");
        assert_eq!(serde_json::from_value::<Layout>(old).unwrap().ep, 1);
        let e = LayoutSpec::parse("dp=3,ep=2").unwrap_err().to_string();
        assert!(e.contains("ep=2") && e.contains("does not divide 3"), "{e}");
        // A candidate keeps the keys given beside `auto`, etp among them.
        let partial = LayoutSpec::parse("dp=auto,tp=2,ep=2,etp=1").unwrap();
        let candidate = |spec: &str| LayoutSpec::parse(spec).unwrap().layout;
        assert!(partial.admits(&candidate("dp=4,tp=2,ep=2,etp=1")));
        assert!(!partial.admits(&candidate("dp=4,tp=2,ep=2")));
        assert!(!partial.admits(&candidate("dp=4,tp=2,ep=4,etp=1")));
        // etp=1: each expert whole, the tp group dividing the experts; etp=tp is the default.
        let s = LayoutSpec::parse("dp=2,tp=2,ep=2,etp=1").unwrap();
        assert_eq!((s.layout.expert_blocks(), s.layout.world_size()), (2, 4));
        assert!(s.layout.to_string().ends_with(",ep=2,etp=1"));
        assert_eq!(
            LayoutSpec::parse(&s.layout.to_string()).unwrap().layout,
            s.layout
        );
        assert_eq!(
            LayoutSpec::parse("tp=2,etp=2")
                .unwrap()
                .layout
                .expert_blocks(),
            1
        );
        for (spec, want) in [
            (
                "tp=4,etp=2",
                "etp=2: the experts are split over all of the tp=4",
            ),
            ("etp=1", "etp=1 with tp=1 changes nothing"),
        ] {
            let e = LayoutSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn context_parallel_keys_parse_print_and_count_devices() {
        let s = LayoutSpec::parse("dp=2,cp=4,cp_comm=a2a").unwrap();
        assert_eq!((s.layout.cp, s.layout.cp_comm), (4, CpComm::A2a));
        assert_eq!((s.layout.world_size(), s.layout.replicas()), (8, 8));
        assert!(s.layout.to_string().ends_with(",cp=4,cp_comm=a2a"));
        assert_eq!(
            LayoutSpec::parse(&s.layout.to_string()).unwrap().layout,
            s.layout
        );
        // cp=1 prints as before, and a layout from before cp existed still reads.
        assert!(!Layout::default().to_string().contains("cp"));
        let mut old = serde_json::to_value(Layout::default()).unwrap();
        let fields = old.as_object_mut().unwrap();
        fields.remove("cp");
        fields.remove("cp_comm");
        assert_eq!(
            serde_json::from_value::<Layout>(old).unwrap(),
            Layout::default()
        );
        let e = LayoutSpec::parse("cp=2,cp_comm=tree")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cp_comm") && e.contains("ring or a2a"), "{e}");
    }

    #[test]
    fn named_stages_round_trip_as_text_and_json() {
        let s = LayoutSpec::parse("pp=3,stages=5+6+5").unwrap();
        assert_eq!(s.layout.stages.unwrap().counts(), vec![5, 6, 5]);
        assert!(s.layout.to_string().ends_with(",stages=5+6+5"));
        assert_eq!(
            LayoutSpec::parse(&s.layout.to_string()).unwrap().layout,
            s.layout
        );
        let json = serde_json::to_string(&s.layout).unwrap();
        assert!(json.contains("\"stages\":[5,6,5]"), "{json}");
        assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), s.layout);
        let plain = serde_json::to_string(&Layout::default()).unwrap();
        assert!(!plain.contains("stages"), "{plain}");
    }

    #[test]
    fn bad_specs_name_the_key() {
        for (spec, key) in [
            ("tp=0", "tp"),
            ("zero=4", "zero"),
            ("foo=1", "foo"),
            ("schedule=x", "schedule"),
            ("dp=1,dp=2", "dp"),
            ("pp=2,stages=3+x", "stages"),
            ("pp=2,stages=3+0", "stages"),
        ] {
            let e = LayoutSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(key), "{spec}: {e}");
        }
    }
}

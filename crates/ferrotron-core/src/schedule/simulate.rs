use super::{Action, PipelineSchedule};
use crate::error::{ConfigError, Result};

/// Cost of each action kind for one micro-batch on one chunk, and the stage-to-stage transfer time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActionCosts {
    pub forward: f64,
    /// A full backward; a split one costs `backward_input + backward_weight`.
    pub backward_input: f64,
    pub backward_weight: f64,
    /// Time for a boundary activation (or its gradient) to reach the neighbouring stage.
    pub p2p: f64,
    /// An asynchronous schedule's update (the optimizer step of the stage's shard).
    pub update: f64,
}

impl ActionCosts {
    pub fn uniform(forward: f64, backward: f64) -> Self {
        Self {
            forward,
            backward_input: backward / 2.0,
            backward_weight: backward / 2.0,
            p2p: 0.0,
            update: 0.0,
        }
    }
    fn of(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward_input + self.backward_weight,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
            Action::Update { .. } => self.update,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub stage: usize,
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

/// What the schedule does in time: every action's interval, per-stage busy and idle time, and how many
/// micro-batch activations each stage holds at its peak.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub events: Vec<Event>,
    pub makespan: f64,
    pub busy: Vec<f64>,
    /// Peak number of (micro-batch, chunk) activation stashes held at once, per stage (under a
    /// split backward, counting the deferred weight-gradient jobs that stand in for a stash between
    /// its input gradient and its weight gradient).
    pub peak_in_flight: Vec<usize>,
    /// Under a split backward, per stage, the states a peak can fall in: after each forward, and as
    /// each input gradient starts (it turns a stash into deferred weight-gradient jobs, holding both
    /// while it runs). Empty for a joint backward.
    pub held: Vec<Vec<Held>>,
}

/// What a stage holds: `stashes` forward stashes and `weight_jobs` chunks' deferred weight-gradient
/// jobs; `converting` while an input gradient turns one more stash into jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub stashes: usize,
    pub weight_jobs: usize,
    pub converting: bool,
}

impl Timeline {
    /// A chart of stages × time slots of width `slot`: each action fills the slots it occupies with
    /// its label (`F3`, `B3`, `I3`, `W3`, `.c` for a chunk), idle slots show `.`.
    pub fn slot_chart(&self, stages: usize, slot: f64) -> String {
        let slots = (self.makespan / slot).round() as usize;
        let mut cells = vec![vec![String::from("."); slots]; stages];
        for e in &self.events {
            let (a, b) = (
                (e.start / slot).round() as usize,
                (e.end / slot).round() as usize,
            );
            for cell in cells[e.stage].iter_mut().take(b.min(slots)).skip(a) {
                *cell = e.action.to_string();
            }
        }
        let width = cells.iter().flatten().map(String::len).max().unwrap_or(1);
        let mut out = String::new();
        for (s, row) in cells.iter().enumerate() {
            out.push_str(&format!("stage {s:>2} |"));
            for c in row {
                out.push_str(&format!("{c:>width$}|"));
            }
            out.push('\n');
        }
        out
    }

    /// Idle time / step time of stage `s`.
    pub fn idle_fraction(&self, s: usize) -> f64 {
        if self.makespan == 0.0 {
            0.0
        } else {
            1.0 - self.busy[s] / self.makespan
        }
    }
    /// The worst stage's idle fraction: the pipeline bubble.
    pub fn bubble_fraction(&self) -> f64 {
        (0..self.busy.len())
            .map(|s| self.idle_fraction(s))
            .fold(0.0, f64::max)
    }
}

/// Runs the action lists in order on every stage, each action starting when its stage is free and
/// its inputs have arrived. `costs` holds one entry for every virtual stage (chunk c of stage s is
/// c·p + s), or a single entry for all. Validates as it goes: a list that names an action twice or out
/// of range, misses one, or waits on something that never happens is an error naming stage and action.
pub fn simulate(s: &PipelineSchedule, costs: &[ActionCosts]) -> Result<Timeline> {
    let nv = s.stages * s.chunks;
    if costs.len() != 1 && costs.len() != nv {
        return Err(ConfigError::Invalid(format!(
            "schedule: {} cost entries for {nv} virtual stages",
            costs.len()
        )));
    }
    let cost = |vs: usize| &costs[if costs.len() == 1 { 0 } else { vs }];
    run(s, &|vs, a| cost(vs).of(a), &|vs| cost(vs).p2p)
}

/// Replays the action lists with each action taking `duration(stage, action)` and transfers
/// taking no time: what the schedule gives for the durations a run measured (tests compare a
/// runtime's measured timeline with it).
pub fn replay(s: &PipelineSchedule, duration: &dyn Fn(usize, &Action) -> f64) -> Result<Timeline> {
    let p = s.stages;
    run(s, &|vs, a| duration(vs % p, a), &|_| 0.0)
}

/// The simulation: `duration(virtual stage, action)`, `p2p(virtual stage)` for its outputs.
fn run(
    s: &PipelineSchedule,
    duration: &dyn Fn(usize, &Action) -> f64,
    p2p: &dyn Fn(usize) -> f64,
) -> Result<Timeline> {
    let (p, m, v) = (s.stages, s.micro_batches, s.chunks);
    let nv = p * v;
    if s.actions.len() != p {
        return Err(ConfigError::Invalid(format!(
            "schedule: {} action lists for {p} stages",
            s.actions.len()
        )));
    }
    let updates = if s.is_async() {
        m.div_ceil(s.micro_batches_per_update.max(1))
    } else {
        0
    };
    if s.is_async() {
        check_versions(s, updates)?;
    }
    check_complete(s, updates)?;

    const NOT_YET: f64 = f64::INFINITY;
    // Completion times by (micro-batch, virtual stage): forward done, input gradient available.
    let mut f_done = vec![NOT_YET; m * nv];
    let mut g_done = vec![NOT_YET; m * nv];
    let mut next = vec![0usize; p];
    let mut free_at = vec![0f64; p];
    let mut busy = vec![0f64; p];
    let mut stash = vec![0usize; p];
    let mut jobs = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let mut held: Vec<Vec<Held>> = vec![Vec::new(); p];
    let split = s
        .actions
        .iter()
        .flatten()
        .any(|a| matches!(a, Action::BackwardInput { .. }));
    let note = |held: &mut Vec<Held>, h: Held| {
        if split && !held.contains(&h) {
            held.push(h);
        }
    };
    let total: usize = s.actions.iter().map(Vec::len).sum();
    let mut events = Vec::with_capacity(total);
    while events.len() < total {
        let mut progressed = false;
        for stage in 0..p {
            while let Some(a) = s.actions[stage].get(next[stage]) {
                let vs = a.chunk() * p + stage;
                let at = |t: &Vec<f64>, vs: usize| t[a.mb() * nv + vs];
                // When the inputs of `a` are on this stage (infinite if not produced yet).
                let ready = match a {
                    Action::Forward { .. } if vs == 0 => 0.0,
                    Action::Forward { .. } => at(&f_done, vs - 1) + p2p(vs - 1),
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        let own = at(&f_done, vs);
                        if vs == nv - 1 {
                            own
                        } else {
                            own.max(at(&g_done, vs + 1) + p2p(vs + 1))
                        }
                    }
                    Action::BackwardWeight { .. } => at(&g_done, vs),
                    // An update needs its micro-batches' gradients: this stage's, or (a global
                    // norm, a tied embedding) every stage's.
                    Action::Update { step } => {
                        let n = s.micro_batches_per_update.max(1);
                        let stages: Vec<usize> = if s.sync_updates {
                            (0..nv).collect()
                        } else {
                            vec![vs]
                        };
                        let g = &g_done;
                        (step * n..((step + 1) * n).min(m))
                            .flat_map(|mb| stages.iter().map(move |&w| g[mb * nv + w]))
                            .fold(0.0, f64::max)
                    }
                };
                if ready == NOT_YET {
                    break;
                }
                let start = ready.max(free_at[stage]);
                let end = start + duration(vs, a);
                free_at[stage] = end;
                busy[stage] += end - start;
                let idx = match a {
                    Action::Update { .. } => 0,
                    _ => a.mb() * nv + vs,
                };
                match a {
                    Action::Forward { .. } => {
                        f_done[idx] = end;
                        stash[stage] += 1;
                        peak[stage] = peak[stage].max(stash[stage] + jobs[stage]);
                        let h = Held {
                            stashes: stash[stage],
                            weight_jobs: jobs[stage],
                            converting: false,
                        };
                        note(&mut held[stage], h);
                    }
                    Action::Backward { .. } => {
                        g_done[idx] = end;
                        stash[stage] -= 1;
                    }
                    // The input gradient frees the stash and leaves the weight gradient's inputs,
                    // which the weight gradient frees.
                    Action::BackwardInput { .. } => {
                        g_done[idx] = end;
                        let h = Held {
                            stashes: stash[stage],
                            weight_jobs: jobs[stage],
                            converting: true,
                        };
                        note(&mut held[stage], h);
                        stash[stage] -= 1;
                        jobs[stage] += 1;
                    }
                    Action::BackwardWeight { .. } => jobs[stage] -= 1,
                    Action::Update { .. } => {}
                }
                events.push(Event {
                    stage,
                    action: *a,
                    start,
                    end,
                });
                next[stage] += 1;
                progressed = true;
            }
        }
        if !progressed {
            let blocked: Vec<String> = (0..p)
                .filter(|&st| next[st] < s.actions[st].len())
                .map(|st| format!("stage {st} waits at {}", s.actions[st][next[st]]))
                .collect();
            return Err(ConfigError::Invalid(format!(
                "schedule: deadlock: {} (each waits for an input that no stage can produce next)",
                blocked.join(", ")
            )));
        }
    }
    let makespan = free_at.iter().copied().fold(0.0, f64::max);
    Ok(Timeline {
        events,
        makespan,
        busy,
        peak_in_flight: peak,
        held,
    })
}

/// Completeness: each stage runs every (micro-batch, chunk) forward once and its backward once
/// (and, asynchronous, every update once).
fn check_complete(s: &PipelineSchedule, updates: usize) -> Result<()> {
    let (m, v) = (s.micro_batches, s.chunks);
    let bad = |stage: usize, a: &Action, why: &str| {
        ConfigError::Invalid(format!("schedule: stage {stage}, action {a}: {why}"))
    };
    for (stage, list) in s.actions.iter().enumerate() {
        let mut seen = vec![[false; 4]; m * v];
        let mut updated = vec![false; updates];
        for a in list {
            if let Action::Update { step } = *a {
                if step >= updates {
                    return Err(bad(stage, a, "an update this schedule does not have"));
                }
                if std::mem::replace(&mut updated[step], true) {
                    return Err(bad(stage, a, "appears twice"));
                }
                continue;
            }
            if a.mb() >= m || a.chunk() >= v {
                return Err(bad(stage, a, "micro-batch or chunk out of range"));
            }
            let slot = &mut seen[a.mb() * v + a.chunk()][kind_index(a)];
            if *slot {
                return Err(bad(stage, a, "appears twice"));
            }
            *slot = true;
        }
        if let Some(u) = updated.iter().position(|&d| !d) {
            return Err(bad(stage, &Action::Update { step: u }, "missing"));
        }
        for (i, k) in seen.iter().enumerate() {
            let full = k[1];
            let split = k[2] && k[3];
            if !k[0] || full == split || (full && (k[2] || k[3])) {
                let f = Action::Forward {
                    mb: i / v,
                    chunk: i % v,
                };
                return Err(bad(
                    stage,
                    &f,
                    "missing its forward or its (single) backward",
                ));
            }
        }
    }
    Ok(())
}

fn kind_index(a: &Action) -> usize {
    match a {
        Action::Forward { .. } => 0,
        Action::Backward { .. } | Action::Update { .. } => 1,
        Action::BackwardInput { .. } => 2,
        Action::BackwardWeight { .. } => 3,
    }
}

/// An asynchronous schedule's versions are what its lists imply: one per action; a forward reads
/// the latest weights (the updates before it), its backward the same version, an update makes the
/// next; every update comes after the stage's backwards of its micro-batches; a synchronous list
/// holds no update.
fn check_versions(s: &PipelineSchedule, updates: usize) -> Result<()> {
    let n = s.micro_batches_per_update.max(1);
    for (stage, (list, versions)) in s.actions.iter().zip(&s.versions).enumerate() {
        let bad = |a: &Action, why: String| {
            ConfigError::Invalid(format!("schedule: stage {stage}, action {a}: {why}"))
        };
        if versions.len() != list.len() {
            return Err(ConfigError::Invalid(format!(
                "schedule: stage {stage} has {} actions and {} versions",
                list.len(),
                versions.len()
            )));
        }
        let (mut done, mut forward) = (0usize, std::collections::HashMap::new());
        let mut backwards_done = vec![0usize; updates];
        for (a, &v) in list.iter().zip(versions) {
            match *a {
                Action::Forward { mb, .. } => {
                    if v != done {
                        return Err(bad(a, format!("reads version {v}, the latest is {done}")));
                    }
                    forward.insert(mb, v);
                }
                Action::Backward { mb, .. } => {
                    if forward.get(&mb) != Some(&v) {
                        return Err(bad(a, format!("reads version {v}, not its forward's")));
                    }
                    if let Some(b) = backwards_done.get_mut(mb / n) {
                        *b += 1;
                    }
                }
                Action::Update { step } => {
                    let owed = (n * (step + 1)).min(s.micro_batches) - n * step;
                    if backwards_done.get(step) != Some(&owed) {
                        return Err(bad(a, "before the backwards of its micro-batches".into()));
                    }
                    done += 1;
                    if v != done {
                        return Err(bad(a, format!("makes version {v}, the next is {done}")));
                    }
                }
                _ => return Err(bad(a, "an asynchronous list holds F, B and U only".into())),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::*;
    use crate::layout::Schedule;

    /// A split backward's states: on ZB-H1's last stage of two, each micro-batch is a stash after
    /// its forward and jobs after its input gradient, never both; the first stage holds up to two
    /// stashes beside a chunk's jobs. A joint backward records none.
    #[test]
    fn a_split_backward_holds_stashes_then_weight_jobs() {
        let costs = [ActionCosts::uniform(1.0, 2.0)];
        let zb = simulate(&build(Schedule::Zbh1, 2, 8, 1).unwrap(), &costs).unwrap();
        let held = |stashes, weight_jobs, converting| Held {
            stashes,
            weight_jobs,
            converting,
        };
        assert!(zb.held[1].contains(&held(1, 0, true)));
        assert!(
            zb.held[1].iter().all(|h| h.stashes + h.weight_jobs <= 1),
            "{:?}",
            zb.held[1]
        );
        assert!(zb.held[0].contains(&held(2, 1, false)), "{:?}", zb.held[0]);
        assert_eq!(zb.peak_in_flight, vec![3, 1]);
        let joint = simulate(&build(Schedule::OneFOneB, 2, 8, 1).unwrap(), &costs).unwrap();
        assert!(joint.held.iter().all(Vec::is_empty));
    }

    fn bubble(kind: Schedule, p: usize, m: usize, v: usize, costs: ActionCosts) -> Timeline {
        simulate(&build(kind, p, m, v).unwrap(), &[costs]).unwrap()
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_exactly_textbook() {
        for (p, m) in [(2, 1), (2, 4), (4, 8), (8, 8), (8, 64), (3, 5)] {
            let want = (p - 1) as f64 / (m + p - 1) as f64;
            for kind in [Schedule::Gpipe, Schedule::OneFOneB] {
                let t = bubble(kind, p, m, 1, ActionCosts::uniform(1.0, 2.0));
                for s in 0..p {
                    assert!(
                        (t.idle_fraction(s) - want).abs() < 1e-12,
                        "{kind:?} p{p} m{m} stage {s}: {} vs {want}",
                        t.idle_fraction(s)
                    );
                }
            }
        }
    }

    #[test]
    fn interleaved_bubble_shrinks_by_v() {
        for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)] {
            let want = (p - 1) as f64 / (v * m + p - 1) as f64;
            // Each chunk holds 1/v of the stage's layers, so it costs 1/v of the time.
            let t = bubble(
                Schedule::Interleaved,
                p,
                m,
                v,
                ActionCosts::uniform(1.0 / v as f64, 2.0 / v as f64),
            );
            assert!(
                (t.bubble_fraction() - want).abs() < 1e-9,
                "p{p} m{m} v{v}: {} vs {want}",
                t.bubble_fraction()
            );
        }
    }

    #[test]
    fn zero_bubble_beats_1f1b_when_weight_gradients_cost_time() {
        for (p, m) in [(2, 4), (4, 8), (8, 16)] {
            let costs = ActionCosts {
                forward: 1.0,
                backward_input: 1.0,
                backward_weight: 1.0,
                p2p: 0.0,
                update: 0.0,
            };
            let zb = bubble(Schedule::Zbh1, p, m, 1, costs).bubble_fraction();
            let ofob = bubble(Schedule::OneFOneB, p, m, 1, costs).bubble_fraction();
            assert!(zb < ofob, "p{p} m{m}: zbh1 {zb} vs 1f1b {ofob}");
        }
    }

    #[test]
    fn peak_stash_is_m_for_gpipe_and_min_m_p_for_1f1b() {
        for (p, m) in [(4, 8), (4, 2), (2, 6)] {
            let g = bubble(Schedule::Gpipe, p, m, 1, ActionCosts::uniform(1.0, 2.0));
            let f = bubble(Schedule::OneFOneB, p, m, 1, ActionCosts::uniform(1.0, 2.0));
            let z = bubble(Schedule::Zbh1, p, m, 1, ActionCosts::uniform(1.0, 2.0));
            for s in 0..p {
                assert_eq!(g.peak_in_flight[s], m);
                assert_eq!(f.peak_in_flight[s], m.min(p - s));
                assert!(z.peak_in_flight[s] <= m.min(p - s) + (p - s - 1).min(m));
            }
        }
    }

    #[test]
    fn deadlocks_and_incomplete_lists_name_stage_and_action() {
        // Stage 1 runs its backward of micro-batch 0 before the forward that produces it.
        let mut s = build(Schedule::OneFOneB, 2, 2, 1).unwrap();
        s.actions[1] = vec![
            Action::Backward { mb: 0, chunk: 0 },
            Action::Forward { mb: 0, chunk: 0 },
            Action::Forward { mb: 1, chunk: 0 },
            Action::Backward { mb: 1, chunk: 0 },
        ];
        let e = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("stage 1 waits at B0") && e.contains("deadlock"),
            "{e}"
        );
        let mut s = build(Schedule::Gpipe, 2, 2, 1).unwrap();
        s.actions[0].pop();
        let e = simulate(&s, &[ActionCosts::uniform(1.0, 2.0)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 0") && e.contains("F1"), "{e}");
    }
}

//! What a profiled step's time is made of, measured beside predicted, and the verdicts on it.

use super::Measured;
use crate::report::Table;
use ferrotron_engine::parallel::StepReport;

/// A figure measured in the profiled step (device time) and the planner's prediction of it.
#[derive(Clone, Copy)]
pub(crate) struct Pair {
    pub measured: f64,
    pub predicted: f64,
}

impl Pair {
    pub(crate) fn json(self) -> serde_json::Value {
        serde_json::json!({"measured": self.measured, "predicted": self.predicted})
    }
    pub(crate) fn ratio(self) -> f64 {
        self.measured / self.predicted.max(1e-12)
    }
    /// The ratio for a table: none where nothing was predicted.
    pub(crate) fn ratio_text(self) -> String {
        if self.predicted > 0.0 {
            format!("{:.2}", self.ratio())
        } else {
            "—".into()
        }
    }
}

/// What the step's time is made of, measured and predicted: the step, the forward and backward
/// actions (per device, summed over the step), the gradient reduction after them, the optimizer step.
pub(crate) struct StepTimes {
    pub step: Pair,
    pub forward: Pair,
    pub backward: Pair,
    /// The communication inside the forward and backward actions (tensor-parallel collectives,
    /// ZeRO-3 gathers): the actions' spans less their compute.
    pub forward_comm: Pair,
    pub backward_comm: Pair,
    pub reduce: Pair,
    pub optimizer: Pair,
}

impl StepTimes {
    pub(crate) fn of(
        devices: &[Measured],
        plan: &ferrotron_core::plan::Plan,
        predicted: Option<&ferrotron_core::schedule::Timeline>,
        stages: usize,
    ) -> StepTimes {
        use ferrotron_core::schedule::Action;
        let is_forward = |a: &Action| matches!(a, Action::Forward { .. });
        let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let mean_over_devices = |forward: bool, waiting: bool| {
            mean(
                devices
                    .iter()
                    .map(|m| action_seconds(&m.report, forward, waiting))
                    .collect(),
            )
        };
        let measured_kind = |forward: bool| mean_over_devices(forward, false);
        let measured_comm = |forward: bool| mean_over_devices(forward, true);
        let predicted_kind = |forward: bool| {
            predicted.map_or(0.0, |tl| {
                tl.events
                    .iter()
                    .filter(|e| is_forward(&e.action) == forward)
                    .map(|e| e.end - e.start)
                    .sum::<f64>()
                    / stages.max(1) as f64
            })
        };
        let longest = |f: &dyn Fn(&StepReport) -> f64| {
            devices.iter().map(|m| f(&m.report)).fold(0.0, f64::max)
        };
        StepTimes {
            step: Pair {
                measured: longest(&|r| r.span_s),
                predicted: plan.step_time_s,
            },
            forward: Pair {
                measured: measured_kind(true),
                predicted: predicted_kind(true),
            },
            backward: Pair {
                measured: measured_kind(false),
                predicted: predicted_kind(false),
            },
            forward_comm: Pair {
                measured: measured_comm(true),
                predicted: plan.action_comm_time_s.0,
            },
            backward_comm: Pair {
                measured: measured_comm(false),
                predicted: plan.action_comm_time_s.1,
            },
            // The device whose actions end last is on the critical path: the others' reduction
            // intervals also hold their wait for it (which the prediction counts as bubble).
            reduce: Pair {
                measured: devices
                    .iter()
                    .map(|m| &m.report)
                    .max_by(|a, b| a.reduce_s.0.total_cmp(&b.reduce_s.0))
                    .map_or(0.0, |r| r.reduce_s.1 - r.reduce_s.0),
                // The interval holds the global norm too.
                predicted: plan.dp_comm_time_s + plan.grad_norm_time_s,
            },
            optimizer: Pair {
                measured: longest(&|r| r.update_s.1 - r.update_s.0),
                predicted: plan.optimizer_time_s,
            },
        }
    }

    pub(crate) fn parts(&self) -> [(&'static str, Pair); 7] {
        [
            ("step", self.step),
            ("forward actions per device", self.forward),
            ("communication inside forward actions", self.forward_comm),
            ("backward actions per device", self.backward),
            ("communication inside backward actions", self.backward_comm),
            ("gradient reduction", self.reduce),
            ("optimizer step", self.optimizer),
        ]
    }

    /// The parts measured beside predicted, each with its verdict against `threshold` (relative).
    pub(crate) fn table(&self, threshold: f64) -> Table {
        let mut t = Table::new(
            "step time, measured (device time) and predicted",
            &[
                "part",
                "measured (ms)",
                "predicted (ms)",
                "measured / predicted",
                "verdict",
            ],
        );
        for (name, p) in self.parts() {
            let verdict = if p.predicted <= 0.0 {
                if p.measured > 0.0 {
                    "not predicted".to_string()
                } else {
                    "none, as predicted".to_string()
                }
            } else if (p.ratio() - 1.0).abs() <= threshold {
                format!("within {:.0}%", 100.0 * threshold)
            } else if p.ratio() > 1.0 {
                format!("slower than predicted ({}×)", p.ratio_text())
            } else {
                format!("faster than predicted ({}×)", p.ratio_text())
            };
            t.row(vec![
                name.to_string(),
                format!("{:.2}", p.measured * 1e3),
                format!("{:.2}", p.predicted * 1e3),
                p.ratio_text(),
                verdict,
            ]);
        }
        t
    }

    /// The step time's verdict, and one for each part off by more than `threshold` (relative).
    pub(crate) fn verdicts(&self, threshold: f64) -> Vec<String> {
        let off = |p: Pair| (p.ratio() - 1.0).abs() > threshold;
        let ms = |s: f64| format!("{:.1} ms", s * 1e3);
        let mut out = Vec::new();
        if off(self.step) {
            out.push(format!(
                "step time {} measured vs {} predicted ({:.2}×): the cluster's time constants do not \
                 describe these devices — `ferrotron calibrate --this-machine` measures this machine, \
                 `ferrotron calibrate --profile DIR…` fits them to profiles like this one",
                ms(self.step.measured),
                ms(self.step.predicted),
                self.step.ratio()
            ));
        } else {
            out.push(format!(
                "step time {} measured vs {} predicted: within {:.0}%",
                ms(self.step.measured),
                ms(self.step.predicted),
                100.0 * threshold
            ));
        }
        // Parts off by more than the threshold, also when the step agrees (errors can cancel);
        // parts under 5% of the step are left out.
        for (name, p) in self.parts().into_iter().skip(1) {
            if off(p) && p.measured.max(p.predicted) > 0.05 * self.step.measured {
                out.push(format!(
                    "{name}: {} measured vs {} predicted ({}×)",
                    ms(p.measured),
                    ms(p.predicted),
                    p.ratio_text()
                ));
            }
        }
        out
    }
}

/// Seconds a device spent in its forward actions (`forward`) or the others: whole actions, or
/// (`waiting`) only what each action did not compute — its communication.
fn action_seconds(r: &StepReport, forward: bool, waiting: bool) -> f64 {
    use ferrotron_core::schedule::Action;
    r.timeline
        .iter()
        .enumerate()
        .filter(|(_, (a, _, _))| matches!(a, Action::Forward { .. }) == forward)
        .filter_map(|(i, (_, t0, t1))| match waiting {
            false => Some(t1 - t0),
            true => r
                .action_compute_s
                .get(i)
                .map(|compute| (t1 - t0 - compute).max(0.0)),
        })
        .sum()
}

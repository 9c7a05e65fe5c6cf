//! What a page says first: the model, the cluster, the layout, batch × sequence, the precision,
//! the step shown and the date, each in words a reader can check against their command.

use super::svg::escape;
use ferrotron_core::plan::PlanModel;
use ferrotron_core::topology::Cluster;
use std::fmt::Write;

/// What a page reports on, said before anything else: what was run, on what, and when.
#[derive(Debug, Clone, Default)]
pub struct RunFacts {
    /// The model's name and its parameters (`llama-small, 4.2 M parameters`).
    pub model: String,
    /// The cluster in words (`this-machine: 1 node × 8 devices, 2.15 GB each`).
    pub cluster: String,
    pub layout: String,
    /// Sequences per step × tokens per sequence.
    pub batch: String,
    pub precision: String,
    /// Which step the page shows (`step 3 of 5, the median by time`; `one predicted step`).
    pub step: String,
    /// When it was run (or planned), `YYYY-MM-DD`.
    pub date: String,
}

impl RunFacts {
    pub fn html(&self) -> String {
        let mut s = String::from("<dl class=\"facts\">\n");
        for (name, value) in [
            ("model", &self.model),
            ("cluster", &self.cluster),
            ("layout", &self.layout),
            ("batch × sequence", &self.batch),
            ("precision", &self.precision),
            ("step shown", &self.step),
            ("date", &self.date),
        ] {
            let _ = writeln!(
                s,
                "<div><dt>{}</dt><dd>{}</dd></div>",
                escape(name),
                escape(value)
            );
        }
        s.push_str("</dl>\n");
        s
    }
}

/// Today's date (UTC) as `YYYY-MM-DD`.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    date_of(secs)
}

/// The UTC date of a Unix time, `YYYY-MM-DD` (the proleptic Gregorian calendar, counted from the
/// days since 1970 in 400-year eras).
pub fn date_of(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// A model's name and its parameters: `llama2-7b, 6.74 B parameters`.
pub fn model(name: &str, m: &PlanModel) -> String {
    let n = match m {
        PlanModel::Shape(cfg) => cfg.num_params() as f64,
        PlanModel::ParamsOnly(n) => *n,
    };
    format!("{name}, {} parameters", count(n))
}

/// A count in thousands, millions or billions: `6.74 B`, `4.19 M`.
pub fn count(n: f64) -> String {
    [("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)]
        .into_iter()
        .find(|&(_, d)| n >= d)
        .map_or(format!("{n:.0}"), |(u, d)| format!("{:.2} {u}", n / d))
}

/// A cluster in words: `dgx-a100-80g: 8 nodes × 8 devices, 85.90 GB and 312 TFLOP/s each`.
pub fn cluster(c: &Cluster) -> String {
    let peak = match c.peak_flops {
        f if f >= 1e12 => format!("{:.0} TFLOP/s", f / 1e12),
        f => format!("{:.1} GFLOP/s", f / 1e9),
    };
    format!(
        "{}: {} node{} × {} device{}, {} and {peak} peak each",
        c.name,
        c.nodes,
        if c.nodes == 1 { "" } else { "s" },
        c.devices_per_node,
        if c.devices_per_node == 1 { "" } else { "s" },
        super::show_bytes(c.device_memory_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_the_utc_calendar_day() {
        assert_eq!(date_of(0), "1970-01-01");
        assert_eq!(date_of(951_782_400), "2000-02-29");
        assert_eq!(date_of(1_796_428_800), "2026-12-05");
    }

    #[test]
    fn counts_read_in_their_unit() {
        assert_eq!(count(6.738e9), "6.74 B");
        assert_eq!(count(4_194_304.0), "4.19 M");
        assert_eq!(count(12.0), "12");
    }
}

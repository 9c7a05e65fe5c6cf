//! What a launch says: its events appended to `events.jsonl` (and the terminal), the job's output
//! forwarded and kept, and the watch that records when a relaunched run has resumed.

use anyhow::{Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Appends events to `events.jsonl` and says them on the terminal.
pub(crate) struct Events {
    pub(crate) path: PathBuf,
}

impl Events {
    pub(crate) fn record(&self, event: &str, mut details: serde_json::Value) -> Result<()> {
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        details["time"] = time.into();
        details["event"] = event.into();
        let line = serde_json::to_string(&details)?;
        eprintln!("launch: {line}");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("{}: cannot write", self.path.display()))?;
        writeln!(f, "{line}").with_context(|| format!("{}: cannot write", self.path.display()))?;
        Ok(())
    }
}

/// A job's output, forwarded to ours as it comes and kept for reading its errors.
pub(crate) fn forward(
    stream: impl std::io::Read + Send + 'static,
    to_err: bool,
    kept: Arc<Mutex<String>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stream)
            .lines()
            .map_while(std::result::Result::ok)
        {
            if to_err {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
            let mut k = kept.lock().expect("no panics");
            k.push_str(&line);
            k.push('\n');
        }
    });
}

/// Watches `metrics.jsonl` until a step after `step` is recorded (the first one the relaunched run
/// completes), then records `resumed`. Only what the relaunched run appends counts (the failed run
/// may have recorded steps past its last checkpoint). It looks once more when told to stop.
pub(crate) struct ResumeWatch {
    stop: Arc<Mutex<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ResumeWatch {
    pub(crate) fn start(
        metrics: PathBuf,
        step: usize,
        failed_at: Instant,
        events: Arc<Events>,
    ) -> Self {
        let stop = Arc::new(Mutex::new(false));
        let flag = stop.clone();
        let skip = std::fs::metadata(&metrics).map_or(0, |m| m.len() as usize);
        let thread = std::thread::spawn(move || loop {
            let stopping = *flag.lock().expect("no panics");
            let first_new = std::fs::read(&metrics).ok().and_then(|bytes| {
                let text = String::from_utf8_lossy(bytes.get(skip..).unwrap_or_default());
                text.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .find(|v| v["step"].as_u64().is_some_and(|s| s as usize > step))
            });
            if let Some(v) = first_new {
                let _ = events.record(
                    "resumed",
                    serde_json::json!({
                        "step": v["step"],
                        "from_step": step,
                        "layout": v["layout"],
                        "seconds_since_job_ended": failed_at.elapsed().as_secs_f64(),
                    }),
                );
                return;
            }
            if stopping {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for ResumeWatch {
    fn drop(&mut self) {
        *self.stop.lock().expect("no panics") = true;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

//! Every report, rendered in a real browser (headless Chromium): its tables are HTML tables, no
//! element widens the page, each device's memory bar is at least 4 px tall at every scale tried,
//! no two labels overlap, a memory limit is drawn or stated, and nothing is fetched from a network.
//! Each page is also screenshot to a PNG beside it.
//!
//! Needs Chromium (`apt-get install chromium`; `.ci/run` installs it), or `FERROTRON_CHROMIUM`
//! naming a Chrome-compatible binary.

mod common;

use common::temp_dir;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Measures the page in the browser and writes the figures into it (see the script).
const GEOMETRY: &str = include_str!("browser/geometry.js");

/// The browser: `FERROTRON_CHROMIUM`, or the first of the usual names on the PATH.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("FERROTRON_CHROMIUM") {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&path) {
            if dir.join(name).is_file() {
                return dir.join(name);
            }
        }
    }
    panic!(
        "these tests render the reports in Chromium, which is not installed: \
         `apt-get install chromium` (.ci/run does), or set FERROTRON_CHROMIUM"
    );
}

/// Runs the browser headless on `page` with `args`, giving up after a minute; its standard output.
fn browse(page: &Path, args: &[String]) -> String {
    let profile = page.with_extension("chromium-profile");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the browser starts");
    let mut out = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).ok();
        s
    });
    let started = Instant::now();
    while child.try_wait().expect("waits").is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the browser did not finish {} in a minute", page.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = reader.join().expect("reads");
    let _ = std::fs::remove_dir_all(&profile);
    out
}

/// The page's figures as the browser laid it out, and a screenshot beside it.
fn render(report: &Path) -> Value {
    let html = std::fs::read_to_string(report).unwrap();
    let probe = report.with_file_name("probe.html");
    let script = format!("<script>{GEOMETRY}</script></body>");
    std::fs::write(&probe, html.replace("</body>", &script)).unwrap();
    let dom = browse(&probe, &["--dump-dom".to_string()]);
    let json = dom
        .rsplit("<pre id=\"geometry\">")
        .next()
        .and_then(|s| s.split("</pre>").next())
        .filter(|_| dom.contains("<pre id=\"geometry\">"))
        .unwrap_or_else(|| panic!("{}: the browser produced no figures", report.display()));
    let json = json
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&");
    let png = report.with_extension("png");
    browse(report, &[format!("--screenshot={}", png.display())]);
    let bytes = std::fs::read(&png).expect("a screenshot");
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{}: not a picture of a page",
        png.display()
    );
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{}: {e}", report.display()))
}

fn overlap(a: &Value, b: &Value) -> bool {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    // Half a pixel of slack: glyph boxes of neighbouring labels may touch.
    f(a, "x") + 0.5 < f(b, "x") + f(b, "w")
        && f(b, "x") + 0.5 < f(a, "x") + f(a, "w")
        && f(a, "y") + 0.5 < f(b, "y") + f(b, "h")
        && f(b, "y") + 0.5 < f(a, "y") + f(a, "h")
}

/// What every report must be, whatever made it; `tables` and `memory_charts` are how many of each
/// it must have at least.
fn check_page(report: &Path, tables: usize, memory_charts: usize) -> Value {
    let html = std::fs::read_to_string(report).unwrap();
    for remote in ["src=", "<link", "url(", "@import", "https:"] {
        assert!(
            !html.contains(remote),
            "{}: loads `{remote}`",
            report.display()
        );
    }
    assert_eq!(
        html.matches("http:").count(),
        html.matches("xmlns=\"http://www.w3.org/2000/svg\"").count(),
        "{}: the only address is the SVG namespace",
        report.display()
    );
    let g = render(report);
    let name = report.display();
    assert!(
        g["scroll_width"].as_f64() <= g["viewport"].as_f64(),
        "{name}: the page scrolls sideways: {} > {}",
        g["scroll_width"],
        g["viewport"]
    );
    assert_eq!(g["pre"], 0, "{name}: preformatted text instead of tables");
    let t = g["tables"].as_array().unwrap();
    assert!(t.len() >= tables, "{name}: {} tables", t.len());
    for table in t {
        assert!(table["rows"].as_u64() > Some(0), "{name}: an empty table");
        assert!(
            table["right"].as_f64() <= g["viewport"].as_f64(),
            "{name}: a table is wider than the page"
        );
    }
    let mut charts = 0;
    for svg in g["svgs"].as_array().unwrap() {
        let title = svg["title"].as_str().unwrap_or("");
        let texts = svg["texts"].as_array().unwrap();
        for (i, a) in texts.iter().enumerate() {
            for b in &texts[i + 1..] {
                assert!(
                    !overlap(a, b),
                    "{name}, chart `{title}`: `{}` overlaps `{}` ({a} {b})",
                    a["text"],
                    b["text"]
                );
            }
        }
        let bars = svg["bars"].as_array().unwrap();
        if bars.is_empty() {
            continue;
        }
        charts += 1;
        for bar in bars {
            assert!(
                bar["height"].as_f64() >= Some(4.0),
                "{name}, chart `{title}`: device {}'s bar is {} px tall",
                bar["device"],
                bar["height"]
            );
            assert_eq!(bar["terms"], 7, "{name}: a segment per term");
        }
        let drawn = svg["limits"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l == "capacity");
        let stated = texts
            .iter()
            .any(|t| t["text"].as_str().unwrap_or("").contains("capacity"));
        assert!(
            drawn || stated,
            "{name}, chart `{title}`: capacity neither drawn nor stated"
        );
    }
    assert!(charts >= memory_charts, "{name}: {charts} memory charts");
    g
}

fn ferrotron(args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "ferrotron {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// One profile at a time (several device threads each on two cores).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn profile_page(tag: &str, layout: &str, devices: usize) {
    let out = temp_dir(tag);
    {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        ferrotron(&[
            "profile",
            "--seq",
            "64",
            "--steps",
            "2",
            "--layout",
            layout,
            "--out",
            out.to_str().unwrap(),
        ]);
    }
    let g = check_page(&out.join("report.html"), 3, 2);
    let svgs = g["svgs"].as_array().unwrap();
    let timeline = &svgs[0];
    assert!(
        timeline["title"]
            .as_str()
            .unwrap()
            .contains("on one time axis"),
        "the first picture compares the timelines"
    );
    let over_step = svgs
        .iter()
        .filter(|s| {
            s["title"]
                .as_str()
                .unwrap_or("")
                .contains("live memory over the step")
        })
        .count();
    assert_eq!(over_step, devices, "memory over the step of every device");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("the prediction is") && html.contains("× the measurement"));
    assert!(html.contains("peak ") && html.contains("the link ("));
}

#[test]
fn profile_reports_of_one_two_and_eight_devices_read_in_a_browser() {
    profile_page("browser-p1", "dp=1", 1);
    profile_page("browser-p2", "tp=2", 2);
    profile_page("browser-p8", "dp=2,tp=2,pp=2,zero=1,mbs=2", 8);
}

#[test]
fn plan_reports_of_a_tiny_model_and_of_7b_and_70b_on_64_gpus_read_in_a_browser() {
    for (tag, model, cluster, seq, batch) in [
        ("browser-small", "llama-small", "this-machine", "128", "8"),
        (
            "browser-7b",
            "llama2-7b",
            "dgx-a100-80g,nodes=8",
            "4096",
            "512",
        ),
        (
            "browser-70b",
            "llama3-70b",
            "dgx-a100-80g,nodes=8",
            "4096",
            "512",
        ),
    ] {
        let out = temp_dir(tag);
        ferrotron(&[
            "plan",
            "--model",
            model,
            "--cluster",
            cluster,
            "--seq",
            seq,
            "--global-batch",
            batch,
            "--out",
            out.to_str().unwrap(),
        ]);
        // Memory per stage and the candidates, as tables; one memory chart.
        let g = check_page(&out.join("report.html"), 2, 1);
        let headers = g["tables"][1]["headers"].to_string();
        assert!(
            headers.contains("step (s)") && headers.contains("MFU (%)"),
            "{headers}"
        );
    }
    // A 32-stage plan: labels must turn or thin, not collide.
    let out = temp_dir("browser-deep");
    ferrotron(&[
        "plan",
        "--model",
        "llama2-7b",
        "--cluster",
        "dgx-a100-80g,nodes=8",
        "--seq",
        "4096",
        "--global-batch",
        "512",
        "--layout",
        "dp=1,tp=2,pp=32,mbs=1",
        "--out",
        out.to_str().unwrap(),
    ]);
    let g = check_page(&out.join("report.html"), 2, 1);
    assert_eq!(g["svgs"][0]["bars"].as_array().unwrap().len(), 32);
}

#[test]
fn train_report_reads_in_a_browser_and_report_rebuilds_it() {
    let out = temp_dir("browser-train");
    let run = out.join("run");
    ferrotron(&[
        "train",
        "--steps",
        "6",
        "--eval-every",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--layout",
        "dp=2",
        "--report",
        "--out-dir",
        run.to_str().unwrap(),
    ]);
    let g = check_page(&run.join("report.html"), 1, 1);
    let titles: Vec<&str> = g["svgs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["title"].as_str().unwrap_or(""))
        .collect();
    for want in ["loss", "tokens per second", "idle per device"] {
        assert!(
            titles.iter().any(|t| t.starts_with(want)),
            "{want}: {titles:?}"
        );
    }
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(html.contains("straggler warnings"));
    // The same page, made afterwards from the run's directory.
    let again = out.join("again.html");
    ferrotron(&[
        "report",
        run.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(std::fs::read_to_string(again).unwrap(), html);
}

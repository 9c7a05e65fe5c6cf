//! Every report, rendered in a real browser (headless Chromium) at 800, 1280 and 1920 px: nothing
//! scrolls the page sideways; what was run (model, cluster, batch × sequence) is on the first
//! screen; its tables are HTML tables; each device's memory bar is at least 4 px tall; no two labels
//! overlap; capacity is drawn or gauged at any fill; no colour means two things on one page; no
//! chart is empty; a predicted timeline holds the whole step (reduction and optimizer); and nothing
//! is fetched from a network. Each page is also screenshot to a PNG beside it.
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

/// Screen widths every page is checked at (px); the screen is this tall.
const WIDTHS: [u32; 3] = [800, 1280, 1920];
const HEIGHT: u32 = 1000;

/// Runs the browser headless on `page` at `width` px with `args`, giving up after a minute; its
/// standard output.
fn browse(page: &Path, width: u32, args: &[String]) -> String {
    let profile = page.with_extension("chromium-profile");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--window-size={width},{HEIGHT}"))
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

/// The page's figures as the browser laid it out at `width` px.
fn render(report: &Path, width: u32) -> Value {
    let html = std::fs::read_to_string(report).unwrap();
    let probe = report.with_file_name("probe.html");
    let script = format!("<script>{GEOMETRY}</script></body>");
    std::fs::write(&probe, html.replace("</body>", &script)).unwrap();
    let dom = browse(&probe, width, &["--dump-dom".to_string()]);
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
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{}: {e}", report.display()))
}

/// A screenshot of the page at 1280 px, beside it.
fn screenshot(report: &Path) {
    let png = report.with_extension("png");
    browse(report, 1280, &[format!("--screenshot={}", png.display())]);
    let bytes = std::fs::read(&png).expect("a screenshot");
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{}: not a picture of a page",
        png.display()
    );
}

fn overlap(a: &Value, b: &Value) -> bool {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    // Half a pixel of slack: glyph boxes of neighbouring labels may touch.
    f(a, "x") + 0.5 < f(b, "x") + f(b, "w")
        && f(b, "x") + 0.5 < f(a, "x") + f(a, "w")
        && f(a, "y") + 0.5 < f(b, "y") + f(b, "h")
        && f(b, "y") + 0.5 < f(a, "y") + f(a, "h")
}

/// What a page of one kind must show besides what every page must.
struct Expect<'a> {
    /// Tables and memory charts, at least.
    tables: usize,
    memory_charts: usize,
    /// The model's name, as the command gave it.
    model: &'a str,
    /// Whether a predicted timeline is drawn (then it must hold the whole step).
    predicted_timeline: bool,
}

/// What every report must be, whatever made it, at every width; the figures at 1280 px.
fn check_page(report: &Path, want: &Expect) -> Value {
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
    let mut at_1280 = Value::Null;
    for width in WIDTHS {
        let g = render(report, width);
        let name = format!("{} at {width} px", report.display());
        check_layout(&name, &g, want);
        check_charts(&name, &g, want);
        if width == 1280 {
            at_1280 = g;
        }
    }
    screenshot(report);
    at_1280
}

/// The page as a whole: no sideways scroll, what was run on the first screen, real tables.
fn check_layout(name: &str, g: &Value, want: &Expect) {
    assert!(
        g["scroll_width"].as_f64() <= g["viewport"].as_f64(),
        "{name}: the page scrolls sideways: {} > {}",
        g["scroll_width"],
        g["viewport"]
    );
    let facts = g["facts"]["text"].as_str().unwrap_or("");
    for needed in [
        want.model,
        "cluster",
        "batch × sequence",
        "×",
        "precision",
        "date",
    ] {
        assert!(
            facts.contains(needed),
            "{name}: `{needed}` missing from what was run: {facts}"
        );
    }
    assert!(
        g["facts"]["bottom"].as_f64().unwrap_or(f64::MAX) <= f64::from(HEIGHT),
        "{name}: what was run is below the first screen ({})",
        g["facts"]["bottom"]
    );
    assert_eq!(g["pre"], 0, "{name}: preformatted text instead of tables");
    let t = g["tables"].as_array().unwrap();
    assert!(t.len() >= want.tables, "{name}: {} tables", t.len());
    for table in t {
        assert!(table["rows"].as_u64() > Some(0), "{name}: an empty table");
        assert!(
            table["right"].as_f64() <= g["viewport"].as_f64(),
            "{name}: a table is wider than the page"
        );
    }
}

/// Each chart: labels apart, nothing empty, bars visible, capacity drawn or gauged, colours
/// explained by its legend and meaning one thing on the page, the predicted step whole.
fn check_charts(name: &str, g: &Value, want: &Expect) {
    let mut memory_charts = 0;
    let mut meaning_of: std::collections::BTreeMap<String, String> = Default::default();
    let mut predicted_kinds = std::collections::BTreeSet::new();
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
            // Bytes come whole: no tick of a fraction of one.
            let text = a["text"].as_str().unwrap_or("");
            assert!(
                !(text.ends_with(" B") && text.contains('.')),
                "{name}, chart `{title}`: a tick of `{text}`"
            );
        }
        assert!(
            svg["marks"].as_u64() > Some(0),
            "{name}: chart `{title}` is empty"
        );
        let legend: Vec<&Value> = svg["legend_colours"].as_array().unwrap().iter().collect();
        for c in svg["marked_colours"].as_array().unwrap() {
            assert!(
                legend.contains(&c),
                "{name}, chart `{title}`: colour {c} is in no legend entry"
            );
        }
        for pair in svg["meanings"].as_array().unwrap() {
            let colour = pair[0].as_str().unwrap_or("").to_lowercase();
            // A legend names a limit with its size (`capacity 3.22 GB`); the line by its name.
            let meaning = pair[1].as_str().unwrap_or("");
            let meaning = match meaning.rsplit_once(' ') {
                Some((head, unit)) if ["B", "KB", "MB", "GB", "TB"].contains(&unit) => {
                    head.rsplit_once(' ').map_or(head, |(h, _)| h)
                }
                _ => meaning,
            };
            let earlier = meaning_of
                .entry(colour.clone())
                .or_insert(meaning.to_string());
            assert_eq!(
                earlier, meaning,
                "{name}: colour {colour} means both `{earlier}` and `{meaning}`"
            );
        }
        for a in svg["actions"].as_array().unwrap() {
            assert!(
                ["measured", "predicted"].contains(&a["row"].as_str().unwrap_or("")),
                "{name}: a timeline box without its row: {a}"
            );
            assert!(
                a["device"].as_str().is_some_and(|d| !d.is_empty()),
                "{name}: {a}"
            );
            assert!(
                a["width"].as_f64() >= Some(0.5),
                "{name}: a box too thin to see: {a}"
            );
            if a["row"] == "predicted" {
                predicted_kinds.insert(a["kind"].as_str().unwrap_or("").to_string());
            }
        }
        let bars = svg["bars"].as_array().unwrap();
        if bars.is_empty() {
            continue;
        }
        memory_charts += 1;
        for bar in bars {
            assert!(
                bar["height"].as_f64() >= Some(4.0),
                "{name}, chart `{title}`: device {}'s bar is {} px tall",
                bar["device"],
                bar["height"]
            );
            assert_eq!(bar["terms"], 7, "{name}: a segment per term");
        }
        let marked = |k: &str| svg[k].as_array().unwrap().iter().any(|l| l == "capacity");
        assert!(
            marked("limits") || marked("headroom"),
            "{name}, chart `{title}`: capacity neither drawn nor gauged"
        );
    }
    assert!(
        memory_charts >= want.memory_charts,
        "{name}: {memory_charts} memory charts"
    );
    if want.predicted_timeline {
        for kind in ["forward", "backward", "optimizer"] {
            assert!(
                predicted_kinds.contains(kind),
                "{name}: the predicted timeline has no {kind}: {predicted_kinds:?}"
            );
        }
    }
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

fn profile_page(tag: &str, layout: &str, devices: usize, kinds: &[&str]) {
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
    let page = out.join("report.html");
    let g = check_page(
        &page,
        &Expect {
            tables: 4,
            memory_charts: 2,
            model: "llama-small",
            predicted_timeline: true,
        },
    );
    predicted_kinds(&g, kinds);
    let svgs = g["svgs"].as_array().unwrap();
    let titles: Vec<&str> = svgs
        .iter()
        .map(|s| s["title"].as_str().unwrap_or(""))
        .collect();
    assert!(
        titles.iter().any(|t| t.contains("on one time axis")),
        "the timelines compared: {titles:?}"
    );
    let over_step = titles
        .iter()
        .filter(|t| t.contains("live memory over the step"))
        .count();
    assert_eq!(over_step, devices, "memory over the step of every device");
    let map = svgs
        .iter()
        .find(|s| s["title"].as_str().unwrap_or("").contains(" devices on "))
        .expect("the layout on the cluster");
    assert!(map["marks"].as_u64() >= Some(devices as u64));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("measured / predicted") && !html.contains("the prediction is"));
    assert!(html.contains("peak ") && html.contains("inside a node"));
    // The time by part, a verdict for each part.
    let time = g["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["headers"].to_string().contains("verdict"))
        .expect("the time breakdown table");
    assert_eq!(
        time["rows"], 7,
        "step, forward, backward, their communication, reduction, optimizer"
    );
    memory_terms_off_have_verdicts(&html);
}

/// The predicted timeline draws each of `kinds`.
fn predicted_kinds(g: &Value, kinds: &[&str]) {
    let drawn: Vec<&str> = g["svgs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["actions"].as_array().unwrap())
        .filter(|a| a["row"] == "predicted")
        .filter_map(|a| a["kind"].as_str())
        .collect();
    for k in kinds {
        assert!(
            drawn.contains(k),
            "the predicted step has no {k}: {drawn:?}"
        );
    }
}

/// Every memory term of at least 5% of a device's peak that is off its prediction by more than the
/// profile's threshold (15%) has a verdict: read back from the page's own memory table.
fn memory_terms_off_have_verdicts(html: &str) {
    let table = html
        .split("<table>")
        .find(|t| t.contains("peak memory per term"))
        .expect("the memory table");
    // The text of each data cell (`<td>` or `<td class="num">`) of `row`.
    let cells = |row: &str| -> Vec<String> {
        row.split("<td")
            .skip(1)
            .map(|c| {
                c.split('>')
                    .nth(1)
                    .unwrap_or("")
                    .split('<')
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .collect()
    };
    // The terms are the columns the page names in megabytes; the last of them is the total.
    let headers: Vec<&str> = table
        .split("</thead>")
        .next()
        .unwrap()
        .split("<th>")
        .skip(1)
        .map(|h| h.split('<').next().unwrap_or(""))
        .collect();
    let columns: Vec<(usize, &str)> = headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| h.strip_suffix(" (MB)").map(|t| (i, t)))
        .collect();
    let ((total, _), terms) = columns.split_last().expect("the terms and their total");
    assert!(terms.len() >= 6, "{headers:?}");
    for row in table.split("<tr>").skip(2) {
        let c = cells(row);
        let pair = |i: usize| -> (f64, f64) {
            let (a, b) = c[i].split_once(" / ").expect("measured / predicted");
            (a.trim().parse().unwrap(), b.trim().parse().unwrap())
        };
        let (total_m, total_p) = pair(*total);
        for &(i, term) in terms {
            let (m, p) = pair(i);
            let share = m.max(p) / total_m.max(total_p);
            // Rounded to 0.01 MB in the table: only clear cases are judged.
            if share >= 0.06 && p > 0.1 && (m / p - 1.0).abs() > 0.2 {
                assert!(
                    html.contains(&format!("memory, {term}:")),
                    "memory term {term} is {m} MB against {p} MB predicted, with no verdict"
                );
            }
        }
    }
}

#[test]
fn profile_reports_of_one_two_and_eight_devices_read_in_a_browser() {
    profile_page(
        "browser-p1",
        "dp=1",
        1,
        &["forward", "backward", "optimizer"],
    );
    profile_page(
        "browser-p2",
        "tp=2",
        2,
        &["forward", "backward", "optimizer"],
    );
    profile_page(
        "browser-p8",
        "dp=2,tp=2,pp=2,zero=1,mbs=2",
        8,
        &["forward", "backward", "reduction", "optimizer"],
    );
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
        let page = out.join("report.html");
        let g = check_page(
            &page,
            &Expect {
                tables: 2,
                memory_charts: 1,
                model,
                predicted_timeline: true,
            },
        );
        predicted_kinds(&g, &["forward", "backward", "optimizer"]);
        let candidates = g["tables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["headers"].to_string().contains("MFU (%)"))
            .expect("the candidates");
        let headers = candidates["headers"].to_string();
        assert!(
            headers.contains("step (s)") && headers.contains("variants"),
            "{headers}"
        );
        let html = std::fs::read_to_string(&page).unwrap();
        // The explanation's steps, as the terminal prints them.
        for step in ["the arithmetic first", "reduce", "shard", "chosen"] {
            assert!(html.contains(step), "{tag}: the plan page lacks `{step}`");
        }
        // One row per shape: no two rows share dp, tp, pp, cp and ZeRO.
        let shapes: Vec<String> = html
            .split("<tr>")
            .filter_map(|r| r.split("<td>").nth(2))
            .filter(|c| c.starts_with("dp="))
            .map(|c| {
                let spec = c.split('<').next().unwrap_or("");
                spec.split(',')
                    .filter(|kv| {
                        ["dp=", "tp=", "pp=", "cp=", "zero="]
                            .iter()
                            .any(|k| kv.starts_with(k))
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        let mut distinct = shapes.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(
            distinct.len(),
            shapes.len(),
            "{tag}: candidates repeat a shape: {shapes:?}"
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
    let g = check_page(
        &out.join("report.html"),
        &Expect {
            tables: 2,
            memory_charts: 1,
            model: "llama2-7b",
            predicted_timeline: true,
        },
    );
    let bars = g["svgs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["bars"].as_array().unwrap().len())
        .max();
    assert_eq!(bars, Some(32));
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
    let g = check_page(
        &run.join("report.html"),
        &Expect {
            tables: 1,
            memory_charts: 1,
            model: "llama-small",
            predicted_timeline: false,
        },
    );
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
    // Every header of the memory table names its unit; `other` has its column; the idle column
    // says which idle it is.
    let headers: Vec<String> = g["tables"][0]["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap_or("").to_string())
        .collect();
    for h in &headers[4..] {
        assert!(
            h.contains('(') && h.contains(')'),
            "a header without its unit: {h}"
        );
    }
    assert!(
        headers.iter().any(|h| h.starts_with("other (")),
        "{headers:?}"
    );
    assert!(
        headers.iter().any(|h| h.starts_with("idle, last step")),
        "{headers:?}"
    );
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(html.contains("straggler warnings"));
    assert!(!html.contains("kB") && !html.contains(">-0.0"));
    // The validation loss before the first step is drawn, at step 0, with the three evaluations.
    let validation = html
        .split("<polyline")
        .find(|p| p.contains("data-series=\"validation\""))
        .expect("the validation series");
    let points = validation
        .split("points=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    assert_eq!(points.split(' ').count(), 4, "{points}");
    assert!(html.contains("validation loss") && html.contains("before the first step"));
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

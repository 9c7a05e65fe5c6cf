//! The README's and the guides' commands, as a new user would type them: every
//! `cargo run --release -- …` and `mpirun … target/release/ferrotron …` line of their indented
//! command blocks, run in order (the README, then `docs/` in [`PAGES`]' order) in a fresh directory
//! that holds only what a clone has (`tests/fixtures`, `data`), shortened so the suite stays fast.
//! So no documented example can rot.

use std::path::{Path, PathBuf};

/// The pages whose commands run, in the order a reader meets them: later guides use what earlier
/// commands made (the default run's `runs/default/model`, a checkpoint to resume).
pub const PAGES: &[&str] = &[
    "README.md",
    "docs/train.md",
    "docs/models.md",
    "docs/plan.md",
    "docs/parallelism.md",
    "docs/long-sequences.md",
    "docs/checkpoints.md",
    "docs/lora.md",
    "docs/profile.md",
    "docs/bad-input.md",
    "docs/verification.md",
    "docs/performance.md",
];

/// One documented command: its page, line number and words (continuation lines joined, the
/// trailing `# comment` removed).
#[derive(Debug, Clone)]
pub struct ReadmeCommand {
    pub page: &'static str,
    pub line: usize,
    pub words: Vec<String>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every command of the pages' indented blocks whose first word is `cargo` or `mpirun`.
pub fn commands() -> Vec<ReadmeCommand> {
    PAGES.iter().flat_map(|page| page_commands(page)).collect()
}

fn page_commands(page: &'static str) -> Vec<ReadmeCommand> {
    let text = std::fs::read_to_string(repo().join(page)).expect(page);
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let Some(body) = line.strip_prefix("    ") else {
            pending = None;
            continue;
        };
        let body = body.trim();
        let (start, joined) = match pending.take() {
            Some((start, before)) => (start, format!("{before} {body}")),
            None if body.starts_with("cargo ") || body.starts_with("mpirun ") => {
                (i + 1, body.to_string())
            }
            None => continue,
        };
        if let Some(rest) = joined.strip_suffix('\\') {
            pending = Some((start, rest.trim().to_string()));
            continue;
        }
        let command = joined.split(" # ").next().unwrap_or("").trim();
        let command = command.split("  #").next().unwrap_or("").trim();
        out.push(ReadmeCommand {
            page,
            line: start,
            words: shell_words(command),
        });
    }
    out
}

/// The words a shell makes of `command`: split at whitespace outside quotes, the quotes removed
/// (`--fit-on "GPT 1.7B,GPT 1008.0B"` is two words).
fn shell_words(command: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut started) = (Vec::new(), String::new(), None, false);
    for ch in command.chars() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(ch);
                started = true;
            }
            (None, c) if c.is_whitespace() => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => {
                word.push(c);
                started = true;
            }
        }
    }
    assert!(quote.is_none(), "an unclosed quote in `{command}`");
    if started {
        words.push(word);
    }
    words
}

/// The `run.toml` example of the training guide (its only TOML block).
pub fn toml_example() -> String {
    let text = std::fs::read_to_string(repo().join("docs/train.md")).expect("docs/train.md");
    let start = text.find("```toml\n").expect("a TOML block") + "```toml\n".len();
    let end = start + text[start..].find("```").expect("its end");
    text[start..end].to_string()
}

/// A directory laid out like a fresh clone for the commands' relative paths.
pub fn clone_like(dir: &Path) {
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    for (link, target) in [
        ("tests/fixtures", repo().join("tests/fixtures")),
        ("data", repo().join("data")),
    ] {
        let at = dir.join(link);
        if !at.exists() {
            #[cfg(unix)]
            std::os::unix::fs::symlink(target.canonicalize().unwrap(), &at).unwrap();
        }
    }
    std::fs::write(dir.join("run.toml"), toml_example()).unwrap();
}

/// Sets `--flag value` in `words`: replaces the value when the flag is there, appends it when not.
pub fn set_flag(words: &mut Vec<String>, flag: &str, value: &str) {
    match words.iter().position(|w| w == flag) {
        Some(i) if i + 1 < words.len() => words[i + 1] = value.to_string(),
        _ => {
            words.push(flag.to_string());
            words.push(value.to_string());
        }
    }
}

/// The command made short enough for the suite, as a user's shorter run of the same example:
/// fewer steps (the steps a checkpoint is named after scaled with them), tiny benchmark sizes.
pub fn shortened(words: &[String]) -> Vec<String> {
    let mut w: Vec<String> = words
        .iter()
        .map(|x| x.replace("step-000050", "step-000001"))
        .collect();
    let sub = |w: &[String]| -> String {
        let i = w.iter().position(|x| x == "--").map_or(0, |i| i + 1);
        let i = w
            .iter()
            .position(|x| x.ends_with("/ferrotron"))
            .map_or(i, |j| j + 1);
        w[i..].iter().take(2).cloned().collect::<Vec<_>>().join(" ")
    };
    let which = sub(&w);
    if which.starts_with("train") {
        let resumed = w.iter().any(|x| x == "--resume");
        set_flag(&mut w, "--steps", if resumed { "3" } else { "2" });
        if w.iter().any(|x| x == "--checkpoint-every") {
            set_flag(&mut w, "--checkpoint-every", "1");
        }
        set_flag(&mut w, "--eval-batches", "1");
    } else if which == "bench train" {
        for (f, v) in [
            ("--model", "llama-tiny"),
            ("--steps", "1"),
            ("--warmup", "0"),
            ("--seq", "32"),
        ] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench attention" {
        for (f, v) in [("--seq", "256"), ("--reps", "1")] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench context" {
        set_flag(&mut w, "--seq", "512");
    } else if which == "bench kernels" {
        for (f, v) in [("--model", "llama-tiny"), ("--batch", "2"), ("--seq", "32")] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench zero3" {
        for (f, v) in [("--model", "llama-tiny"), ("--batch", "8"), ("--seq", "32")] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench lora" || which == "bench qlora" {
        for (f, v) in [("--model", "llama-tiny"), ("--steps", "1"), ("--seq", "32")] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench predict" {
        for (f, v) in [("--model", "llama-tiny"), ("--steps", "2")] {
            set_flag(&mut w, f, v);
        }
    } else if which == "bench pipeline" {
        for (f, v) in [("--micro-batches", "4"), ("--seq", "32")] {
            set_flag(&mut w, f, v);
        }
    } else if which.starts_with("profile") {
        set_flag(&mut w, "--steps", "2");
    }
    w
}

//! Every `cargo run` command of the README and the guides in `docs/` runs, in order, on what a fresh clone has. The
//! `mpirun` commands run in `tests/mpi.rs` (they need the MPI build).

mod common;

use common::readme::{clone_like, commands, shortened};
use common::temp_dir;
use std::process::Command;

#[test]
fn every_readme_command_runs_on_a_fresh_clone() {
    let dir = temp_dir("readme");
    clone_like(&dir);
    let mut ran = Vec::new();
    for c in commands() {
        let w = &c.words;
        // `cargo build` / `cargo test` are this suite itself; mpirun lines run in tests/mpi.rs.
        if w[0] != "cargo" || w.get(1).map(String::as_str) != Some("run") {
            continue;
        }
        let args = &w[w.iter().position(|x| x == "--").expect("cargo run -- …") + 1..];
        let args = shortened(args);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
        cmd.args(&args).current_dir(&dir);
        let first_two = args.iter().take(2).cloned().collect::<Vec<_>>().join(" ");
        if first_two.starts_with("calibrate") || first_two == "bench predict" {
            // `calibrate --this-machine` (also run by `bench predict`) caches what `this-machine`
            // means: keep the other tests' `this-machine` as it was.
            cmd.env("XDG_CACHE_HOME", dir.join("cache"));
        }
        let out = cmd.output().expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: String = stderr.lines().rev().take(15).collect::<Vec<_>>().join("\n");
        assert!(
            out.status.success(),
            "{} line {}: `ferrotron {}` failed:\n{tail}",
            c.page,
            c.line,
            args.join(" ")
        );
        ran.push(args.join(" "));
    }
    eprintln!(
        "{} documented commands ran:\n  {}",
        ran.len(),
        ran.join("\n  ")
    );
    assert!(ran.len() >= 25, "only {} commands found", ran.len());
    // The clone and what its commands wrote (~0.7 GB) are left behind only when a command failed.
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README is a front door (at most 300 lines) and every relative link of it and of the guides
/// leads to a file that exists.
#[test]
fn the_readme_is_short_and_every_relative_link_resolves() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines (at most 300)");
    let mut pages = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    let mut checked = 0;
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for (i, line) in text.lines().enumerate() {
            for part in line.split("](").skip(1) {
                let Some(target) = part.split(')').next() else {
                    continue;
                };
                let target = target.split('#').next().unwrap_or("");
                if target.is_empty() || target.contains("://") {
                    continue;
                }
                let at = page.parent().unwrap().join(target);
                assert!(
                    at.exists(),
                    "{} line {}: the link `{target}` leads nowhere",
                    page.display(),
                    i + 1
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "only {checked} links found");
}

//! Every `cargo run` command of the README runs, in order, on what a fresh clone has. The
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
            "README line {}: `ferrotron {}` failed:\n{tail}",
            c.line,
            args.join(" ")
        );
        ran.push(args.join(" "));
    }
    eprintln!("{} README commands ran:\n  {}", ran.len(), ran.join("\n  "));
    assert!(ran.len() >= 25, "only {} commands found", ran.len());
}

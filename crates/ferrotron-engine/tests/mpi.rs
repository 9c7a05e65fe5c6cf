//! The MPI backend under a real `mpirun` (built with `--features mpi`; needs OpenMPI).
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::{Duration, Instant};

fn mpirun(np: usize, args: &[&str]) -> (bool, String, Duration) {
    let t0 = Instant::now();
    let out = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
            env!("CARGO_BIN_EXE_ferrotron-mpi-selftest"),
        ])
        .args(args)
        .output()
        .expect("mpirun runs (install openmpi-bin)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, t0.elapsed())
}

#[test]
fn every_operation_matches_the_reference_under_mpirun() {
    for np in [2, 4] {
        let (ok, text, _) = mpirun(np, &["check"]);
        assert!(
            ok && text.contains(&format!("passed on {np} ranks")),
            "{text}"
        );
    }
}

#[test]
fn a_rank_that_dies_ends_every_other_rank_non_zero() {
    let (ok, text, took) = mpirun(4, &["die", "2"]);
    assert!(!ok, "{text}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn a_rank_that_never_arrives_is_named_in_a_timeout() {
    let (ok, text, took) = mpirun(4, &["stall", "1", "3"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("timed out after 3s waiting for rank 1"),
        "{text}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

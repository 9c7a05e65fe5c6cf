//! Checkpoints on an S3-compatible server that dies: killed while a run saves, and down when a run
//! resumes. Nothing torn, a clear error naming the URL, and a restart succeeds once it is back.
//! (A binary of its own: stopping its server must not disturb other tests.)
mod common;
#[path = "../../ferrotron-engine/tests/common/local_s3.rs"]
mod local_s3;

use common::{stderr, temp_dir};
use ferrotron_engine::storage::Location;
use local_s3::LocalS3;
use std::path::Path;
use std::process::{Command, Output};

fn train(server: &LocalS3, out: &Path, steps: &str, extra: &[&str]) -> Output {
    let args = common::train_args(out, steps, extra);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    server.apply(&mut cmd).args(&args).output().expect("runs")
}

fn inspect(server: &LocalS3, at: &str) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    server
        .apply(&mut cmd)
        .args(["checkpoint", "inspect", at])
        .output()
        .expect("runs")
}

#[test]
fn a_server_killed_while_a_run_saves_leaves_the_last_checkpoint_whole_and_a_restart_resumes() {
    let server = LocalS3::start(&temp_dir("s3-faults-server"), &["ckpt"]);
    server.export();
    let dir = temp_dir("s3-faults");
    let root_url = "s3://ckpt/run";
    let root = Location::parse(root_url).unwrap();

    // Killed once the second checkpoint's upload has begun (its prefix appears on the server):
    // that save, or a later one, meets a dead server.
    let watched = server.object_file("ckpt", "run/step-000004");
    let killer = {
        let server_dir = server.dir.clone();
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            while !watched.exists() && started.elapsed().as_secs() < 120 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/local-s3.sh");
            Command::new(script)
                .arg("stop")
                .arg(&server_dir)
                .status()
                .unwrap();
        })
    };
    let o = train(
        &server,
        &dir,
        "60",
        &["--checkpoint-every", "2", "--checkpoint-dir", root_url],
    );
    killer.join().unwrap();
    let e = stderr(&o);
    assert!(
        !o.status.success(),
        "the run cannot finish its saves without the server"
    );
    assert!(
        e.contains(root_url) && e.contains("AWS_ENDPOINT_URL"),
        "a clear error: {e}"
    );

    // Back up: `latest` names a complete checkpoint, which verifies; a torn save is no checkpoint.
    server.restart();
    let latest = String::from_utf8(root.join("latest").read(100).unwrap()).unwrap();
    let latest = latest.trim().to_string();
    let o = inspect(&server, root_url);
    assert!(
        o.status.success(),
        "latest ({latest}) verifies: {}",
        stderr(&o)
    );
    let entries = root.list().unwrap();
    println!("after the kill: latest {latest}, {entries:?}");
    for entry in entries {
        if entry.is_dir && entry.name != latest && entry.name.starts_with("step-") {
            let at = format!("{root_url}/{}", entry.name);
            let complete = root
                .join(&entry.name)
                .join("manifest.json")
                .exists()
                .unwrap();
            let o = inspect(&server, &at);
            assert_eq!(o.status.success(), complete, "{at}: {}", stderr(&o));
        }
    }

    // The run continues from there.
    let o = train(
        &server,
        &dir,
        "6",
        &[
            "--resume",
            root_url,
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            root_url,
        ],
    );
    let resumed_from: usize = latest.trim_start_matches("step-").parse().unwrap();
    if resumed_from < 6 {
        assert!(o.status.success(), "resumed from {latest}: {}", stderr(&o));
    }

    // Killed in the middle of a resume's reads (after its first file, while the drill holds the
    // reader): a clear error; up again, the same resume succeeds.
    let out2 = dir.join("second");
    let second = "s3://ckpt/second";
    let o = train(
        &server,
        &out2,
        "4",
        &[
            "--layout",
            "dp=2",
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            second,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let resume = [
        "--layout",
        "dp=2",
        "--resume",
        second,
        "--checkpoint-dir",
        second,
    ];
    let args = common::train_args(&out2, "6", &resume);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    let mut child = server
        .apply(&mut cmd)
        .args(&args)
        .env(ferrotron_engine::checkpoint::remote::FETCH_PAUSE_ENV, "3")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    loop {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut err, &mut line).unwrap() == 0 {
            break;
        }
        said.push_str(&line);
        if line.contains("fetched; waiting") {
            server.stop();
        }
    }
    let status = child.wait().unwrap();
    assert!(
        said.contains("fetched; waiting"),
        "the drill held the reader: {said}"
    );
    assert!(
        !status.success() && said.contains(second) && said.contains("AWS_ENDPOINT_URL"),
        "{said}"
    );
    server.restart();
    let o = train(&server, &out2, "6", &resume);
    assert!(o.status.success(), "{}", stderr(&o));
}

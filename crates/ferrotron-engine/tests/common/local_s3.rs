#![allow(dead_code)]
//! A real S3-compatible server (s3s-fs, through `scripts/local-s3.sh`) for a test: started in a
//! directory of the test's own, stopped when dropped. Shared by the engine's and the CLI's tests.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct LocalS3 {
    pub dir: PathBuf,
    /// The `AWS_…` variables the script printed.
    pub env: Vec<(String, String)>,
    port: String,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/local-s3.sh")
}

/// `scripts/local-s3.sh start DIR BUCKETS…` (on `port`, when given), which must succeed.
fn start_script(dir: &Path, buckets: &[&str], port: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(script());
    cmd.arg("start").arg(dir).args(buckets);
    if let Some(port) = port {
        cmd.env("PORT", port);
    }
    let out = cmd.output().expect("scripts/local-s3.sh runs");
    assert!(
        out.status.success(),
        "scripts/local-s3.sh start failed (is s3s-fs installed? cargo install s3s-fs@0.14.1 --features binary --locked): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

impl LocalS3 {
    /// Starts a server with its data in `dir` (emptied first) and the `buckets` created.
    pub fn start(dir: &Path, buckets: &[&str]) -> Self {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let out = start_script(dir, buckets, None);
        let env: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(env.iter().any(|(k, _)| k == "AWS_ENDPOINT_URL"), "{env:?}");
        let port = std::fs::read_to_string(dir.join("server.port"))
            .unwrap()
            .trim()
            .to_string();
        Self {
            dir: dir.to_path_buf(),
            env,
            port,
        }
    }

    /// The variable `key` the script printed.
    pub fn var(&self, key: &str) -> &str {
        &self.env.iter().find(|(k, _)| k == key).unwrap().1
    }

    /// `cmd` configured to use this server.
    pub fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
    }

    /// Sets this server's variables in this process (tests that call the library directly; one
    /// server per test binary then).
    pub fn export(&self) {
        for (k, v) in &self.env {
            std::env::set_var(k, v);
        }
    }

    /// Stops the server (its data stays).
    pub fn stop(&self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
        // Until the port is closed: a request made now must fail.
        for _ in 0..100 {
            if std::net::TcpStream::connect(format!("127.0.0.1:{}", self.port)).is_err() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Starts the server again on the same port over the same data.
    pub fn restart(&self) {
        start_script(&self.dir, &[], Some(&self.port));
    }

    /// The file holding object `key` of `bucket` (s3s-fs keeps objects as files).
    pub fn object_file(&self, bucket: &str, key: &str) -> PathBuf {
        self.dir.join("data").join(bucket).join(key)
    }
}

impl Drop for LocalS3 {
    fn drop(&mut self) {
        self.stop();
    }
}

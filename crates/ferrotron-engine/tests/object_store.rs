//! The object-store client against a real S3-compatible server: whole and ranged reads, writes
//! (one request and in parts), listing, deletion, and a clear error, naming the URL, for a missing
//! bucket, wrong credentials and a server that is down.
mod common;
#[path = "common/local_s3.rs"]
mod local_s3;

use ferrotron_engine::storage::{s3, Location};
use local_s3::LocalS3;

/// The tests' servers are named by process-wide variables (`AWS_ENDPOINT_URL`…): one at a time.
static ONE_SERVER: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn reads_writes_lists_and_deletes_objects_and_explains_failures() {
    let _one = ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner());
    let server = LocalS3::start(&common::temp_dir("s3"), &["bucket"]);
    server.export();
    let root = Location::parse("s3://bucket/run").unwrap();

    // Whole, ranged, missing.
    let obj = root.join("a/one.bin");
    let bytes: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    obj.write(&bytes).unwrap();
    assert_eq!(obj.read(1 << 20).unwrap(), bytes);
    assert_eq!(obj.read_range(100..356).unwrap(), bytes[100..356]);
    assert_eq!(obj.size().unwrap(), Some(10_000));
    assert!(obj
        .read(100)
        .unwrap_err()
        .to_string()
        .contains("larger than"));
    assert_eq!(root.join("a/none").try_read(1 << 20).unwrap(), None);
    assert_eq!(root.join("a/none").size().unwrap(), None);

    // In parts (the client's multipart upload, with S3's smallest parts: 5 MiB).
    let parted = root.join("b/parted.bin");
    let Location::S3(p) = &parted else {
        unreachable!()
    };
    let large: Vec<u8> = (0..11 << 20).map(|i: u32| (i % 251) as u8).collect();
    s3::upload(
        p,
        &mut std::io::Cursor::new(&large),
        large.len() as u64,
        5 << 20,
    )
    .unwrap();
    assert_eq!(parted.read(1 << 30).unwrap(), large);

    // Listing: files and "directories" directly under the prefix.
    let mut names: Vec<(String, bool)> = root
        .list()
        .unwrap()
        .into_iter()
        .map(|l| (l.name, l.is_dir))
        .collect();
    names.sort();
    assert_eq!(names, [("a".to_string(), true), ("b".to_string(), true)]);
    root.join("b").remove_all().unwrap();
    assert_eq!(root.list().unwrap().len(), 1);
    obj.remove().unwrap();
    assert_eq!(obj.size().unwrap(), None);

    // Failures: each names the URL and what to check.
    let missing = Location::parse("s3://no-such-bucket/x").unwrap();
    let e = missing.check_reachable().unwrap_err().to_string();
    assert!(
        e.contains("s3://no-such-bucket") && e.contains("does not exist"),
        "{e}"
    );
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "wrong");
    let e = root.join("c").write(b"x").unwrap_err().to_string();
    assert!(
        e.contains("s3://bucket/run/c") && e.contains("AWS_SECRET_ACCESS_KEY"),
        "{e}"
    );
    server.export();
    server.stop();
    let started = std::time::Instant::now();
    let e = root.join("c").write(b"x").unwrap_err().to_string();
    assert!(
        e.contains("s3://bucket/run/c") && e.contains("AWS_ENDPOINT_URL"),
        "{e}"
    );
    assert!(started.elapsed().as_secs() < 30, "retries end");
    // Back up: the same request succeeds.
    server.restart();
    root.join("c").write(b"x").unwrap();
    assert_eq!(root.join("c").read(10).unwrap(), b"x");
}

/// A checkpoint saved whole (and one saved as ZeRO-3 halves), read by the four devices of tp=4:
/// each device gets its shard's values and reads its quarter of every cut tensor — a row-parallel
/// weight's input columns included, which the files hold cut-major — and the replicated ones whole,
/// no more: on disk exactly; on the store too, since these shapes align each device's ranges with
/// the 256 KiB hash blocks it fetches.
#[test]
fn a_finer_split_reads_only_its_slices_of_a_checkpoint() {
    use ferrotron_core::layout::LayoutSpec;
    use ferrotron_core::model::ModelConfig;
    use ferrotron_engine::checkpoint::{self, Checkpoint};
    use ferrotron_engine::hf::{self, StorageDtype};
    use ferrotron_engine::parallel::TpShard;
    use ferrotron_engine::transformer::ParamStore;

    let _one = ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner());
    let server = LocalS3::start(&common::temp_dir("s3-slices"), &["checkpoints"]);
    let dir = common::temp_dir("finer-split");
    let cfg = ModelConfig::llama(1024, 512, 1024, 2, 8, 8, 64, 10000.0);
    let params = ParamStore::init_random(&cfg, 3);
    let model = dir.join("model");
    hf::save_model(&model, &cfg, &params, StorageDtype::F32).unwrap();
    let remote = std::path::Path::new("s3://checkpoints/whole");
    let saved = [
        ("tp=1", dir.join("whole")),
        ("dp=2,zero=3", dir.join("zero3")),
        ("tp=1", remote.to_path_buf()),
    ];
    server.export();
    for (layout, root) in &saved {
        let layout = LayoutSpec::parse(layout).unwrap().layout;
        checkpoint::import_hf(&model, &layout, root, false).unwrap();
        let ck = Checkpoint::open(root).unwrap();
        for t in 0..4 {
            let shard = TpShard::new(&cfg, 4, t, false).unwrap();
            let (got, read) = shard.shard_store(&cfg, &ck, &|_| true).unwrap();
            let (want, _) = shard.shard_store(&cfg, &params, &|_| true).unwrap();
            assert_eq!(got.tensors, want.tensors, "{root:?}, device {t}");
            let need: usize = want.tensors.iter().map(|v| 4 * v.len()).sum();
            assert_eq!(read, need as u64, "{root:?}, device {t}");
        }
    }
}

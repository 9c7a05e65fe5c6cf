//! The threads backend against a naive reference, its accounting against the textbook, its clocks,
//! and its failures.

use ferrotron_core::rank::RankGrid;
use ferrotron_core::topology::Link;
use ferrotron_engine::comm::{
    selftest, Comm, DeviceMesh, Element, Group, LinkModel, ReduceOp, ThreadComm, ThreadWorld,
};
use std::time::Duration;

fn check_all_ops<T: Element>(conv: impl Fn(i32) -> T + Sync + Copy) {
    let mesh = DeviceMesh::new(RankGrid::new(2, 1, 2, 2, 4).unwrap(), 8).unwrap();
    let results = ThreadWorld::new(8)
        .timeout(Duration::from_secs(20))
        .run(|c| selftest::check_all_ops(c, &mesh, conv));
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// Tests that compare device times run alone: another test's threads on the same two cores would
/// change what they measure. The other tests share the cores among themselves.
static CORES: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    CORES.write().unwrap_or_else(|e| e.into_inner())
}

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    CORES.read().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn every_operation_matches_the_naive_reference_on_a_2x2x2_mesh() {
    let _cores = shared();
    check_all_ops::<f32>(|x| x as f32);
    check_all_ops::<half::bf16>(|x| half::bf16::from_f32(x as f32));
    check_all_ops::<half::f16>(|x| half::f16::from_f32(x as f32));
    check_all_ops::<i64>(|x| x as i64);
}

#[test]
fn results_are_bit_identical_on_every_rank_and_every_run() {
    let _cores = shared();
    let run = || {
        ThreadWorld::new(4)
            .run(|c| {
                let g = Group::new("world", vec![0, 1, 2, 3]);
                let mut buf: Vec<f32> = (0..1001)
                    .map(|i| ((i * 7919 + c.rank() * 104729) as f32).sin() * 1e3)
                    .collect();
                c.all_reduce(&g, &mut buf, ReduceOp::Sum).unwrap();
                buf.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
            })
            .into_iter()
            .map(|r| r.unwrap())
            .collect::<Vec<_>>()
    };
    let a = run();
    assert!(a.iter().all(|r| r == &a[0]), "ranks disagree");
    assert_eq!(a, run(), "runs disagree");
}

#[test]
fn bytes_per_device_equal_the_ring_textbook_figures() {
    let _cores = shared();
    for n in [2usize, 3, 4, 8] {
        for r in ThreadWorld::new(n).run(selftest::check_textbook_bytes) {
            r.unwrap().unwrap();
        }
    }
}

#[test]
fn a_simulated_1_gbs_link_charges_67_ms_for_64_mib_on_both_ends() {
    let _cores = alone();
    let gbs = Link {
        bandwidth_bytes_per_s: 1e9,
        latency_s: 10e-6,
    };
    let world = ThreadWorld::new(2).link(LinkModel {
        intra: gbs,
        inter: gbs,
        devices_per_node: 2,
    });
    let times = world.run(|c| {
        let mut buf = vec![0u8; 64 << 20];
        // The two clocks start apart by whatever each thread computed before (its start-up, the
        // allocation): a barrier brings them to one time, so the receiver's wait is the transfer.
        c.barrier(&Group::new("world", vec![0, 1])).unwrap();
        let t0 = c.device_time();
        if c.rank() == 0 {
            c.send(1, &buf, 0).unwrap();
        } else {
            c.recv(0, &mut buf, 0).unwrap();
        }
        c.device_time() - t0
    });
    for t in times.into_iter().map(|r| r.unwrap()) {
        let want = (64u64 << 20) as f64 / 1e9 + 10e-6;
        assert!((t - want).abs() < 1e-3, "device time {t} vs {want}");
    }
}

/// Fixed arithmetic work: its CPU time does not depend on how many cores the threads share.
fn busy(iters: u64) -> f64 {
    let mut x = 1.0f64;
    for i in 0..iters {
        x = (x * 1.000_000_1 + (i & 7) as f64).sqrt();
    }
    x
}

/// The CPUs this thread may run on (a container's set need not start at CPU 0).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: reads this thread's CPU mask into a zeroed, correctly sized set.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &allowed))
            .collect()
    }
}

/// Restricts this thread to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: sets this thread's CPU mask through a zeroed, correctly sized set.
    unsafe {
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        let size = std::mem::size_of::<libc::cpu_set_t>();
        assert_eq!(
            libc::sched_setaffinity(0, size, &one),
            0,
            "pinning to CPU {cpu} failed"
        );
    }
}

/// Each device's clock after an uneven 8-device exchange, and the wall time it took: the devices'
/// threads free on two CPUs, or all pinned to the first while a spinning thread keeps the second
/// busy — so that in both runs both CPUs compute (a core runs fixed work slower while its
/// neighbour computes: a shared turbo budget, or two vCPUs on one physical core) and only the
/// sharing of a core differs.
fn clocks(two: [usize; 2], pin_to_one_core: bool) -> (Vec<f64>, f64) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        if pin_to_one_core {
            s.spawn(|| {
                pin_to(two[1]);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::black_box(busy(100_000));
                }
            });
        }
        let start = std::time::Instant::now();
        let clocks = ThreadWorld::new(8)
            .run(|c| {
                if pin_to_one_core {
                    pin_to(two[0]);
                } else {
                    // SAFETY: as in `allowed_cpus`, with a set of the two CPUs.
                    unsafe {
                        let mut both: libc::cpu_set_t = std::mem::zeroed();
                        libc::CPU_SET(two[0], &mut both);
                        libc::CPU_SET(two[1], &mut both);
                        let size = std::mem::size_of::<libc::cpu_set_t>();
                        assert_eq!(libc::sched_setaffinity(0, size, &both), 0);
                    }
                }
                let g = Group::new("world", (0..8).collect());
                let mut acc = 0.0;
                for step in 0..4 {
                    // Uneven compute, so that the exchange makes devices wait for each other.
                    acc += busy(2_000_000 * (1 + ((c.rank() + step) % 3) as u64));
                    let mut buf = vec![acc as f32; 4096];
                    c.all_reduce(&g, &mut buf, ReduceOp::Sum).unwrap();
                }
                c.device_time()
            })
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let wall = start.elapsed().as_secs_f64();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (clocks, wall)
    })
}

/// The median time of `n` blocking runs and of `n` overlapped ones, run in turn, so that a VM whose
/// speed drifts slows both alike.
fn median_of_alternated_runs(n: usize, run: impl Fn(bool) -> f64) -> (f64, f64) {
    let (serial, overlapped): (Vec<f64>, Vec<f64>) =
        (0..n).map(|_| (run(false), run(true))).unzip();
    (median(serial), median(overlapped))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn compute_between_start_and_wait_hides_the_transfer() {
    let _cores = alone();
    // A slow link, so that the transfer (335 ms) is several times the noise of the compute it hides
    // behind (about 0.6 s, which moves by a few percent on shared cores).
    let slow = Link {
        bandwidth_bytes_per_s: 0.2e9,
        latency_s: 10e-6,
    };
    let world = ThreadWorld::new(2).link(LinkModel {
        intra: slow,
        inter: slow,
        devices_per_node: 2,
    });
    let run = |overlap: bool| {
        world
            .run(|c| {
                let g = Group::new("dp", vec![0, 1]);
                let grads = vec![1f32; 16 << 20]; // 64 MiB: 335 ms of transfer on the ring
                let t0 = c.device_time();
                if overlap {
                    let mut p = c.start_all_reduce(&g, grads, ReduceOp::Sum).unwrap();
                    for _ in 0..3 {
                        std::hint::black_box(busy(20_000_000));
                        c.test(&mut p).unwrap();
                    }
                    c.wait(p).unwrap();
                } else {
                    let mut g2 = grads;
                    c.all_reduce(&g, &mut g2, ReduceOp::Sum).unwrap();
                    for _ in 0..3 {
                        std::hint::black_box(busy(20_000_000));
                    }
                }
                c.device_time() - t0
            })
            .into_iter()
            .map(|r| r.unwrap())
            .fold(0.0, f64::max)
    };
    // The median of three runs of each, against a margin of 0.2 s of the 0.335 s the overlap can save.
    let (serial, overlapped) = median_of_alternated_runs(3, run);
    println!("device time: blocking {serial:.4} s, overlapped {overlapped:.4} s");
    assert!(
        overlapped < serial - 0.2,
        "overlap saved too little: {overlapped} vs {serial}"
    );
}

/// The slowest device's time (median of alternated runs) for `op` over a 4-device group on a
/// simulated 1 GB/s link, blocking then computing (`false`) and started before the same compute
/// and waited for after it, without polling (`true`): (blocking, started).
fn blocking_and_started_on_4_devices(
    op: impl Fn(&mut ThreadComm, &Group, bool) + Sync,
) -> (f64, f64) {
    let gbs = Link {
        bandwidth_bytes_per_s: 1e9,
        latency_s: 10e-6,
    };
    let world = ThreadWorld::new(4).link(LinkModel {
        intra: gbs,
        inter: gbs,
        devices_per_node: 4,
    });
    let run = |started: bool| {
        world
            .run(|c| {
                let g = Group::new("dp", vec![0, 1, 2, 3]);
                let t0 = c.device_time();
                op(c, &g, started);
                c.device_time() - t0
            })
            .into_iter()
            .map(|r| r.unwrap())
            .fold(0.0, f64::max)
    };
    let (serial, overlapped) = median_of_alternated_runs(3, run);
    println!("device time: blocking {serial:.4} s, started before compute {overlapped:.4} s");
    (serial, overlapped)
}

/// ZeRO-3's prefetch starts a unit's all-gather and computes the current unit without polling: the
/// gather must finish during that compute for any group size, not only the first of its n − 1 ring
/// steps (which is all a ring can do without being polled).
#[test]
fn a_started_all_gather_completes_during_compute_without_polling() {
    let _cores = alone();
    let (serial, overlapped) = blocking_and_started_on_4_devices(|c, g, started| {
        // 32 MiB per rank: each sends 3 × 32 MiB, 101 ms on the link; a ring hides a third.
        let mine = vec![c.rank() as f32; 8 << 20];
        let all = if started {
            let p = c.start_all_gather(g, &mine).unwrap();
            std::hint::black_box(busy(20_000_000));
            c.wait(p).unwrap()
        } else {
            let mut all = vec![0f32; 32 << 20];
            c.all_gather(g, &mine, &mut all).unwrap();
            std::hint::black_box(busy(20_000_000));
            all
        };
        assert!((0..4).all(|r| all[r * (8 << 20)] == r as f32));
    });
    assert!(
        overlapped < serial - 0.07,
        "the gather was not hidden: {overlapped} vs {serial}"
    );
}

/// Data parallelism starts a bucket's ring all-reduce and computes the next layer's backward
/// without polling it: the ring must move on its own (each step leaving when the previous one's
/// chunk is in, as a device's communication engine would move it), not one step per poll.
#[test]
fn a_started_ring_all_reduce_completes_during_compute_without_polling() {
    let _cores = alone();
    let (serial, overlapped) = blocking_and_started_on_4_devices(|c, g, started| {
        // 32 MiB: each rank sends 2 × 3/4 of it in six ring steps, 50 ms on the link.
        let grads = vec![c.rank() as f32; 8 << 20];
        let sum = if started {
            let p = c.start_all_reduce(g, grads, ReduceOp::Sum).unwrap();
            std::hint::black_box(busy(20_000_000));
            c.wait(p).unwrap()
        } else {
            let mut sum = grads;
            c.all_reduce(g, &mut sum, ReduceOp::Sum).unwrap();
            std::hint::black_box(busy(20_000_000));
            sum
        };
        assert!(sum.iter().all(|&x| x == 6.0));
    });
    assert!(
        overlapped < serial - 0.035,
        "the all-reduce was not hidden: {overlapped} vs {serial}"
    );
}

/// A device's clock counts its thread's CPU time, never time spent waiting for a core: eight
/// devices on one core keep the clocks they have on two, while the wall time doubles.
#[test]
fn device_time_does_not_depend_on_oversubscription() {
    let _cores = alone();
    let cpus = allowed_cpus();
    assert!(
        cpus.len() >= 2,
        "this test needs two CPUs to compare one core with two; it may use {cpus:?}"
    );
    let two = [cpus[0], cpus[1]];
    // Free and pinned runs alternate, so that each pair sees the VM in the same state, and each
    // figure is the median over five pairs (one run in several moves by more than the bound).
    let pairs: Vec<_> = (0..5)
        .map(|_| (clocks(two, false), clocks(two, true)))
        .collect();
    let wall_ratio = median(
        pairs
            .iter()
            .map(|(free, pinned)| pinned.1 / free.1)
            .collect(),
    );
    println!("wall time on one core / on two: {wall_ratio:.2}");
    assert!(
        wall_ratio > 1.5,
        "pinning to one core did not slow the wall clock ({wall_ratio:.2}×): it measured nothing"
    );
    for r in 0..pairs[0].0 .0.len() {
        let diff = median(
            pairs
                .iter()
                .map(|(free, pinned)| (free.0[r] - pinned.0[r]).abs() / free.0[r])
                .collect(),
        );
        let (a, b) = (pairs[2].0 .0[r], pairs[2].1 .0[r]);
        println!("rank {r}: median difference {:.2}%", 100.0 * diff);
        assert!(
            diff < 0.05,
            "rank {r}: median difference {:.1}% (e.g. {a} s with free cores, {b} s on one core)",
            100.0 * diff
        );
    }
}

#[test]
fn a_peer_that_never_arrives_times_out_naming_it() {
    let _cores = shared();
    let results = ThreadWorld::new(2)
        .timeout(Duration::from_millis(300))
        .run(|c| {
            let g = Group::new("tp", vec![0, 1]);
            if c.rank() == 0 {
                let mut buf = vec![0f32; 8];
                c.all_reduce(&g, &mut buf, ReduceOp::Sum).map(|_| ())
            } else {
                std::thread::sleep(Duration::from_millis(800)); // alive, but never joins
                Ok(())
            }
        });
    let e = results[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("all_reduce")
            && e.contains("tp[0,1]")
            && e.contains("rank 0")
            && e.contains("rank 1"),
        "{e}"
    );
}

#[test]
fn a_peer_that_exits_is_reported_not_waited_for() {
    let _cores = shared();
    let results = ThreadWorld::new(2).run(|c| {
        let g = Group::new("dp", vec![0, 1]);
        if c.rank() == 0 {
            let mut buf = vec![0f32; 8];
            c.all_reduce(&g, &mut buf, ReduceOp::Sum).map(|_| ())
        } else {
            Ok(()) // returns at once: its endpoint closes
        }
    });
    let e = results[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(e.contains("lost rank 1"), "{e}");
}

#[test]
fn mismatched_lengths_and_foreign_ranks_are_clear_errors() {
    let _cores = shared();
    let results = ThreadWorld::new(2)
        .timeout(Duration::from_secs(5))
        .run(|c| {
            let g = Group::new("tp", vec![0, 1]);
            let mut buf = vec![0f32; 10 + c.rank() * 2];
            c.all_reduce(&g, &mut buf, ReduceOp::Sum).map(|_| ())
        });
    let errs: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.unwrap().err().map(|e| e.to_string()))
        .collect();
    assert!(
        errs.iter()
            .any(|e| e.contains("10 elements") && e.contains("12 elements")),
        "{errs:?}"
    );
    let results = ThreadWorld::new(2).run(|c| {
        let g = Group::new("tp", vec![1]);
        let mut buf = vec![0f32; 4];
        if c.rank() == 0 {
            c.all_reduce(&g, &mut buf, ReduceOp::Sum).map(|_| ())
        } else {
            Ok(())
        }
    });
    let e = results[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0 is not a member of group tp[1]"), "{e}");
    let e = ThreadWorld::new(2).run(|c| c.send(5, &[1f32], 0).map(|_| ()))[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 5 is outside the world of 2"), "{e}");
}

#[test]
fn point_to_point_receives_match_by_tag() {
    let _cores = shared();
    let results = ThreadWorld::new(2)
        .timeout(Duration::from_secs(5))
        .run(|c| {
            if c.rank() == 0 {
                for tag in [1u64, 2, 3] {
                    c.send(1, &[tag as f32; 4], tag).unwrap();
                }
                Vec::new()
            } else {
                let mut got = Vec::new();
                for tag in [3u64, 1, 2] {
                    let mut buf = [0f32; 4];
                    c.recv(0, &mut buf, tag).unwrap();
                    got.push(buf[0]);
                }
                got
            }
        });
    assert_eq!(results[1].as_ref().unwrap(), &vec![3.0, 1.0, 2.0]);
}

//! Checks any [`Comm`] backend against a naive reference, from inside each rank: every operation on
//! every group of a mesh, over awkward sizes and several element types, plus the textbook byte counts.
//! The threads backend's tests and the MPI self-test binary run the same code.

use super::{Comm, CommError, DeviceMesh, Dim, Element, Group, ReduceOp};

/// Small integers, so every sum is exact in every dtype and any summation order.
pub fn input<T: Element>(rank: usize, len: usize, salt: usize, conv: impl Fn(i32) -> T) -> Vec<T> {
    (0..len)
        .map(|i| conv((((rank * 31 + i * 7 + salt * 13) % 17) as i32) - 8))
        .collect()
}

fn fail(what: String) -> CommError {
    CommError::Usage(format!("self-test failed: {what}"))
}

fn expect_eq<T: PartialEq + std::fmt::Debug>(
    got: &[T],
    want: &[T],
    what: &str,
) -> Result<(), CommError> {
    if got == want {
        Ok(())
    } else {
        Err(fail(format!(
            "{what}: got {:?}…, want {:?}…",
            &got[..got.len().min(4)],
            &want[..want.len().min(4)]
        )))
    }
}

/// Every operation on every group of `mesh` (and the world) for one element type.
pub fn check_all_ops<C: Comm, T: Element>(
    c: &mut C,
    mesh: &DeviceMesh,
    conv: impl Fn(i32) -> T + Copy,
) -> Result<(), CommError> {
    let mut groups: Vec<Group> = Dim::ALL.iter().flat_map(|d| mesh.groups(*d)).collect();
    groups.push(mesh.world());
    let me = c.rank();
    let world = c.world_size();
    for len in [0usize, 1, 2, 7, 13, 64, 101] {
        for (gi, g) in groups.iter().enumerate() {
            if !g.ranks.contains(&me) {
                continue;
            }
            let n = g.size();
            let idx = g.index_of(me)?;
            let all: Vec<Vec<T>> = g.ranks.iter().map(|&r| input(r, len, gi, conv)).collect();
            let sum: Vec<T> = (0..len)
                .map(|i| all.iter().skip(1).fold(all[0][i], |a, v| a.add(v[i])))
                .collect();
            let what = |op: &str| format!("{op} on {} with {len} {}", g.name, T::NAME);
            let mut buf = input(me, len, gi, conv);
            c.all_reduce(g, &mut buf, ReduceOp::Sum)?;
            expect_eq(&buf, &sum, &what("all_reduce"))?;
            let mut buf = input(me, len, gi, conv);
            c.all_reduce(g, &mut buf, ReduceOp::Mean)?;
            expect_eq(
                &buf,
                &sum.iter().map(|x| x.div(n)).collect::<Vec<_>>(),
                &what("all_reduce mean"),
            )?;
            let big: Vec<Vec<T>> = g
                .ranks
                .iter()
                .map(|&r| input(r, n * len, gi + 1, conv))
                .collect();
            let mut out = vec![T::default(); len];
            c.reduce_scatter(g, &big[idx], &mut out, ReduceOp::Sum)?;
            let want: Vec<T> = (idx * len..(idx + 1) * len)
                .map(|i| big.iter().skip(1).fold(big[0][i], |a, v| a.add(v[i])))
                .collect();
            expect_eq(&out, &want, &what("reduce_scatter"))?;
            let mut out = vec![T::default(); n * len];
            c.all_gather(g, &all[idx], &mut out)?;
            expect_eq(&out, &all.concat(), &what("all_gather"))?;
            let counts: Vec<usize> = (0..n).map(|k| (len + k * 3) % 11).collect();
            let mine = input(me, counts[idx], gi + 2, conv);
            let mut out = vec![T::default(); counts.iter().sum()];
            c.all_gather_uneven(g, &mine, &counts, &mut out)?;
            let want: Vec<T> = g
                .ranks
                .iter()
                .zip(&counts)
                .flat_map(|(&r, &k)| input(r, k, gi + 2, conv))
                .collect();
            expect_eq(&out, &want, &what("all_gather_uneven"))?;
            // The asynchronous variants give the same results.
            let mut p = c.start_all_reduce(g, input(me, len, gi, conv), ReduceOp::Sum)?;
            c.test(&mut p)?;
            expect_eq(&c.wait(p)?, &sum, &what("start_all_reduce"))?;
            let p = c.start_all_reduce(g, input(me, len, gi, conv), ReduceOp::Mean)?;
            expect_eq(
                &c.wait(p)?,
                &sum.iter().map(|x| x.div(n)).collect::<Vec<_>>(),
                &what("start_all_reduce mean"),
            )?;
            let p = c.start_reduce_scatter(g, big[idx].clone(), ReduceOp::Sum)?;
            let want: Vec<T> = (idx * len..(idx + 1) * len)
                .map(|i| big.iter().skip(1).fold(big[0][i], |a, v| a.add(v[i])))
                .collect();
            expect_eq(&c.wait(p)?, &want, &what("start_reduce_scatter"))?;
            let mut p = c.start_all_gather(g, &all[idx])?;
            while !c.test(&mut p)? {}
            expect_eq(&c.wait(p)?, &all.concat(), &what("start_all_gather"))?;
            let mut buf = input(me, len, gi + 3, conv);
            c.broadcast(g, &mut buf, n - 1)?;
            expect_eq(
                &buf,
                &input(g.ranks[n - 1], len, gi + 3, conv),
                &what("broadcast"),
            )?;
            c.barrier(g)?;
        }
        let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
        c.send(next, &input(me, len, 99, conv), 5)?;
        let mut buf = vec![T::default(); len];
        c.recv(prev, &mut buf, 5)?;
        expect_eq(&buf, &input(prev, len, 99, conv), "send/recv")?;
        // Receives match by tag, whatever order the messages were sent in.
        c.send(next, &input(me, len, 7, conv), 11)?;
        c.send(next, &input(me, len, 8, conv), 12)?;
        let (mut a, mut b) = (vec![T::default(); len], vec![T::default(); len]);
        c.recv(prev, &mut b, 12)?;
        c.recv(prev, &mut a, 11)?;
        expect_eq(
            &a,
            &input(prev, len, 7, conv),
            "recv by tag (first sent, second received)",
        )?;
        expect_eq(
            &b,
            &input(prev, len, 8, conv),
            "recv by tag (second sent, first received)",
        )?;
    }
    Ok(())
}

/// The ring's bytes per device: 2(n−1)/n·S for all-reduce, (n−1)/n·S for all-gather and
/// reduce-scatter, exactly (S divisible by n).
pub fn check_textbook_bytes<C: Comm>(c: &mut C) -> Result<(), CommError> {
    let n = c.world_size();
    let g = Group::new("dp", (0..n).collect());
    let elems = 840 * 16; // divisible by 1..=8
    let s = (elems * 4) as u64;
    let before = c.stats().clone();
    let mut buf = vec![1f32; elems];
    c.all_reduce(&g, &mut buf, ReduceOp::Sum)?;
    let mut out = vec![0f32; elems];
    c.all_gather(&g, &buf[..elems / n], &mut out)?;
    let mut shard = vec![0f32; elems / n];
    c.reduce_scatter(&g, &out, &mut shard, ReduceOp::Sum)?;
    let ring = (n as u64 - 1) * s / n as u64;
    let delta = |k: &str| {
        c.stats().by_op.get(k).map_or(0, |s| s.bytes_sent)
            - before.by_op.get(k).map_or(0, |s| s.bytes_sent)
    };
    for (k, want) in [
        ("dp/all_reduce", 2 * ring),
        ("dp/all_gather", ring),
        ("dp/reduce_scatter", ring),
    ] {
        if delta(k) != want {
            return Err(fail(format!(
                "{k} sent {} bytes, the ring textbook says {want}",
                delta(k)
            )));
        }
    }
    Ok(())
}

/// Collectives a benchmark table covers.
pub const BENCH_OPS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];

/// Median wall seconds of `op` on `elems` f32 over the whole world (every rank calls it; the slowest
/// rank's figure is the one to report).
pub fn bench_op<C: Comm>(c: &mut C, op: &str, elems: usize, reps: usize) -> Result<f64, CommError> {
    let n = c.world_size();
    let g = Group::new("world", (0..n).collect());
    let mut full = vec![1f32; elems];
    let mut shard = vec![1f32; elems / n];
    let (full_in, shard_in) = (full.clone(), shard.clone());
    let mut t = Vec::with_capacity(reps + 1);
    for _ in 0..=reps {
        c.barrier(&g)?;
        let t0 = std::time::Instant::now();
        match op {
            "all_reduce" => c.all_reduce(&g, &mut full, ReduceOp::Sum)?,
            "all_gather" => c.all_gather(&g, &shard_in, &mut full)?,
            "reduce_scatter" => c.reduce_scatter(&g, &full_in, &mut shard, ReduceOp::Sum)?,
            _ => c.broadcast(&g, &mut full, 0)?,
        }
        c.barrier(&g)?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.remove(0); // warm-up
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

/// The fastest any 2-rank all-reduce of `elems` f32 can be on this machine, as a bus bandwidth (bytes/s):
/// each rank, on its own thread, does only the memory work the result needs — add the peer's half
/// into its own (read two, write one) and copy the peer's reduced half (read one, write one) — with
/// no messages, locks or waiting at all. Best of `reps`.
pub fn all_reduce_memory_ceiling(elems: usize, reps: usize) -> f64 {
    let half = elems / 2;
    let mut bufs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..2)
        .map(|_| (vec![1f32; half], vec![2f32; half], vec![0f32; half]))
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = std::time::Instant::now();
        std::thread::scope(|s| {
            for (own, peer, other_half) in bufs.iter_mut() {
                s.spawn(move || {
                    own.iter_mut().zip(peer.iter()).for_each(|(a, &b)| *a += b);
                    other_half.copy_from_slice(peer);
                    std::hint::black_box((&own, &other_half));
                });
            }
        });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    // Bus bandwidth of a 2-rank all-reduce is S/t (2(n−1)/n = 1).
    (elems * 4) as f64 / best
}

/// nccl-tests conventions: algorithm bandwidth S/t; bus bandwidth scales it by the share of the data
/// each device must send (2(n−1)/n all-reduce, (n−1)/n all-gather and reduce-scatter, 1 broadcast).
pub fn bench_row(backend: &str, op: &str, n: usize, elems: usize, seconds: f64) -> String {
    let s = (elems * 4) as f64;
    let factor = match op {
        "all_reduce" => 2.0 * (n - 1) as f64 / n as f64,
        "broadcast" => 1.0,
        _ => (n - 1) as f64 / n as f64,
    };
    let bytes = elems * 4;
    let size = if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    };
    format!(
        "| {backend} | {op} | {n} | {size} | {:.3} | {:.2} | {:.2} |",
        seconds * 1e3,
        s / seconds / 1e9,
        s / seconds / 1e9 * factor
    )
}

pub const BENCH_HEADER: &str = "| backend | op | devices | size | time (ms) | algbw (GB/s) | busbw (GB/s) |\n|---|---|---|---|---|---|---|";

/// Message sizes from 1 KiB to `max_mib` MiB in factors of 4, in elements divisible by `n`.
pub fn bench_sizes(max_mib: usize, n: usize) -> Vec<usize> {
    let mut sizes = vec![1usize << 10];
    while *sizes.last().expect("non-empty") < max_mib << 20 {
        let next = sizes.last().expect("non-empty") * 4;
        sizes.push(next.min(max_mib << 20));
    }
    sizes
        .into_iter()
        .map(|b| ((b / 4).max(n) / n) * n)
        .collect()
}

//! Run under mpirun: `mpirun -np 4 target/release/ferrotron-mpi-selftest check` checks every operation
//! of the MPI backend against the naive reference and the textbook byte counts. `die R` makes rank R
//! exit mid-job, `stall R [TIMEOUT_S]` makes rank R never join: the others must end non-zero, naming the rank.

use ferrotron_engine::comm::selftest::{
    bench_op, bench_row, bench_sizes, check_all_ops, check_textbook_bytes, BENCH_HEADER, BENCH_OPS,
};
use ferrotron_engine::comm::{Comm, DeviceMesh, Group, MpiComm, ReduceOp};
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("check");
    let victim: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let timeout_s: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10);
    let mut c = MpiComm::init(Some(Duration::from_secs(timeout_s))).expect("MPI initialises");
    let n = c.world_size();
    let world = Group::new("world", (0..n).collect());
    let result = match mode {
        "check" => {
            let grid = ferrotron_core::rank::RankGrid::new(2, 1, n / 2, 1, n).expect("a world");
            let mesh = DeviceMesh::new(grid, n).expect("an even world");
            check_all_ops(&mut c, &mesh, |x| x as f32)
                .and_then(|_| check_all_ops(&mut c, &mesh, |x| half::bf16::from_f32(x as f32)))
                .and_then(|_| check_all_ops(&mut c, &mesh, |x| x as i64))
                .and_then(|_| check_textbook_bytes(&mut c))
        }
        "die" => {
            if c.rank() == victim {
                eprintln!("rank {victim}: exiting abruptly, as if the host died");
                std::process::exit(3);
            }
            let mut buf = vec![1f32; 1024];
            (0..100).try_for_each(|_| c.all_reduce(&world, &mut buf, ReduceOp::Sum))
        }
        "bench" => {
            // `bench MAX_MIB`: the same table as `ferrotron bench comm`, for this backend.
            if c.rank() == 0 {
                println!("{BENCH_HEADER}");
            }
            bench_sizes(victim.max(1), n)
                .into_iter()
                .try_for_each(|elems| {
                    BENCH_OPS.iter().try_for_each(|op| {
                        let t = bench_op(&mut c, op, elems, 3)?;
                        let mut all = vec![0f64; n];
                        c.all_gather(&world, &[t], &mut all)?;
                        if c.rank() == 0 {
                            println!(
                                "{}",
                                bench_row("mpi", op, n, elems, all.into_iter().fold(0.0, f64::max))
                            );
                        }
                        Ok(())
                    })
                })
        }
        "native" => {
            // The same all-reduce through OpenMPI's own MPI_Allreduce, for reference.
            use mpi::collective::SystemOperation;
            use mpi::traits::CommunicatorCollectives;
            let elems = (victim.max(1) << 20) / 4;
            let send = vec![1f32; elems];
            let mut recv = vec![0f32; elems];
            let world_comm = mpi::topology::SimpleCommunicator::world();
            let mut t = Vec::new();
            for _ in 0..4 {
                world_comm.barrier();
                let t0 = std::time::Instant::now();
                world_comm.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
                world_comm.barrier();
                t.push(t0.elapsed().as_secs_f64());
            }
            t.remove(0);
            t.sort_by(|a, b| a.total_cmp(b));
            if c.rank() == 0 {
                println!(
                    "{}",
                    bench_row(
                        "mpi native MPI_Allreduce",
                        "all_reduce",
                        n,
                        elems,
                        t[t.len() / 2]
                    )
                );
            }
            Ok(())
        }
        "stall" => {
            if c.rank() == victim {
                std::thread::sleep(Duration::from_secs(120));
                Ok(())
            } else {
                let mut buf = vec![1f32; 1024];
                c.all_reduce(&world, &mut buf, ReduceOp::Sum)
            }
        }
        other => {
            eprintln!("unknown mode {other} (check, die R, stall R)");
            std::process::exit(2)
        }
    };
    match result {
        Ok(()) => {
            if c.rank() == 0 {
                println!("mpi self-test `{mode}` passed on {n} ranks\n{}", c.stats());
            }
        }
        Err(e) => c.abort(&format!("error: {e}"), 1),
    }
}

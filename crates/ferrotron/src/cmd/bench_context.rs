//! `bench context`: context-parallel attention (forward and backward) over cp devices of the
//! threads backend on a simulated link, in device time: how much of the ring's K/V transfer time
//! shows (the rest hides behind the block products), and how evenly the causal split shares the
//! attention compute among the devices. A receive's wait is split as the device clock splits it:
//! the transfer's own duration that the device spent idle (exposed), and waiting for a peer that
//! computed longer (not the link's doing).

use anyhow::Result;
use ferrotron_core::layout::CpComm;
use ferrotron_core::topology::Link;
use ferrotron_engine::comm::{Comm, Group, LinkModel, ThreadWorld};
use ferrotron_engine::kernels::{AttnGradInputs, AttnShape, CpuBackend, Qkv, QkvGrads};
use ferrotron_engine::parallel::context::{self, ContextShard};
use rand::{Rng, SeedableRng};

/// What one device measured.
struct Device {
    compute_s: f64,
    transfer_s: f64,
    exposed_s: f64,
    bytes: u64,
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
}

/// One forward and backward of `s` (the whole sequences' shape) split over `cp` devices.
fn measure(s: AttnShape, cp: usize, comm: CpComm, link_gb_s: f64) -> Result<Vec<Device>> {
    let link = Link {
        bandwidth_bytes_per_s: link_gb_s * 1e9,
        latency_s: 5e-6,
    };
    let links = LinkModel {
        intra: link,
        inter: link,
        devices_per_node: cp,
    };
    let local = AttnShape {
        seq: s.seq / cp,
        ..s
    };
    let results = ThreadWorld::new(cp).link(links).run(|c| {
        let cx = ContextShard {
            size: cp,
            index: c.rank(),
            comm,
        };
        let g = Group::new("cp", (0..cp).collect());
        let be = CpuBackend::with_threads(1);
        let rows = local.batch * local.seq;
        let seed = c.rank() as u64 * 4;
        let [q, k, v, dout] = [s.q_width(), s.kv_width(), s.kv_width(), s.q_width()]
            .map(|w| random(rows * w, seed + w as u64));
        let (mut out, mut lse) = (vec![0f32; q.len()], vec![0f32; local.lse_len()]);
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; q.len()],
            vec![0f32; k.len()],
            vec![0f32; v.len()],
        );
        let x = Qkv::new(&q, &k, &v);
        context::forward(c, &g, &cx, &be, local, x, &mut out, &mut lse)?;
        let inputs = AttnGradInputs::new(&dout, x, &out, &lse);
        let grads = QkvGrads::new(&mut dq, &mut dk, &mut dv);
        context::backward(c, &g, &cx, &be, local, inputs, grads)?;
        let st = c.stats();
        let (send, recv) = (
            st.by_op.get("cp/send").copied().unwrap_or_default(),
            st.by_op.get("cp/recv").copied().unwrap_or_default(),
        );
        Ok::<_, ferrotron_engine::comm::CommError>(Device {
            compute_s: st.compute_time_s,
            transfer_s: send.bytes_sent as f64 / (link_gb_s * 1e9),
            exposed_s: recv.time_transfer_s + send.time_transfer_s,
            bytes: send.bytes_sent,
        })
    });
    results
        .into_iter()
        .map(|r| Ok(r.map_err(anyhow::Error::from)??))
        .collect()
}

pub struct ContextBench {
    pub shape: AttnShape,
    pub cp: usize,
    pub comm: CpComm,
    pub link_gb_s: f64,
}

pub fn run(b: ContextBench) -> Result<()> {
    let s = b.shape;
    crate::machine::attention_bench::check_shape(&s)?;
    anyhow::ensure!(
        b.link_gb_s.is_finite() && b.link_gb_s > 0.0,
        "--link-gb-s {}: the link's bandwidth must be a positive number of GB/s",
        b.link_gb_s
    );
    let cx = ContextShard {
        size: b.cp,
        index: 0,
        comm: b.comm,
    };
    cx.check(s.seq).map_err(anyhow::Error::msg)?;
    cx.check_heads(s.heads, s.kv_heads)
        .map_err(anyhow::Error::msg)?;
    let devices = measure(s, b.cp, b.comm, b.link_gb_s)?;
    println!(
        "ferrotron bench context: cp={} ({}), causal attention forward + backward, batch {} x seq {}, {} heads ({} kv), head dim {}, one thread per device, {} GB/s link (device time)",
        b.cp, b.comm.name(), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, b.link_gb_s
    );
    println!("| device | attention compute (s) | bytes sent | transfer time at the link (s) | exposed transfer (s) | exposed / transfer |\n|---|---|---|---|---|---|");
    for (i, d) in devices.iter().enumerate() {
        println!(
            "| {i} | {:.3} | {} | {:.3} | {:.3} | {:.1}% |",
            d.compute_s,
            d.bytes,
            d.transfer_s,
            d.exposed_s,
            100.0 * d.exposed_s / d.transfer_s.max(1e-12)
        );
    }
    let compute: Vec<f64> = devices.iter().map(|d| d.compute_s).collect();
    let (lo, hi) = compute
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    let exposed: f64 = devices.iter().map(|d| d.exposed_s).sum();
    let transfer: f64 = devices.iter().map(|d| d.transfer_s).sum();
    println!(
        "compute spread (max/min − 1): {:.1}%; exposed transfer over all devices: {:.1}% of the transfer time",
        100.0 * (hi / lo - 1.0),
        100.0 * exposed / transfer.max(1e-12)
    );
    Ok(())
}

//! `bench zero3`: what ZeRO-3's parameter gathers cost a step on a slow link, without and with the
//! prefetch that overlaps each gather with the previous unit's compute. Device time on the threads
//! backend (each device's clock: its CPU time, plus modelled transfers on the simulated link).

use anyhow::Result;
use ferrotron_core::layout::Layout;
use ferrotron_core::schedule::StagePartition;
use ferrotron_core::topology::Link;
use ferrotron_engine::comm::{LinkModel, ThreadWorld};
use ferrotron_engine::parallel::MeshStep;
use ferrotron_engine::runtime::engine_preset;
use ferrotron_engine::transformer::{ParamStore, TokenBatch};
use std::time::Duration;

/// One measured step: the worst device's exposed gather time and step time (device seconds).
struct Measured {
    exposed_gather_s: f64,
    step_s: f64,
    gather_bytes: u64,
}

fn measure(
    model: &ferrotron_core::model::ModelConfig,
    params: &ParamStore,
    batch: &TokenBatch,
    layout: &Layout,
    link: LinkModel,
    prefetch: bool,
) -> Result<Measured> {
    let partition = StagePartition::for_model(model, 1)?;
    let results = ThreadWorld::new(layout.world_size())
        .timeout(Duration::from_secs(120))
        .link(link)
        .run(|c| {
            MeshStep::new(model, params, batch, layout, &partition)?
                .with_zero3_prefetch(prefetch)
                .run_device(c, 1)
        });
    let mut out = Measured {
        exposed_gather_s: 0.0,
        step_s: 0.0,
        gather_bytes: 0,
    };
    for r in results {
        let r = r??;
        let g = r
            .stats
            .by_op
            .get("dp/all_gather")
            .copied()
            .unwrap_or_default();
        let start = r.timeline.first().map_or(0.0, |a| a.1);
        out.exposed_gather_s = out
            .exposed_gather_s
            .max(g.time_blocked_s + g.time_transfer_s);
        out.step_s = out.step_s.max(r.end - start);
        out.gather_bytes = out.gather_bytes.max(g.bytes_sent);
    }
    Ok(out)
}

pub fn run(model: &str, dps: &[usize], link_gb_s: f64, batch: usize, seq: usize) -> Result<()> {
    anyhow::ensure!(
        link_gb_s.is_finite() && link_gb_s > 0.0,
        "--link-gb-s {link_gb_s}: the link's bandwidth must be a positive number of GB/s"
    );
    let cfg = engine_preset(model)?;
    let params = ParamStore::init_random(&cfg, 0);
    let tokens = TokenBatch {
        ids: (0..batch * seq)
            .map(|i| (i * 7919 % cfg.vocab_size) as u32)
            .collect(),
        batch,
        seq,
    };
    let link = Link {
        bandwidth_bytes_per_s: link_gb_s * 1e9,
        latency_s: 5e-6,
    };
    println!(
        "ferrotron bench zero3: {model}, batch {batch} × seq {seq}, one forward+backward on a \
         {link_gb_s} GB/s link (device time; worst device)"
    );
    println!("| layout | prefetch | gather bytes sent/device | exposed gather (ms) | step (ms) |");
    println!("|---|---|---|---|---|");
    for &dp in dps {
        let layout = Layout {
            dp,
            zero: 3,
            micro_batch_size: batch / dp,
            ..Layout::default()
        };
        let links = LinkModel {
            intra: link,
            inter: link,
            devices_per_node: dp,
        };
        for prefetch in [false, true] {
            let m = measure(&cfg, &params, &tokens, &layout, links, prefetch)?;
            println!(
                "| dp={dp},zero=3 | {} | {:.2} MB | {:.2} | {:.2} |",
                if prefetch { "on" } else { "off" },
                m.gather_bytes as f64 / 1e6,
                m.exposed_gather_s * 1e3,
                m.step_s * 1e3
            );
        }
    }
    Ok(())
}

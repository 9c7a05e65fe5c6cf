#!/usr/bin/env python3
"""Tensor and pipeline parallelism over a real, shaped link, on real processes, beside the planner's
prediction for a cluster file that describes those links.

Two network-namespace hosts (scripts/multihost.sh), OpenMPI over TCP, llama-small, two ranks:
  within  both ranks on h1 (TCP over the host's own loopback)
  across  one rank on h1, one on h2, h2's link shaped with tc tbf to RATE (default 1gbit)
It measures each link with the MPI backend's all-reduce bench (`ferrotron-mpi-selftest bench`,
the table of `ferrotron bench comm`), then prices the same layouts with `plan` on
`--cluster CALIBRATION,intra_gbs=…,inter_gbs=…,…`: this machine's `calibrate --this-machine`, the
links as measured, nothing fitted to the training runs. Prints markdown tables. Needs root and a
build with `--features mpi`.

    scripts/real_links.py [RATE]
"""
import atexit
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "multihost.sh")
EXE = os.path.join(ROOT, "target", "release", "ferrotron")
SELFTEST = os.path.join(ROOT, "target", "release", "ferrotron-mpi-selftest")
SEQ, BATCH, STEPS = 128, 8, 10
RATE = sys.argv[1] if len(sys.argv) > 1 else "1gbit"
OUT = tempfile.mkdtemp(prefix="ferrotron-real-links.")
# The trainings' checkpoints and models are not needed once their metrics are read.
atexit.register(shutil.rmtree, OUT, ignore_errors=True)


def run(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def mpirun(placement, *args):
    return run(HOSTS, "mpirun", "-np", "2", "--host", placement, "--map-by", "slot", *args)


def size_bytes(label):
    n, unit = label.split()
    return int(n) << (20 if unit == "MiB" else 10)


def bench(placement):
    """{size label: (time µs, bus GB/s)} of the all-reduce rows (bus bandwidth from the time: the
    table's two decimals are too coarse for a slow link; for 2 ranks it is bytes / time)."""
    rows = {}
    for line in mpirun(placement, SELFTEST, "bench", "16").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and cells[1] == "all_reduce":
            t = float(cells[4]) * 1e-3
            rows[cells[3]] = (t * 1e6, size_bytes(cells[3]) / t / 1e9)
    return rows


def fit_link(rows):
    """The planner's price of a 2-rank ring all-reduce is 2 latencies + bytes / bandwidth: fitted by
    least squares on relative error to the bench's sizes around the run's messages (16 KiB–1 MiB;
    a tensor-parallel all-reduce or a stage's activation here is 1 × 128 × 256 f32 = 128 KiB), as
    one calibrates a link for the messages it will carry. Returns (GB/s, µs a ring step)."""
    xs = [(size_bytes(k), t * 1e-6) for k, (t, _) in rows.items() if 16 << 10 <= size_bytes(k) <= 1 << 20]
    # minimise sum ((a + b·S − t) / t)²: linear in (a, b)
    saa = sum(1 / t**2 for s, t in xs)
    sab = sum(s / t**2 for s, t in xs)
    sbb = sum(s * s / t**2 for s, t in xs)
    sa = sum(1 / t for s, t in xs)
    sb = sum(s / t for s, t in xs)
    det = saa * sbb - sab * sab
    a = (sa * sbb - sb * sab) / det
    b = (saa * sb - sab * sa) / det
    return 1 / b / 1e9, max(a, 0.0) / 2 * 1e6


def train(name, placement, layout):
    """Rank 0's median wall-clock step after the first two, and the layout as resolved."""
    out = os.path.join(OUT, name)
    mpirun(placement, EXE, "train", "--backend", "mpi", "--model", "llama-small", "--layout", layout,
           "--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
           "--eval-every", "0", "--out-dir", out)
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return statistics.median(r["devices"][0]["wall_step_time_s"] for r in rows[2:]), rows[-1]["layout"]


def plan(layout, nodes, per_node, cluster, *flags):
    out = run(EXE, "plan", "--model", "llama-small", "--seq", str(SEQ), "--global-batch", str(BATCH),
              "--layout", layout, "--precision", "weights=fp32,grads=fp32,optimizer=fp32",
              "--cluster", f"{cluster},nodes={nodes},devices_per_node={per_node}", "--json", *flags)
    return json.loads(out)["step_time_s"]


def main():
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    run(HOSTS, "up", "2")
    try:
        print(f"CPU: {cpu}, {os.cpu_count()} cores; h2's link shaped to {RATE} (tc tbf)\n")
        within, across = bench("h1:2"), bench("h1:1,h2:1")
        run(HOSTS, "shape", "h2", RATE)
        shaped = bench("h1:1,h2:1")
        print("### `bench comm` under MPI: all-reduce, 2 ranks\n")
        print("| size | within h1: µs, bus GB/s | h1 ↔ h2: µs, bus GB/s | h1 ↔ h2 shaped: µs, bus GB/s |")
        print("|---|---|---|---|")
        f = lambda r, s: f"{r[s][0]:.0f}, {r[s][1]:.3f}" if s in r else "-"
        for s in within:
            print(f"| {s} | {f(within, s)} | {f(across, s)} | {f(shaped, s)} |")

        # The links as the planner takes them, fitted to the bench (link efficiency 1: the figures
        # are what the transport achieves).
        (ib, il), (sb, sl) = fit_link(within), fit_link(shaped)
        links = (f"intra_gbs={ib:.4f},intra_latency_us={il:.1f},"
                 f"inter_gbs={sb:.4f},inter_latency_us={sl:.1f},link_efficiency=1")
        cal = os.path.join(OUT, "this-machine.toml")
        # (its per-CPU cache kept out of the user's: this is a measurement, not a setting)
        run(EXE, "calibrate", "--this-machine", "--out", cal, env={**os.environ, "XDG_CACHE_HOME": OUT})
        cluster = f"{cal},{links}"
        print(f"\n### Tensor and pipeline parallelism across the shaped link "
              f"(llama-small, {BATCH} × {SEQ} tokens a step, 2 ranks)\n")
        print(f"planner cluster: `calibrate --this-machine`, {links}\n")
        print("| layout | within h1, measured (s) | across, measured (s) | slowdown, measured | "
              "within, planned (s) | across, planned (s) | slowdown, planned | measured / planned |")
        print("|---|---|---|---|---|---|---|---|")
        for layout in ["tp=2", "pp=2"]:
            w, full = train(f"{layout}-within", "h1:2", layout)
            a, _ = train(f"{layout}-across", "h1:1,h2:1", layout)
            flags = ["--force-cross-node-tp"] if layout.startswith("tp") else []
            pw, pa = plan(full, 1, 2, cluster), plan(full, 2, 1, cluster, *flags)
            short = full.split(",vpp")[0] + "," + ",".join(full.split(",")[4:6])
            print(f"| {short} | {w:.3f} | {a:.3f} | {a / w:.2f}× | {pw:.3f} | {pa:.3f} | {pa / pw:.2f}× | "
                  f"{(a / w) / (pa / pw):.2f} |")
    finally:
        subprocess.run([HOSTS, "down"], capture_output=True)


if __name__ == "__main__":
    main()

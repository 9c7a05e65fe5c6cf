#!/usr/bin/env python3
"""The planner against `train` on this machine, layout by layout: step time and every memory term.

Calibrates this machine (`calibrate --this-machine`), then for each llama-small layout (8 devices, or
fewer where the layout has fewer, batch 8 x 128) prices it with `plan --json` on that cluster file and
trains it with `train` for STEPS steps on the same cluster, both in f32 (`plan` would price mixed bf16
unless told). Prints one markdown table of step time
(the median over the steps after the first two of the slowest device's `step_time_s` in
`metrics.jsonl` — device time, what one device of the priced cluster takes; the wall time on a small
machine is every device sharing its cores — against `plan`'s `step_time_s`) and, per layout, the worst memory term of at least 5% of a device's total (measured
peak against `predicted_memory_bytes`, each device of `metrics.jsonl`'s last line), and whether
`plan`'s pick among the layouts is within 3% of the measured fastest, in each round and over the
rounds (medians).

On a shared VM the machine's speed moves by 20-30% from one minute to the next, so that one
calibration and one training can disagree by that much whatever the model: the script runs ROUNDS
rounds (calibrate, then every layout), each layout's step compared with its own round's plan, and
reports the median of each layout's rounds (its train / plan the median of the rounds' ratios).

    cargo build --release && scripts/plan_vs_train.py [STEPS] [ROUNDS]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXE = os.path.join(ROOT, "target", "release", "ferrotron")


def count_arg(i, default, least, what):
    """Positional argument `i` as a whole number of at least `least`, or a clear exit."""
    if len(sys.argv) <= i:
        return default
    try:
        n = int(sys.argv[i])
    except ValueError:
        n = least - 1
    if n < least:
        sys.exit(f"{what}: `{sys.argv[i]}` is not a whole number of at least {least} "
                 f"(usage: scripts/plan_vs_train.py [STEPS] [ROUNDS])")
    return n


# The median is taken over the steps after the first two: at least one must remain.
STEPS = count_arg(1, 12, 3, "STEPS")
ROUNDS = count_arg(2, 3, 1, "ROUNDS")
SEQ, BATCH, PRECISION = 128, 8, "f32"
# crates/ferrotron-engine/tests/memory.rs (the_plan_vs_train_layouts_hold_every_large_term_within_ten_percent)
# trains these seven layouts too, for the memory terms alone: change both together.
LAYOUTS = [
    "dp=8,mbs=1",
    "tp=4,dp=2,mbs=2",
    "pp=4,dp=2,mbs=1",
    "dp=8,zero=3,mbs=1",
    "dp=2,tp=2,pp=2,mbs=2",
    "dp=2,tp=2,pp=2,zero=1,mbs=2",
    "tp=2,pp=4,mbs=1",
]
TERMS = ["weights", "gradients", "master_weights", "optimizer_states", "activations", "comm_buffers"]


def run(args):
    out = subprocess.run([EXE] + args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ferrotron {' '.join(args)}:\n{out.stderr}")
    return out.stdout


def worst_term(devices):
    """The memory term furthest from its prediction among those of at least 5% of a device."""
    worst = (0.0, "")
    for d in devices:
        got, want = d["peak_memory_bytes"], d["predicted_memory_bytes"]
        total = max(got["total"], want["total"], 1)
        for t in TERMS:
            g, w = got[t], want[t]
            if max(g, w) < 0.05 * total:
                continue
            err = g / max(w, 1) - 1.0
            if abs(err) > abs(worst[0]):
                worst = (err, f"{t} on device {d['device']}: {g / 1e6:.2f} vs {w / 1e6:.2f} MB")
    return worst


def one_round(work, k):
    """Calibrates, then prices and trains every layout: (layout, plan s, train s, worst term) each."""
    cluster = os.path.join(work, f"this-machine-{k}.toml")
    run(["calibrate", "--this-machine", "--out", cluster])
    rows = []
    for layout in LAYOUTS:
        # The same run on both sides: `plan` prices mixed bf16 unless told (GPU runs), `train`
        # trains in f32 unless told.
        plan = json.loads(run(["plan", "--model", "llama-small", "--cluster", cluster, "--seq", str(SEQ),
                               "--global-batch", str(BATCH), "--layout", layout, "--precision", PRECISION,
                               "--json"]))
        out = os.path.join(work, f"{k}-" + layout.replace(",", "_").replace("=", ""))
        run(["train", "--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
             "--layout", layout, "--precision", PRECISION, "--cluster", cluster, "--out-dir", out])
        lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
        # Device time: what a step takes one device of the cluster the plan prices (the threads
        # backend's clock); wall time here is 8 devices sharing this machine's cores.
        measured = statistics.median(max(d["step_time_s"] for d in l["devices"]) for l in lines[2:])
        rows.append((layout, plan["step_time_s"], measured, worst_term(lines[-1]["devices"])))
    return rows


def main():
    # Each training keeps its checkpoints and model (66 MB a layout, 2.3 GB for 5 rounds): the
    # script reads their metrics and removes its directory when it is done.
    with tempfile.TemporaryDirectory(prefix="ferrotron-plan-vs-train.") as work:
        rounds = [one_round(work, k) for k in range(ROUNDS)]
    rows = []
    for i, layout in enumerate(LAYOUTS):
        mine = [r[i] for r in rounds]
        ratio = statistics.median(m / p for _, p, m, _ in mine)
        p = statistics.median(r[1] for r in mine)
        m = statistics.median(r[2] for r in mine)
        worst = max((r[3] for r in mine), key=lambda w: abs(w[0]))
        spread = ", ".join(f"{r[2] / r[1]:.2f}" for r in mine)
        rows.append((layout, p, m, ratio, spread, worst))
    print(f"plan against train on this machine (`calibrate --this-machine`), llama-small in {PRECISION}, "
          f"{BATCH} x {SEQ} tokens, median of steps 3-{STEPS}; {ROUNDS} rounds of calibrate + train, "
          f"medians\n")
    print("| layout | plan (ms) | train (ms) | train / plan | each round | within 10% "
          "| worst memory term (>= 5%) | within 10% |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, p, m, ratio, spread, (err, what) in rows:
        print(f"| {layout} | {1e3 * p:.1f} | {1e3 * m:.1f} | {ratio:.2f} | {spread} "
              f"| {'yes' if abs(ratio - 1) <= 0.10 else 'no'} "
              f"| {what} ({err:+.0%}) | {'yes' if abs(err) <= 0.10 else 'no'} |")
    # The pick and the fastest within each round (the same machine speed), then over the rounds.
    for k, r in enumerate(rounds):
        pick = min(r, key=lambda x: x[1])
        fastest = min(r, key=lambda x: x[2])
        print(f"\nround {k + 1}: plan's pick {pick[0]} trains at {1e3 * pick[2]:.1f} ms, "
              f"{pick[2] / fastest[2] - 1:+.1%} against the measured fastest {fastest[0]} "
              f"({1e3 * fastest[2]:.1f} ms)", end="")
    # Over the rounds: each layout's median plan and median step (the machine's speed moves from
    # one round to the next by more than the three fastest layouts differ).
    pick = min(rows, key=lambda r: r[1])
    fastest = min(rows, key=lambda r: r[2])
    print(f"\n\nover the rounds (medians): plan's pick {pick[0]} trains at {1e3 * pick[2]:.1f} ms, "
          f"{pick[2] / fastest[2] - 1:+.1%} against the measured fastest {fastest[0]} "
          f"({1e3 * fastest[2]:.1f} ms)")


if __name__ == "__main__":
    main()

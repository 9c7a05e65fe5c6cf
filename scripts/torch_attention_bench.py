#!/usr/bin/env python3
"""PyTorch's peer of `ferrotron bench attention`: causal scaled_dot_product_attention, forward and
backward, at the same shape, threads and precision. Prints the same table, or with --json one object
with `forward_s` and `backward_s` (medians) and the FLOPs counted as ferrotron counts them
(FlashAttention-2's convention: forward 4·B·H·S²·D halved by the causal mask, backward 2.5×).

    .venv-torch/bin/python scripts/torch_attention_bench.py --seq 4096 --heads 8 --kv-heads 8 \
        --head-dim 64 --precision f32 --threads 2
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--threads", type=int, default=0, help="0: all cores")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.heads % a.kv_heads:
        raise SystemExit(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.precision == "f32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def rand(heads):
        x = torch.rand(a.batch, heads, a.seq, a.head_dim, generator=g) * 2 - 1
        return x.to(dtype).requires_grad_(True)

    q, k, v = rand(a.heads), rand(a.kv_heads), rand(a.kv_heads)
    dout = (torch.rand(a.batch, a.heads, a.seq, a.head_dim, generator=g) * 2 - 1).to(dtype)
    gqa = a.kv_heads < a.heads

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    fwd, bwd = [], []
    for rep in range(a.reps + 1):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        q.grad = k.grad = v.grad = None
        out.backward(dout)
        t2 = time.perf_counter()
        if rep > 0:  # the first of each is a warm-up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    forward_flop = 4.0 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2.0
    r = {
        "forward_s": statistics.median(fwd),
        "backward_s": statistics.median(bwd),
        "forward_flop": forward_flop,
        "backward_flop": 2.5 * forward_flop,
        "threads": torch.get_num_threads(),
        "seq": a.seq,
        "batch": a.batch,
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "precision": a.precision,
        "torch": torch.__version__,
    }
    r["forward_gflops"] = forward_flop / r["forward_s"] / 1e9
    r["backward_gflops"] = 2.5 * forward_flop / r["backward_s"] / 1e9
    if a.json:
        print(json.dumps(r))
        return
    print(
        f"torch {torch.__version__} scaled_dot_product_attention: causal, batch {a.batch} x seq {a.seq}, "
        f"{a.heads} heads ({a.kv_heads} kv), head dim {a.head_dim}, {a.precision}, {r['threads']} threads; "
        f"median of {a.reps} timings"
    )
    print("| pass | ms | GFLOP/s |\n|---|---|---|")
    print(f"| forward | {r['forward_s'] * 1e3:.2f} | {r['forward_gflops']:.1f} |")
    print(f"| backward | {r['backward_s'] * 1e3:.2f} | {r['backward_gflops']:.1f} |")
    total = r["forward_s"] + r["backward_s"]
    print(f"| forward + backward | {total * 1e3:.2f} | {3.5 * forward_flop / total / 1e9:.1f} |")


if __name__ == "__main__":
    main()

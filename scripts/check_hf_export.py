#!/usr/bin/env python3
"""Checks that a model directory written by ferrotron loads in Hugging Face transformers and computes
the same loss and gradients as ferrotron.

usage: check_hf_export.py MODEL_DIR FERROTRON_BINARY
Needs torch, transformers and safetensors (e.g. `python3 -m venv .venv-torch &&
.venv-torch/bin/pip install torch transformers`). Exits non-zero on any mismatch.
"""
import os, subprocess, sys, tempfile
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

model_dir, binary = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
cfg = model.config
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=g, dtype=torch.int64)
with tempfile.TemporaryDirectory() as tmp:
    tokens, out = os.path.join(tmp, "ids.safetensors"), os.path.join(tmp, "grads.safetensors")
    save_file({"input_ids": ids}, tokens)
    subprocess.run([binary, "grads", "--model", model_dir, "--tokens", tokens, "--out", out], check=True)
    ours = load_file(out)
logits = model(input_ids=ids).logits
loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
loss.backward()
loss_err = abs(loss.item() - ours["loss"].item()) / loss.item()
worst = max((float((ours["grad." + n] - p.grad).norm() / p.grad.norm()), n) for n, p in model.named_parameters())
print(f"transformers loaded {model_dir}: loss {loss.item():.6f} vs ferrotron {ours['loss'].item():.6f} "
      f"(rel {loss_err:.1e}); worst gradient {worst[1]} rel {worst[0]:.1e}")
sys.exit(0 if loss_err <= 1e-5 and worst[0] <= 1e-4 else 1)

#!/usr/bin/env python3
"""Checks that what a ferrotron LoRA run writes loads in PEFT and transformers and computes what
ferrotron computes.

usage: check_peft_export.py BASE_MODEL_DIR ADAPTER_DIR MERGED_MODEL_DIR FERROTRON_BINARY
  BASE_MODEL_DIR    the Hugging Face model the adapters were trained on
  ADAPTER_DIR       a PEFT adapter directory ferrotron wrote (`<run>/adapter`, or
                    `ferrotron checkpoint export CKPT --adapter DIR`)
  MERGED_MODEL_DIR  the merged model ferrotron wrote (`<run>/model`, or
                    `ferrotron checkpoint export CKPT --hf DIR --merge`)
Needs torch, transformers, peft and safetensors (`python3 -m venv .venv-torch &&
.venv-torch/bin/pip install torch transformers peft`). It checks, on a random batch:
  1. peft.PeftModel.from_pretrained(base, ADAPTER_DIR) gives the merged model's logits (1e-5);
  2. PEFT's own merge_and_unload gives the same weights as ferrotron's merged model (1e-5);
  3. the loss and every adapter gradient of PEFT equal `ferrotron grads --adapter` (1e-5).
Exits non-zero on any mismatch.
"""
import os, subprocess, sys, tempfile
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from peft import PeftModel

base_dir, adapter_dir, merged_dir, binary = sys.argv[1:5]
load = lambda d: AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

peft_model = PeftModel.from_pretrained(load(base_dir), adapter_dir, is_trainable=True)
merged = load(merged_dir).eval()
cfg = merged.config
ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
failures = []

with torch.no_grad():
    e = rel(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits)
print(f"1. PEFT adapter on the base vs ferrotron's merged model: logits rel {e:.1e}")
if e > 1e-5:
    failures.append("logits")

theirs = PeftModel.from_pretrained(load(base_dir), adapter_dir).merge_and_unload().state_dict()
ours = merged.state_dict()
worst = max((rel(ours[n], w), n) for n, w in theirs.items() if w.dtype.is_floating_point and w.norm() > 0)
print(f"2. PEFT's merge_and_unload vs ferrotron's merge: worst weight {worst[1]} rel {worst[0]:.1e}")
if worst[0] > 1e-5:
    failures.append("merge")

with tempfile.TemporaryDirectory() as tmp:
    tokens, out = os.path.join(tmp, "ids.safetensors"), os.path.join(tmp, "grads.safetensors")
    save_file({"input_ids": ids}, tokens)
    subprocess.run([binary, "grads", "--model", base_dir, "--adapter", adapter_dir, "--tokens", tokens,
                    "--out", out], check=True, stdout=subprocess.DEVNULL)
    grads = load_file(out)
logits = peft_model(input_ids=ids).logits
loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
loss.backward()
loss_err = abs(loss.item() - grads["loss"].item()) / loss.item()
named = {n.replace(".default.", "."): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
worst = max((rel(grads["grad." + n], g), n) for n, g in named.items())
print(f"3. loss {loss.item():.6f} vs ferrotron {grads['loss'].item():.6f} (rel {loss_err:.1e}); "
      f"{len(named)} adapter gradients, worst {worst[1]} rel {worst[0]:.1e}")
if loss_err > 1e-5 or worst[0] > 1e-5:
    failures.append("gradients")
print("OK" if not failures else f"MISMATCH: {', '.join(failures)}")
sys.exit(1 if failures else 0)

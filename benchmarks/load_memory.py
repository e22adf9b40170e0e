"""Memory a model takes while it loads, against its weight bytes: is there a staging copy?

    .venv/bin/python benchmarks/load_memory.py --shape llama-3.1-8b           # dummy weights, bf16
    .venv/bin/python benchmarks/load_memory.py --shape llama-3.2-1b --dtype float32

Each run is a fresh process that writes the shape's config.json (the real model's fields, no
weights) into a temporary directory and loads it with ``load_format="dummy"`` on the CPU:
parameters made on the meta device, allocated once in the serving dtype, filled at random, then
handed to the linear backend (pdserve/engine/loader.py). It prints the process's resident memory
before, its peak while loading (the kernel's high-water mark, VmHWM) and after, against the
bytes the loaded model holds (its parameters, and the buffers a linear backend packs weights
into, RoPE tables included): the issue's bound is weight bytes plus 10% for the peak. Loading a real
checkpoint reads the same way, a tensor at a time (tests/engine/test_weight_loading.py bounds it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The fields of each model's config.json that shape it (as published with the checkpoint).
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

CHILD = r"""
import json, sys, time
import torch
from pdserve.engine.config import DTYPES
from pdserve.engine.loader import load_model

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = rss("VmRSS:")
t0 = time.perf_counter()
net, cfg, _ = load_model(sys.argv[1], DTYPES[sys.argv[2]], torch.device("cpu"), progress=False, load_format="dummy")
seconds = time.perf_counter() - t0
print(json.dumps({"before": before, "peak": rss("VmHWM:"), "after": rss("VmRSS:"), "seconds": seconds,
                  "param_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
                  "buffer_bytes": sum(b.numel() * b.element_size() for b in net.buffers()),
                  "backend": net.linear_backend, "kernel_path": net.kernel_path}))
"""


def measure(shape: str, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
               "torch_dtype": "bfloat16", **SHAPES[shape]}
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        out = subprocess.run([sys.executable, "-c", CHILD, tmp, dtype], capture_output=True, text=True, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    r = measure(args.shape, args.dtype)
    gib = 1 << 30
    # The linear backend may keep packed weights as buffers: what the model holds is both.
    weights = r["param_bytes"] + r["buffer_bytes"]
    grew = r["peak"] - r["before"]
    print(f"{args.shape} in {args.dtype}, dummy weights, "
          f"{r['backend']} linears{' on ' + r['kernel_path'] if r['kernel_path'] else ''}, {r['seconds']:.1f} s")
    print(f"  the model holds {weights / gib:.2f} GiB (parameters and buffers); process before {r['before'] / gib:.2f} GiB, "
          f"peak {r['peak'] / gib:.2f} GiB, after {r['after'] / gib:.2f} GiB")
    print(f"  loading grew the peak by {grew / gib:.2f} GiB = {grew / weights:.3f}x the weight bytes "
          f"(the bound: 1.10x); steady growth {(r['after'] - r['before']) / weights:.3f}x")
    print(json.dumps({"shape": args.shape, "dtype": args.dtype, **r}))


if __name__ == "__main__":
    main()

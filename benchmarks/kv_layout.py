"""Decode attention over every layer, the KV block laid out layer-major (the engine's) against
token-major (what it was), on one core.

    .venv/bin/python benchmarks/kv_layout.py                       # batch 16 and 32, context 290
    .venv/bin/python benchmarks/kv_layout.py --batch 32 --context 100 290 1000

The default model's attention geometry (9 heads, 3 KV heads, head_dim 64, 30 layers, blocks of
16), bfloat16, each sequence's blocks drawn at random from the cache as a busy worker's are.
One round runs the paged kernel for all 30 layers of one decode step, as a step does (writing
each new token's K and V included); before each round a 300 MiB buffer is written, as a step's
weights pass through the caches, so the KV is read from where a served step finds it. The
layouts alternate round after round and the median of each is printed with their ratio: a
noisy machine shifts both alike. CPU time of the process (``time.process_time``), one thread,
pinned to core 0.

Token-major is ``(blocks, block_size, layers, 2, kv_heads, head_dim)``: one layer's consecutive
keys a whole token's KV apart (23,040 bytes here). Layer-major is ``(blocks, layers, 2,
block_size, kv_heads, head_dim)``: one layer's K for a block's 16 tokens in one 6 KiB run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.attention.base import build_context  # noqa: E402
from pdserve.engine.attention.kv_cache import host_zeros  # noqa: E402
from pdserve.engine.attention.paged import PagedAttention  # noqa: E402

NH, NKV, HD, BS, LAYERS = 9, 3, 64, 16, 30
SHAPES = {  # each layout's cache shape and one layer's (K, V) views, (num_blocks, BS, NKV, HD)
    "layer-major": (lambda n: (n, LAYERS, 2, BS, NKV, HD), lambda c, i: (c[:, i, 0], c[:, i, 1])),
    "token-major": (lambda n: (n, BS, LAYERS, 2, NKV, HD), lambda c, i: (c[:, :, i, 0], c[:, :, i, 1])),
}


def one_case(batch: int, context: int, rounds: int) -> dict[str, float]:
    """Median ms of one decode step's attention (30 layers) for each layout."""
    starts, query_lens = [context - 1] * batch, [1] * batch
    per_seq = -(-context // BS)
    num_blocks = batch * per_seq + 1
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    qkv = torch.randn(batch, NH + 2 * NKV, HD).to(torch.bfloat16)
    q, k, v = qkv[:, :NH], qkv[:, NH:NH + NKV], qkv[:, NH + NKV:]
    views = {}
    for name, (shape, layer) in SHAPES.items():
        cache = host_zeros(shape(num_blocks), torch.bfloat16)
        cache.copy_(torch.randn(cache.shape))
        views[name] = [layer(cache, i) for i in range(LAYERS)]
    backend = PagedAttention(NH, NKV, HD)
    flush = torch.zeros(300 * 2**20 // 4)
    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for name in SHAPES:
                flush.add_(1.0)
                ctx, _ = build_context(starts, query_lens, tables, BS, torch.device("cpu"), decode=True)
                start = time.process_time()
                for k_cache, v_cache in views[name]:
                    backend.forward(q, k, v, k_cache, v_cache, ctx)
                if r:
                    times[name].append(time.process_time() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[290])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    print("| batch | context | KV read a step | layer-major ms | token-major ms | token / layer |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        for context in args.context:
            r = one_case(batch, context, args.rounds)
            mib = batch * context * LAYERS * 2 * NKV * HD * 2 / 2**20
            print(f"| {batch} | {context} | {mib:.0f} MiB | {r['layer-major']:.2f} | {r['token-major']:.2f} "
                  f"| {r['token-major'] / r['layer-major']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

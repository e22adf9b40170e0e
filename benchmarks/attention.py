"""Attention benchmark: pdserve's paged kernel against the SDPA path, one layer and a decode step.

    .venv/bin/python benchmarks/attention.py                    # float32 and bfloat16
    .venv/bin/python benchmarks/attention.py --dtypes bfloat16 --no-step

One layer of the default model's geometry (9 heads, 3 kv heads, head_dim 64, block 16), the
cache laid out as the engine lays it out (30 layers, strided views): a decode batch of 16 at
staggered context lengths (100..1000, every sequence its own length, as under real traffic)
and a 512-token prefill. Each backend call includes writing the new K/V. The backends are
timed alternately, round after round, and the median per backend is reported, so a noisy
machine shifts both alike. Unless ``--no-step``, it also times the default model's whole
decode forward (30 layers, the sequences at the same staggered lengths), alternating the
backends the same way. Times are CPU time of the process (``time.process_time``) at
``--threads`` (default 1, as each cluster worker runs): on a shared machine, wall time
mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.attention.base import SdpaAttention, build_context  # noqa: E402
from pdserve.engine.attention.paged import PagedAttention  # noqa: E402
from pdserve.engine.attention.kv_cache import host_zeros  # noqa: E402

NH, NKV, HD, BS, LAYERS = 9, 3, 64, 16, 30
DECODE_LENS = [100 + 60 * i for i in range(16)]  # 100 .. 1000


def layer_case(dtype: torch.dtype, starts: list[int], query_lens: list[int]):
    """Cache, one layer's views, the step's context and random q/k/v."""
    blocks_needed = [-(-(s + n) // BS) for s, n in zip(starts, query_lens)]
    num_blocks = sum(blocks_needed) + 1
    cache = host_zeros((num_blocks, LAYERS, 2, BS, NKV, HD), dtype)  # the engine's memory (huge pages)
    cache.copy_(torch.randn(cache.shape))
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(perm[used:used + n])
        used += n
    ctx_args = (starts, query_lens, tables, BS, torch.device("cpu"))
    t = sum(query_lens)
    qkv = torch.randn(t, NH + 2 * NKV, HD).to(dtype)
    layer = LAYERS // 2
    return cache[:, layer, 0], cache[:, layer, 1], ctx_args, qkv


def time_layer(backend, k_cache, v_cache, ctx_args, qkv, decode: bool) -> float:
    ctx, _ = build_context(*ctx_args, decode=decode)  # fresh per call: SDPA caches groups in it
    q, k, v = qkv[:, :NH], qkv[:, NH:NH + NKV], qkv[:, NH + NKV:]
    start = time.process_time()
    backend.forward(q, k, v, k_cache, v_cache, ctx)
    return time.process_time() - start


def compare_layer(dtype: torch.dtype, starts, query_lens, decode: bool, rounds: int) -> dict[str, float]:
    k_cache, v_cache, ctx_args, qkv = layer_case(dtype, starts, query_lens)
    backends = {"paged": PagedAttention(NH, NKV, HD), "sdpa": SdpaAttention(NH, NKV, HD)}
    times: dict[str, list[float]] = {name: [] for name in backends}
    with torch.inference_mode():
        for name, b in backends.items():  # warm-up
            time_layer(b, k_cache, v_cache, ctx_args, qkv, decode)
        for _ in range(rounds):
            for name, b in backends.items():
                times[name].append(time_layer(b, k_cache, v_cache, ctx_args, qkv, decode))
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def compare_steps(dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Median ms per decode forward of the default model (all 30 layers, no sampling), 16
    sequences at the staggered lengths. The cache holds random K/V: timing needs no prefill."""
    from pdserve.engine.attention.kv_cache import KVCacheSpec, layer_views
    from pdserve.engine.loader import load_model

    model, cfg, _ = load_model("default", dtype, torch.device("cpu"), progress=False)
    starts = [c - 1 for c in DECODE_LENS]
    spec = KVCacheSpec.of(cfg, BS, dtype)
    num_blocks = sum(-(-c // BS) for c in DECODE_LENS) + 1
    cache = spec.allocate(num_blocks, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape))
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for c in DECODE_LENS:
        tables.append(perm[used:used + -(-c // BS)])
        used += -(-c // BS)
    ids = torch.randint(100, 40000, (len(starts),))
    backends = {"paged": PagedAttention(NH, NKV, HD), "sdpa": SdpaAttention(NH, NKV, HD)}
    views = [layer_views(cache, i) for i in range(cfg.num_layers)]
    times: dict[str, list[float]] = {name: [] for name in backends}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for name, backend in backends.items():
                model.bind_caches(views, backend)
                ctx, positions = build_context(starts, [1] * len(starts), tables, BS, torch.device("cpu"), decode=True)
                start = time.process_time()
                model(ids, positions, ctx)
                if r:
                    times[name].append(time.process_time() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step-rounds", type=int, default=5)
    parser.add_argument("--no-step", action="store_true", help="skip the whole-model decode forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    print("| dtype | case | paged ms | sdpa ms | sdpa / paged |")
    print("|---|---|---|---|---|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        cases = {
            "decode B=16, ctx 100..1000 (1 layer)": ([c - 1 for c in DECODE_LENS], [1] * 16, True),
            "prefill 512 tokens (1 layer)": ([0], [512], False),
        }
        for label, (starts, qlens, decode) in cases.items():
            r = compare_layer(dtype, starts, qlens, decode, args.rounds)
            print(f"| {name} | {label} | {r['paged']:.3f} | {r['sdpa']:.3f} | {r['sdpa'] / r['paged']:.2f} |")
        if not args.no_step:
            r = compare_steps(dtype, args.step_rounds)
            print(f"| {name} | decode forward B=16, ctx 100..1000 (30 layers) | {r['paged']:.1f} | {r['sdpa']:.1f} "
                  f"| {r['sdpa'] / r['paged']:.2f} |")


if __name__ == "__main__":
    main()

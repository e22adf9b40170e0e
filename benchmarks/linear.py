"""Linear-layer benchmark: pdserve's batch-invariant kernels (bfloat16 and float32 weights)
against torch's F.linear (bfloat16 and float32) on every linear shape of SmolLM2-135M, in one
run, and against the memory-bandwidth floor of a batch-1 decode step (bfloat16 weights).

    PYTHONPATH=. .venv/bin/python benchmarks/linear.py --threads 1 2
    PYTHONPATH=. .venv/bin/python benchmarks/linear.py --paths avx2 amx     # some kernel paths only

Every kernel path this processor runs is measured in the same run (``--paths``; each packs its
own weights), against torch's F.linear, which uses oneDNN's best path here (AMX where there is
one). To compare with oneDNN's AVX-512 BF16 path on an AMX processor, cap it:
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ... --paths avx512_bf16``.

Decode: one pass over the whole model's linears (30 layers x qkv, o, gate_up, down, plus the
LM head) at M rows, timed as the median of ``--repeats`` passes; weights are random, with
the model's shapes. Each layer has its own weight tensors, so a pass streams all 270 MB of
bfloat16 weights from memory as a real decode step does. The floor is those bytes divided
by the read bandwidth measured at the same thread count. Prefill: the same pass at 512 rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.kernels import cpu_kernels# noqa: E402
from pdserve.engine.linear import PackedLinear  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 960
LAYER_SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K)


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth (a float32 sum of a tensor far larger than L3) at ``threads``."""
    torch.set_num_threads(threads)
    x = torch.ones(mib << 18, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build_weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    return [(torch.randn(n, k, generator=g) * k ** -0.5).bfloat16() for n, k in shapes]


def passes(weights: list[torch.Tensor], paths: list[str]) -> dict:
    """One callable per implementation: x_by_k (dict K -> (M, K) input) -> None. pdserve's
    bfloat16 kernels once per kernel path (weights packed for it; the call sets the path)."""
    w32 = [w.float() for w in weights]
    impls = {}
    for path in paths:
        cpu_kernels.set_isa(path)
        packed = [PackedLinear(w, None, f32_out=(i == len(weights) - 1)) for i, w in enumerate(weights)]
        impls[f"pdserve bf16 {path}"] = lambda xs, packed=packed, path=path: (
            cpu_kernels.set_isa(path), [p(xs[p.in_features]) for p in packed])
    cpu_kernels.set_isa(cpu_kernels.default_isa())
    packed32 = [PackedLinear(w, None) for w in w32]
    impls["torch bf16"] = lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights]
    impls["torch f32"] = lambda xs: [F.linear(xs[w.shape[1]].float(), w) for w in w32]
    impls[f"pdserve f32 {cpu_kernels.default_isa()}"] = lambda xs: [p(xs[p.in_features].float()) for p in packed32]
    return impls


def time_pass(fn, rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for k in (HIDDEN, INTER)}
    fn(xs)
    return statistics.median(_timed(lambda: fn(xs)) for _ in range(repeats)) * 1e3


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--paths", nargs="+", default=None, help="kernel paths to measure (default: all this processor runs)")
    args = ap.parse_args()
    cpu_kernels.load()
    paths = args.paths or cpu_kernels.runnable_isas()
    best = f"pdserve bf16 {paths[-1]}"
    weights = build_weights()
    wbytes = sum(w.numel() * 2 for w in weights)
    impls = passes(weights, paths)
    f32 = f"pdserve f32 {cpu_kernels.default_isa()}"
    print(f"bfloat16 weight bytes per pass: {wbytes / 1e6:.0f} MB; ratios below are for {best}")
    print("| threads | rows | read GB/s | floor ms | " + " | ".join(f"{n} ms" for n in impls) +
          " | pdserve / floor | pdserve vs torch bf16 | pdserve vs torch f32 | pdserve f32 vs torch f32 |")
    print("|---" * (8 + len(impls)) + "|")
    for threads in args.threads:
        bw = read_bandwidth_gbs(threads)
        floor = wbytes / (bw * 1e9) * 1e3
        for rows in args.rows + [args.prefill]:
            torch.set_num_threads(threads)
            ms = {name: time_pass(fn, rows, args.repeats if rows < 64 else 1) for name, fn in impls.items()}
            ours = ms[best]
            print(f"| {threads} | {rows} | {bw:.1f} | {floor:.1f} | " + " | ".join(f"{v:.1f}" for v in ms.values()) +
                  f" | {ours / floor:.2f}x | {ms['torch bf16'] / ours:.2f}x | {ms['torch f32'] / ours:.2f}x"
                  f" | {ms['torch f32'] / ms[f32]:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()

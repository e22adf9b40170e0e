"""Choosing the prefill token budget (``SchedulerConfig.max_num_batched_tokens``) by
measurement: prefill throughput and step latency of a prefill worker's engine, per budget.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/prefill_budget.py [--budgets 256 512 ...]

The load is what a prefill worker sees under the serving benchmark: a queue of 256-token
prompts (``--prompts`` of them), prefill-only (each stops at its first token and holds its
KV), one torch thread as the cluster runs a worker on this machine. Each budget runs the same
queue on the same engine (weights loaded once), alternating budgets over ``--rounds`` so a
noisy machine affects every budget alike; each cell is the median over rounds. A step's
latency is how long a newly arrived prompt may wait behind the step in progress; the
throughput is prompt tokens per second over the whole queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402
from pdserve.engine.core.scheduler import Scheduler  # noqa: E402


def run_queue(engine: LLMEngine, budget: int, prompts: list[list[int]]) -> tuple[float, float]:
    """(prompt tokens/s, median step ms) for ``prompts`` prefilled under ``budget``."""
    engine.scheduler = Scheduler(dataclasses.replace(engine.config.scheduler, max_num_batched_tokens=budget),
                                 engine.blocks, engine.max_model_len, tuple(engine.scheduler.eos_token_ids))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params, hold_kv=True)
    steps = []
    start = time.perf_counter()
    while engine.has_runnable():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    for i in range(len(prompts)):
        engine.free_held(f"q{i}")
    return sum(map(len, prompts)) / total, statistics.median(steps) * 1e3


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(dtype=args.dtype, cache=CacheConfig(memory_budget_bytes=256 << 20)),
                                   progress=False, detokenize=False)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_cfg.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    engine.blocks.enable_prefix_cache = False  # every round computes every prompt
    run_queue(engine, 512, prompts[:2])  # warm-up
    results = {b: [] for b in args.budgets}
    for _ in range(args.rounds):
        for b in args.budgets:
            results[b].append(run_queue(engine, b, prompts))
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.dtype}, 1 thread, median of {args.rounds}")
    print("| budget (tokens) | prefill tok/s | step p50 ms |\n|---|---|---|")
    for b, runs in results.items():
        print(f"| {b} | {statistics.median(r[0] for r in runs):.0f} | {statistics.median(r[1] for r in runs):.0f} |")


if __name__ == "__main__":
    main()

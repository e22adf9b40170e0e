"""What ``torch.compile`` would buy the decode step: eager against compiled, in one run.

    .venv/bin/python benchmarks/compile_step.py                  # bfloat16, 1 thread, ~6 min
    .venv/bin/python benchmarks/compile_step.py --dtype float32

The default model's engine decodes batches of 1 and 16 (prompts of 200+ tokens, prefilled
first), timing the median step in thread CPU time; then its ``model.forward`` is wrapped in
``torch.compile(dynamic=True)`` (inductor, CPU C++ backend) and the same is timed again.
Prints the compile time (every graph the steps needed: dynamo specialises sizes 0 and 1, so a
batch of one, a single sequence and a one-block table each get their own graph), the step
times, their ratio, and whether the compiled engine produced the eager engine's tokens.
Not a serving option yet (docs/benchmarks/history.md says why).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402


def decode_steps(engine: LLMEngine, batch: int, steps: int, tag: str) -> tuple[float, list[list[int]]]:
    """Median decode step (ms, thread CPU time) for ``batch`` greedy sequences, and their tokens."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(100 + i, 300 + i * 8)), params)
    while engine.scheduler.waiting:
        engine.step()
    times, tokens = [], {rid: [] for rid in ids}
    while engine.has_unfinished():
        t = time.thread_time()
        outs = engine.step()
        times.append(time.thread_time() - t)
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    times.sort()
    return times[len(times) // 2] * 1e3, [tokens[r] for r in ids]


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig(dtype=args.dtype, cache=CacheConfig(num_blocks=512)), progress=False)
    batches = (1, 16)
    with tqdm(total=2 * len(batches) + 1, desc="compile_step") as bar:
        eager = {}
        for b in batches:
            eager[b] = decode_steps(engine, b, args.steps, "eager")
            bar.update(1)
        model = engine.runner.model
        model.forward = torch.compile(model.forward, dynamic=True)
        t = time.perf_counter()
        for b in batches:
            decode_steps(engine, b, 2, "warm")  # compiles every graph the timed runs need
        compile_s = time.perf_counter() - t
        bar.update(1)
        compiled = {}
        for b in batches:
            compiled[b] = decode_steps(engine, b, args.steps, "compiled")
            bar.update(1)
    print(f"\n{args.dtype}, {args.threads} thread(s); compile (all graphs, cold cache): {compile_s:.0f} s")
    print("| batch | eager ms/step | compiled ms/step | speed-up | same tokens |")
    print("|---|---|---|---|---|")
    for b in batches:
        print(f"| {b} | {eager[b][0]:.1f} | {compiled[b][0]:.1f} | {eager[b][0] / compiled[b][0]:.2f}x | "
              f"{eager[b][1] == compiled[b][1]} |")


if __name__ == "__main__":
    main()

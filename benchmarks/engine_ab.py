"""Decode step time of this checkout against another git revision, alternating, in one run.

    .venv/bin/python benchmarks/engine_ab.py --base 5eb4550                 # batch 1 and 16, bfloat16
    .venv/bin/python benchmarks/engine_ab.py --base HEAD~3 --batches 1 --dtype float32 --rounds 5

Each round runs the base revision (a detached worktree under .bench/ab/) and this checkout in
turn, each in a fresh process with one torch thread: the default model, B requests with
256-token prompts prefilled, then ``--steps`` timed decode steps. It reports the median step
in thread CPU time (what the step itself computed: the number that survives a busy machine)
and in wall time, per side, and the ratio base / this. A ratio above 1 means this checkout
is faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import importlib, json, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
# Revisions before the one import name keep the engine at the top level of the tree.
pkg = "pdserve.engine" if os.path.isdir(os.path.join(sys.argv[1], "pdserve", "engine")) else "engine"
EngineConfig = importlib.import_module(pkg + ".config").EngineConfig
LLMEngine = importlib.import_module(pkg + ".llm_engine").LLMEngine
SamplingParams = importlib.import_module(pkg + ".sampling").SamplingParams
batch, steps, dtype = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
engine = LLMEngine.from_config(EngineConfig(model="default", dtype=dtype), detokenize=False)
for i in range(batch):
    engine.add_request(f"r{i}", list(range(100 + i, 356 + i)), SamplingParams(max_tokens=steps + 50, ignore_eos=True))
while engine.scheduler.waiting:
    engine.step()
for _ in range(3):
    engine.step()
cpu, wall = [], []
for _ in range(steps):
    c, w = time.thread_time(), time.perf_counter()
    engine.step()
    cpu.append(time.thread_time() - c)
    wall.append(time.perf_counter() - w)
print(json.dumps({"cpu_ms": sorted(cpu)[len(cpu) // 2] * 1e3, "wall_ms": sorted(wall)[len(wall) // 2] * 1e3}))
"""


def base_tree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = ROOT / ".bench" / "ab" / sha
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return tree


def measure(tree: Path, batch: int, steps: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(batch), str(steps), dtype],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sides = {"base": base_tree(args.base), "this": ROOT}
    results = {(b, side): [] for b in args.batches for side in sides}
    with tqdm(total=args.rounds * len(args.batches) * 2, desc="A/B decode steps") as bar:
        for _ in range(args.rounds):
            for b in args.batches:
                for side, tree in sides.items():
                    results[b, side].append(measure(tree, b, args.steps, args.dtype))
                    bar.update()
    print(f"\n{args.dtype}, 1 thread, median of {args.rounds} rounds (each the median of {args.steps} steps); "
          f"base = {args.base}")
    print("| batch | base CPU ms | this CPU ms | CPU ratio | base wall ms | this wall ms | wall ratio |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        m = {(side, k): statistics.median(r[k] for r in results[b, side]) for side in sides for k in ("cpu_ms", "wall_ms")}
        print(f"| {b} | {m['base', 'cpu_ms']:.1f} | {m['this', 'cpu_ms']:.1f} | {m['base', 'cpu_ms'] / m['this', 'cpu_ms']:.2f}x "
              f"| {m['base', 'wall_ms']:.1f} | {m['this', 'wall_ms']:.1f} | {m['base', 'wall_ms'] / m['this', 'wall_ms']:.2f}x |")


if __name__ == "__main__":
    main()

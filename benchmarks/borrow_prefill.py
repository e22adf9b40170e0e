"""One prompt's prefill on the engine, with the decode worker's core lent to it (the borrowed-core
pool, ``--borrow-idle-cores``) against its own core only, interleaved (issue 59: "every idle core
prefills").

Two child processes each hold an engine (the default model, bfloat16, one torch thread) pinned
to core 0, as a prefill worker is pinned to its own core; one of them also starts the borrowing
pool with core 1 (the decode worker's, idle here) borrowed, as ``pdserve serve`` does
(``shell.worker.borrow_idle_cores``). The parent asks them in turn for one prefill of a fresh
``--tokens``-token prompt (one engine step, its wall time), ``--rounds`` times each, so both see
the same machine over the run.

    PYTHONPATH=. .venv/bin/python benchmarks/borrow_prefill.py --tokens 1024 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

OWN, BORROWED = 0, 1


def child(borrow: bool) -> None:
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.planner.profile import _prefill_once

    os.sched_setaffinity(0, {OWN})
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(model="default", cache=CacheConfig()))
    if borrow:
        from pdserve.shell.worker import borrow_idle_cores

        borrow_idle_cores([OWN], [BORROWED])
    n = 0
    for line in sys.stdin:
        n += 1
        seconds = _prefill_once(engine, int(line), f"r{n}")
        print(f"{seconds:.6f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--child", choices=("borrow", "alone"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child == "borrow")
        return 0
    if (os.cpu_count() or 1) < 2:
        print("borrow_prefill: needs two cores", file=sys.stderr)
        return 2
    kids = {mode: subprocess.Popen([sys.executable, __file__, "--child", mode], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for mode in ("borrow", "alone")}
    times: dict[str, list[float]] = {mode: [] for mode in kids}
    load = os.getloadavg()[0]
    for r in range(args.rounds + 1):  # the first round warms both up, and is dropped
        for mode, kid in kids.items():
            kid.stdin.write(f"{args.tokens}\n")
            kid.stdin.flush()
            seconds = float(kid.stdout.readline())
            if r:
                times[mode].append(seconds)
    for kid in kids.values():
        kid.stdin.close()
        kid.wait()
    print(f"{args.tokens}-token prefill, {args.rounds} rounds interleaved; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    for mode, label in (("alone", "own core only"), ("borrow", f"own core + core {BORROWED} borrowed")):
        t = times[mode]
        print(f"  {label:<28} median {statistics.median(t) * 1e3:7.1f} ms, fastest {min(t) * 1e3:7.1f} ms, "
              f"all {' '.join(f'{x * 1e3:.0f}' for x in t)}")
    ratio = statistics.median(times["alone"]) / statistics.median(times["borrow"])
    print(f"  borrowing: {ratio:.2f}x by the medians, {min(times['alone']) / min(times['borrow']):.2f}x by the fastest")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One prompt's prefill on the engine, with the decode worker's core lent to it (the borrowed-core
pool, ``--borrow-idle-cores``) against its own core only, interleaved (issue 59: "every idle core
prefills").

Two child processes each hold an engine (the default model, bfloat16, one torch thread) pinned
to core 0, as a prefill worker is pinned to its own core; one of them also starts the borrowing
pool with core 1 (the decode worker's, idle here) borrowed, as ``pdserve serve`` does
(``shell.worker.borrow_idle_cores``). The parent asks them in turn for one prefill of a fresh
``--tokens``-token prompt (one engine step, its wall time), ``--rounds`` times each, so both see
the same machine over the run.

``--load BUSY_MS/SLEEP_MS`` also runs a normal-priority process on the borrowed core, busy and
asleep in turns (``25/15``: about a decode worker's steps under load), through both engines'
rounds, so the case where the borrowed core's owner keeps taking it back is measured on
purpose. The borrowing engine then reports its pool's counts: its helper's chunks copied in, chunks
stolen back from the helper, and helper chunks dropped.

    PYTHONPATH=. .venv/bin/python benchmarks/borrow_prefill.py --tokens 1024 --rounds 8
    PYTHONPATH=. .venv/bin/python benchmarks/borrow_prefill.py --tokens 256 --rounds 8 --load 25/15
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
    if borrow:
        try:
            jobs, committed, stolen, dropped, _ = torch.ops.pdserve.borrow_pool_stats()
        except (AttributeError, RuntimeError):  # a build from before the pool counted (for comparisons)
            print("pool: no counts in this build", flush=True)
            return
        print(f"pool: {jobs} jobs, {committed} helper chunks copied in, {stolen} stolen back, {dropped} dropped",
              flush=True)


def duty_cycle(busy_ms: float, sleep_ms: float) -> None:
    """The borrowed core's owner: a normal-priority process, busy then asleep, for ever."""
    import time

    os.sched_setaffinity(0, {BORROWED})
    while True:
        end = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:
            pass
        time.sleep(sleep_ms / 1e3)


def parse_load(text: str) -> tuple[float, float]:
    try:
        busy, sleep = (float(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load must be BUSY_MS/SLEEP_MS, e.g. 25/15, got {text!r}") from None
    if busy <= 0 or sleep < 0:
        raise argparse.ArgumentTypeError(f"--load needs BUSY_MS > 0 and SLEEP_MS >= 0, got {text!r}")
    return busy, sleep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--load", type=parse_load, metavar="BUSY_MS/SLEEP_MS",
                        help="a normal-priority duty cycle on the borrowed core through the run (e.g. 25/15)")
    parser.add_argument("--child", choices=("borrow", "alone"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child == "borrow")
        return 0
    if args.tokens < 1 or args.rounds < 1:
        parser.error(f"--tokens and --rounds must be >= 1, got {args.tokens} and {args.rounds}")
    if (os.cpu_count() or 1) < 2:
        print("borrow_prefill: needs two cores", file=sys.stderr)
        return 2
    kids = {mode: subprocess.Popen([sys.executable, __file__, "--child", mode], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for mode in ("borrow", "alone")}
    times: dict[str, list[float]] = {mode: [] for mode in kids}
    load = os.getloadavg()[0]
    lender = None
    if args.load:
        import multiprocessing

        lender = multiprocessing.Process(target=duty_cycle, args=args.load, daemon=True)
        lender.start()
    for r in range(args.rounds + 1):  # the first round warms both up, and is dropped
        for mode, kid in kids.items():
            kid.stdin.write(f"{args.tokens}\n")
            kid.stdin.flush()
            seconds = float(kid.stdout.readline())
            if r:
                times[mode].append(seconds)
    if lender is not None:
        lender.terminate()
        lender.join()
    pool = ""
    for mode, kid in kids.items():
        kid.stdin.close()
        if mode == "borrow":
            pool = kid.stdout.read().strip()
        kid.wait()
    print(f"{args.tokens}-token prefill, {args.rounds} rounds interleaved; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    if args.load:
        print(f"  core {BORROWED} busy {args.load[0]:g} ms / asleep {args.load[1]:g} ms at normal priority throughout")
    for mode, label in (("alone", "own core only"), ("borrow", f"own core + core {BORROWED} borrowed")):
        t = times[mode]
        print(f"  {label:<28} median {statistics.median(t) * 1e3:7.1f} ms, fastest {min(t) * 1e3:7.1f} ms, "
              f"all {' '.join(f'{x * 1e3:.0f}' for x in t)}")
    ratio = statistics.median(times["alone"]) / statistics.median(times["borrow"])
    print(f"  borrowing: {ratio:.2f}x by the medians, {min(times['alone']) / min(times['borrow']):.2f}x by the fastest")
    print(f"  {pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

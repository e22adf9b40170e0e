"""CPU an idle worker pair burns: one prefill and one decode worker (NIXL agents, default
model) served from one process that does nothing for ``--seconds``; psutil reads the
process's CPU time over that window.

Run it against two trees in one go to compare (the tree is whatever PYTHONPATH imports):
    PYTHONPATH=/work/main python benchmarks/idle_cpu.py
    PYTHONPATH=$PWD python benchmarks/idle_cpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time


async def _serve(model: str) -> None:
    from pdserve.cluster.settings import LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS
    from pdserve.decode_worker.server import start as start_decode
    from pdserve.decode_worker.worker import DecodeWorkerConfig
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.prefill_worker.server import start as start_prefill
    from pdserve.prefill_worker.config import PrefillWorkerConfig

    engine = EngineConfig(model=model, cache=CacheConfig(memory_budget_bytes=64 << 20))
    servers = [await start_prefill(PrefillWorkerConfig(engine=engine, lease_seconds=LEASE_SECONDS.default)),
               await start_decode(DecodeWorkerConfig(engine=engine, transfer_timeout_s=TRANSFER_TIMEOUT_SECONDS.default,
                                                   lease_seconds=LEASE_SECONDS.default))]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the parent says stop
    for s in servers:
        await s.stop()


def measure(seconds: float, model: str) -> float:
    import psutil

    child = subprocess.Popen([sys.executable, __file__, "--serve", "--model", model],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:  # libraries may print before
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError("the workers did not start")
        time.sleep(1.0)  # let start-up work settle
        proc = psutil.Process(child.pid)
        proc.cpu_percent(None)
        time.sleep(seconds)
        return proc.cpu_percent(None)
    finally:
        child.communicate("stop\n", timeout=60)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--model", default="default")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.model))
        return
    print(f"idle prefill+decode worker process: {measure(args.seconds, args.model):.1f}% of one core "
          f"over {args.seconds:.0f} s")


if __name__ == "__main__":
    main()

"""How long a rolling restart takes, process by process, and what the clients saw meanwhile.

A local cluster as ``make serve`` starts it, but with two workers a pool (bfloat16, one thread
each), under a steady load of greedy streams from ``--clients`` clients. Each pool is rolled
in turn (``pdserve.cluster.rollout``), then the router. Prints, and with ``--out`` writes as
JSON: each replaced process's time to ready (the surge: a new process, model load included)
and its drain, and the requests that completed and failed.

    .venv/bin/python benchmarks/rollout.py --out benchmarks/results/rollout.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from benchmarks.processor import print_banner  # noqa: E402
from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.cluster.rollout import RolloutConfig, roll  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402


def request(i: int, max_tokens: int) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req.chat.messages.add(role="user", content=f"Tell me a short fact about the number {i}.")
    return req


def load(stub, clients: int, max_tokens: int, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    def client(k: int) -> None:
        while not stop.is_set():
            try:
                for _ in stub.Generate(request(k, max_tokens), timeout=120):
                    pass
                counts["completed"].append(k)
            except grpc.RpcError as exc:
                counts["failed"].append(exc.code().name)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    info = print_banner()
    cluster = LocalCluster(ClusterConfig(num_prefill=2, num_decode=2, grpc_port=0, http_port=None,
                                         threads_per_worker=1))
    cluster.start()
    counts = {"completed": [], "failed": []}
    stop = threading.Event()
    results = []
    try:
        with grpc.insecure_channel(cluster.address) as ch:
            threads = load(pdserve_pb2_grpc.GenerationStub(ch), args.clients, args.max_tokens, stop, counts)
            time.sleep(5)
            for pool in ("prefill", "decode", "router"):
                before = len(counts["completed"])
                for r in roll(cluster, pool, RolloutConfig()):
                    results.append(dataclasses.asdict(r))
                    print(f"{r.pool}: ready in {r.surge_s:.1f} s, drained in {r.drain_s:.1f} s"
                          f"{'' if r.idle else ' (stopped busy)'}", flush=True)
                print(f"  {len(counts['completed']) - before} streams completed while the {pool} pool rolled", flush=True)
            time.sleep(5)
            stop.set()
            for t in threads:
                t.join(130)
    finally:
        cluster.stop()
    print(f"completed {len(counts['completed'])}, failed {len(counts['failed'])} {counts['failed'][:5]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"processor": info, "clients": args.clients, "max_tokens": args.max_tokens,
                                        "replaced": results, "completed": len(counts["completed"]),
                                        "failed": counts["failed"]}, indent=1) + "\n")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

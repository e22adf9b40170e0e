"""Streamed KV transfer against the whole-prompt transfer, through the real cluster.

    .venv/bin/python benchmarks/streamed_kv.py            # ~5 min; --backend tcp for the tcp path

Two arms that differ in one setting, ``stream_kv_min_tokens`` (0 against 1): a local cluster
of 1 prefill + 1 decode worker (bfloat16, one thread each, each pinned to a core of its own,
NIXL), prompts computed in chunks of ``--chunk`` tokens (``max_num_batched_tokens``, the same
in both arms). Greedy requests with random 2048-token prompts, one at a time, 3 output tokens.
The arms alternate, a fresh cluster each time (``--rounds``), so drift of the machine's speed
falls on both.

Per request it records, at the client: TTFT, and the gap from the first token (the prefill
worker's answer, i.e. the end of prefill) to the second (the decode worker's first step, which
needs the whole KV). From the decode worker's own /metrics
(``pdserve:worker_kv_transfer_seconds``): the wait for the KV once its last read started, the
whole read for a whole-prompt transfer, the read of the blocks not yet read for a streamed one.
Prints medians and the ratios streamed / whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

import grpc
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ttft_transfer import decode_stats, one  # noqa: E402
from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.protos import pdserve_pb2_grpc  # noqa: E402
from pdserve.router.limits import RouterLimits  # noqa: E402

KEYS = ("ttft", "second", "transfer", "wait")


def wait_sum(metrics_address: str) -> float:
    """The decode worker's ``pdserve:worker_kv_transfer_seconds`` sum (seconds, all reads)."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:worker_kv_transfer_seconds_sum"))


def measured(stub, decode_address: str, metrics_address: str, tokens: int, seed: int) -> dict:
    before = wait_sum(metrics_address)
    run = one(stub, decode_address, tokens, seed)
    return {**run, "wait": wait_sum(metrics_address) - before}


def run_arm(stream: bool, args, seeds: list[int], bar) -> list[dict]:
    engine = EngineConfig(cache=CacheConfig(memory_budget_bytes=512 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk))
    limits = RouterLimits(stream_kv_min_tokens=1 if stream else 0)
    cluster = LocalCluster(ClusterConfig(engine=engine, grpc_port=0, http_port=None, kv_transfer_backend=args.backend,
                                         threads_per_worker=1, router_limits=limits))
    runs = []
    try:
        cluster.start()
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            decode = cluster.decode_addresses[0]
            metrics_address = decode_stats(decode).metrics_address
            for warm in range(2):  # metadata exchange, first reads, the kernels' first calls
                one(stub, decode, args.tokens, seed=warm)
            for seed in seeds:
                runs.append(measured(stub, decode, metrics_address, args.tokens, seed))
                bar.update(1)
    finally:
        cluster.stop()
    return runs


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of both arms")
    ap.add_argument("--requests", type=int, default=5, help="requests per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "streamed_kv.json")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"whole": [], "streamed": []}
    with tqdm(total=2 * args.rounds * args.requests, desc="streamed vs whole KV") as bar:
        for r in range(args.rounds):
            seeds = [1000 * (r + 1) + i for i in range(args.requests)]  # the same prompts in both arms
            for name in ("whole", "streamed") if r % 2 == 0 else ("streamed", "whole"):
                results[name] += run_arm(name == "streamed", args, seeds, bar)
    med = {name: {k: statistics.median(x[k] for x in runs) for k in KEYS} for name, runs in results.items()}
    print(f"\n{args.tokens}-token prompts, chunks of {args.chunk}, backend {args.backend}; medians of "
          f"{args.rounds * args.requests} requests per arm\n")
    print("| transfer | TTFT ms | end of prefill -> 2nd token ms | KV wait from the last read ms | all reads ms |")
    print("|---|---:|---:|---:|---:|")
    for name in ("whole", "streamed"):
        m = med[name]
        print(f"| {name} | {m['ttft'] * 1e3:.1f} | {m['second'] * 1e3:.1f} | {m['wait'] * 1e3:.2f} | "
              f"{m['transfer'] * 1e3:.2f} |")
    w, s = med["whole"], med["streamed"]
    print(f"| streamed / whole | {s['ttft'] / w['ttft']:.2f}x | {s['second'] / w['second']:.2f}x | "
          f"{s['wait'] / w['wait']:.2f}x | {s['transfer'] / w['transfer']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                    "medians": med}, indent=2))


if __name__ == "__main__":
    main()

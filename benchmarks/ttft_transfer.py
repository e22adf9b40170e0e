"""How much of time to first token the KV transfer takes, through the real cluster.

    .venv/bin/python benchmarks/ttft_transfer.py

Starts a local cluster (1 prefill + 1 decode worker, NIXL), sends greedy requests with random
prompts of 128, 512 and 2048 tokens one at a time, and reads from the decode worker's
counters how long each NIXL read took. pdserve streams the first token before the transfer
starts, so the transfer is not inside TTFT at all; it delays the second token instead. The
table shows both: transfer / TTFT (the share the issue asks for) and the first-to-second
token gap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402


def decode_stats(address: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.DecodeWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)


def one(stub, decode_address: str, length: int, seed: int) -> dict:
    ids = torch.randint(100, 49000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    before = decode_stats(decode_address)
    req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids),
                                      sampling=pdserve_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    t0 = time.perf_counter()
    times = [time.perf_counter() - t0 for r in stub.Generate(req, timeout=300) if r.token_ids]
    after = decode_stats(decode_address)
    return {"ttft": times[0], "second": times[1] - times[0],
            "transfer": after.kv_transfer_seconds - before.kv_transfer_seconds,
            "bytes": after.kv_transfer_bytes - before.kv_transfer_bytes}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--out", type=Path, default=ROOT / ".bench" / "ttft_transfer.json")
    args = ap.parse_args()
    cluster = LocalCluster(ClusterConfig(engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=512 << 20)),
                                         grpc_port=0, kv_transfer_backend=args.backend))
    rows = []
    try:
        cluster.start()
        with grpc.insecure_channel(cluster.address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            one(stub, cluster.decode_addresses[0], 64, seed=0)  # warm-up: metadata exchange, first read
            with tqdm(total=len(args.lengths) * args.repeats, desc="ttft vs transfer") as bar:
                for length in args.lengths:
                    runs = []
                    for r in range(args.repeats):
                        runs.append(one(stub, cluster.decode_addresses[0], length, seed=length * 100 + r))
                        bar.update(1)
                    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                    rows.append({"prompt_tokens": length, **med})
    finally:
        cluster.stop()
    print(f"backend {args.backend}; medians of {args.repeats} requests\n")
    print("| prompt tokens | TTFT ms | KV transfer ms | KV MB | transfer / TTFT | GB/s | 1st->2nd token ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['ttft'] * 1e3:.1f} | {r['transfer'] * 1e3:.2f} | {r['bytes'] / 1e6:.1f} | "
              f"{r['transfer'] / r['ttft'] * 100:.1f}% | {r['bytes'] / r['transfer'] / 1e9:.2f} | {r['second'] * 1e3:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""What mTLS on the internal plane costs on the gRPC path: TPOT with and without it, same run.

    .venv/bin/python benchmarks/mtls_tpot.py [--requests 8] [--tokens 48]

Starts two clusters side by side in one Ray (1 prefill + 1 decode worker each, default model),
one plaintext inside, one with mTLS (a CA from pdserve/cluster/certs.py), and sends the same greedy
requests to them in turn, one at a time, A B A B ..., so that the machine's noise falls on
both alike. TPOT is measured by the client: (last token time - first token time) / (tokens -
1); every decoded token crosses decode worker -> router over the internal channel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.certs import issue, make_ca  # noqa: E402
from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402
from pdserve.wire import tls  # noqa: E402


def tpot(stub, tokens: int, seed: int) -> float:
    req = pdserve_pb2.GenerateRequest(text=f"Story number {seed}: once upon a time",
                                      sampling=pdserve_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True))
    times, count = [], 0
    for r in stub.Generate(req, timeout=300):
        if r.token_ids:
            times.append(time.perf_counter())
            count += len(r.token_ids)
    return (times[-1] - times[0]) / (count - 1)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    certs = Path(tempfile.mkdtemp(prefix="pdserve-certs-"))
    ca = make_ca(certs)
    router = issue(ca, certs, "router")
    internal = tls.load(str(router.cert), str(router.key), str(ca.cert), prefix="tls")
    base = dict(engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=128 << 20)), num_prefill=1, num_decode=1,
                grpc_port=0, http_port=None, threads_per_worker=1, supervise_interval_s=None)
    clusters = {"plaintext": LocalCluster(ClusterConfig(**base)),
                "mTLS": LocalCluster(ClusterConfig(**base, tls=internal))}
    results: dict[str, list[float]] = {name: [] for name in clusters}
    try:
        for c in clusters.values():
            c.start()
        channels = {name: grpc.insecure_channel(c.address) for name, c in clusters.items()}
        stubs = {name: pdserve_pb2_grpc.GenerationStub(ch) for name, ch in channels.items()}
        for stub in stubs.values():
            tpot(stub, 8, seed=-1)  # warm-up: channels, NIXL metadata, first read
        for i in range(args.requests):
            for name, stub in stubs.items():
                results[name].append(tpot(stub, args.tokens, seed=i))
    finally:
        for c in reversed(list(clusters.values())):  # the first one started Ray and shuts it down
            c.stop()
    print(f"{args.requests} requests x {args.tokens} tokens each, alternating, one at a time\n")
    print("| internal plane | TPOT median ms | TPOT mean ms | min | max |")
    print("|---|---|---|---|---|")
    for name, xs in results.items():
        print(f"| {name} | {statistics.median(xs) * 1e3:.1f} | {statistics.mean(xs) * 1e3:.1f} | "
              f"{min(xs) * 1e3:.1f} | {max(xs) * 1e3:.1f} |")


if __name__ == "__main__":
    main()

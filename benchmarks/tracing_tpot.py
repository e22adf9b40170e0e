"""What tracing costs a request while it is on: TPOT and TTFT with ``--otlp-traces-endpoint``
set and without it, same run.

    .venv/bin/python benchmarks/tracing_tpot.py [--requests 12] [--tokens 48]

Starts two clusters side by side in one Ray (1 prefill + 1 decode worker each, default model,
bfloat16): one untraced, one whose router and workers export every span over OTLP/gRPC to a
receiver in this process (the ``TraceService`` of opentelemetry-proto, which counts what it is
sent). The same greedy requests go to each in turn, one at a time, A B A B ..., so that the
machine's noise falls on both alike. TPOT is measured by the client: (last token time - first
token time) / (tokens - 1); TTFT from the call to the first token. The receiver's span count
shows the traced cluster did export (about a dozen spans per request).

The cost while tracing is off is ``benchmarks/tracing_off.py``'s: the guards alone.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.config import ClusterConfig  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc  # noqa: E402


class SpanCounter:
    """An OTLP/gRPC trace endpoint that counts the spans it is sent."""

    def __init__(self, port: int):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        counter = self
        self.spans = 0
        self.lock = threading.Lock()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with counter.lock:
                    counter.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(stub, tokens: int, seed: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one greedy request."""
    req = pdserve_pb2.GenerateRequest(text=f"Story number {seed}: once upon a time",
                                      sampling=pdserve_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True))
    start, times, count = time.perf_counter(), [], 0
    for r in stub.Generate(req, timeout=300):
        if r.token_ids:
            times.append(time.perf_counter())
            count += len(r.token_ids)
    return times[0] - start, (times[-1] - times[0]) / (count - 1)


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a nicety
        def tqdm(xs, **_):
            return xs
    port = free_port()
    base = dict(engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=128 << 20)), num_prefill=1, num_decode=1,
                grpc_port=0, http_port=None, threads_per_worker=1, supervise_interval_s=None)
    clusters = {"off": LocalCluster(ClusterConfig(**base)),
                "on": LocalCluster(ClusterConfig(**base, otlp_traces_endpoint=f"127.0.0.1:{port}"))}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in clusters}
    counter = None
    try:
        for c in clusters.values():
            c.start()
        counter = SpanCounter(port)  # after Ray: its processes fork from a process without gRPC threads
        stubs = {name: pdserve_pb2_grpc.GenerationStub(grpc.insecure_channel(c.address))
                 for name, c in clusters.items()}
        for stub in stubs.values():
            timed(stub, 8, seed=-1)  # warm-up: channels, NIXL metadata, the exporter's connection
        for i in tqdm(range(args.requests), desc="requests (off, on)", unit="pair"):
            for name, stub in stubs.items():
                results[name].append(timed(stub, args.tokens, seed=i))
        time.sleep(2.0)  # the batch span processors export within a second or so
    finally:
        for c in reversed(list(clusters.values())):  # the first one started Ray and shuts it down
            c.stop()
        if counter is not None:
            counter.server.stop(0)
    print(f"\n{args.requests} requests x {args.tokens} tokens each, alternating, one at a time; "
          f"the traced cluster exported {counter.spans} spans\n")
    print("| tracing | TTFT median ms | TPOT median ms | TPOT mean ms | TPOT min | TPOT max |")
    print("|---|---|---|---|---|---|")
    for name, xs in results.items():
        ttft, tpot = [x[0] for x in xs], [x[1] for x in xs]
        print(f"| {name} | {statistics.median(ttft) * 1e3:.1f} | {statistics.median(tpot) * 1e3:.2f} | "
              f"{statistics.mean(tpot) * 1e3:.2f} | {min(tpot) * 1e3:.2f} | {max(tpot) * 1e3:.2f} |")
    on, off = (statistics.median(x[1] for x in results[k]) for k in ("on", "off"))
    print(f"\nTPOT on / off: {on / off:.3f}x")


if __name__ == "__main__":
    main()

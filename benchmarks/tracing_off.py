"""What tracing costs a request while it is off (no ``--otlp-traces-endpoint``).

    .venv/bin/python benchmarks/tracing_off.py [--tokens 128] [--chunks 4] [--repeats 7]

With no endpoint every process runs the off path of ``pdserve.wire.tracing``: a request meets
a fixed number of guards (``tracing.enabled()``, ``spans is None``, the helpers that return at
their first line, an empty ``metadata=`` mapping) and, per output token, one ``is None`` test in
the router and one in the decode worker. This replays exactly those calls, with the real
helpers, for one request of ``--tokens`` output tokens and ``--chunks`` prefill chunks, and
times them against the same loop with the guards taken out (the code before tracing). It also
checks that nothing of OpenTelemetry was imported on the way.

The per-request difference is then set against the time a request takes anyway: one decode
step of one token is tens of milliseconds on a CPU (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pdserve.wire import tracing  # noqa: E402


class _Stub:
    def Prefill(self, request, timeout=None, metadata=None):
        return request


def off_request(tokens: int, chunks: int, stub=_Stub()) -> None:
    """The off path's guards, as many as one request meets across router and workers."""
    spans = None  # router: service.run, request_spans.start_request
    if tracing.enabled():
        raise AssertionError("tracing is on")
    for _ in range(2):  # router: prefill and decode calls (route + call spans)
        route = spans.route("prefill") if spans is not None else None
        tracing.end_span(route)
        span = spans.call("Prefill", "") if spans is not None else None
        stub.Prefill(None, timeout=1.0, **tracing.metadata_kwargs(span))
        tracing.end_span(span)
    tracing.add_event(None, "kv_arrived")  # router: the decode call's KV notice
    if spans is not None:  # router: the attempt's start and end
        spans.start_attempt(0, "remote", 1)
    if spans is not None:
        spans.end_attempt()
    chunk_list = [] if tracing.enabled() else None  # prefill worker: its record, its span
    if tracing.enabled():
        raise AssertionError
    for _ in range(chunks):
        if chunk_list is not None:
            chunk_list.append(None)
    if chunk_list is not None:
        pass
    tracing.end_span(None)  # prefill worker: _end_spans
    decode = None if not tracing.enabled() else object()  # decode worker: the call's spans
    for _ in range(tokens):
        if spans is not None:  # router: each response
            pass
        if decode is not None:  # decode worker: each output
            pass
    if decode is not None or spans is not None:
        pass


def baseline_request(tokens: int, chunks: int, stub=_Stub()) -> None:
    """The same work without the guards: the stub calls and the loops."""
    for _ in range(2):
        stub.Prefill(None, timeout=1.0)
    for _ in range(chunks):
        pass
    for _ in range(tokens):
        pass


def per_request_ns(fn, tokens: int, chunks: int, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn(tokens, chunks)
    return (time.perf_counter_ns() - start) / n


def processor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no avx512_bf16 / amx_bf16'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20000, help="requests per timing")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tracing.configure(None, "bench")
    off, base = [], []
    for _ in range(args.repeats):  # alternating, so that the machine's load falls on both alike
        off.append(per_request_ns(off_request, args.tokens, args.chunks, args.requests))
        base.append(per_request_ns(baseline_request, args.tokens, args.chunks, args.requests))
    imported = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    off_ns, base_ns = statistics.median(off), statistics.median(base)
    print(f"processor: {processor()}")
    print(f"one request, {args.tokens} output tokens, {args.chunks} prefill chunks, median of {args.repeats}:")
    print(f"  off path   {off_ns / 1000:8.2f} us per request")
    print(f"  no tracing {base_ns / 1000:8.2f} us per request")
    print(f"  cost       {(off_ns - base_ns) / 1000:8.2f} us per request, {(off_ns - base_ns) / args.tokens:.1f} ns "
          f"per output token")
    print(f"opentelemetry modules imported: {imported or 'none'}")


if __name__ == "__main__":
    main()

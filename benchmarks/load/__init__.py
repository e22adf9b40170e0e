"""The project's load generator (issue 14): streamed completions against any OpenAI-compatible
server, open- or closed-loop, with TTFT / TPOT / ITL percentiles, throughput and goodput.
``benchmarks/loadgen.py`` is its command line; other benchmarks call ``run``."""

from benchmarks.load.metrics import RequestRecord, Summary, goodput, meets_slo, percentile, summarize
from benchmarks.load.runner import LoadError, Results, run, run_async
from benchmarks.load.workload import (SLO, Arrivals, Lengths, Request, SharedPrefix, WorkloadError, WorkloadSpec,
                                      build_requests, parse_lengths, send_offsets)

__all__ = ["SLO", "Arrivals", "Lengths", "LoadError", "Request", "RequestRecord", "Results", "SharedPrefix",
           "Summary", "WorkloadError", "WorkloadSpec", "build_requests", "goodput", "meets_slo", "parse_lengths",
           "percentile", "run", "run_async", "send_offsets", "summarize"]

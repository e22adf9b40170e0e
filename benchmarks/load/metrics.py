"""Per-request latencies and the run's summary: pure functions over what the client recorded,
so they are unit-tested without a server.

Definitions (those of ``vllm bench serve`` and DistServe):
- TTFT: send to the first streamed chunk that carries output.
- TPOT: (end - first chunk) / (output tokens - 1), per request; undefined for one token.
- ITL: the gaps between consecutive output chunks, pooled over all requests.
- E2EL: send to the end of the stream.
- goodput: completed requests whose TTFT and TPOT both meet the SLO, per second of the run.
Percentiles interpolate linearly between order statistics (numpy's default, as vLLM's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.load.workload import SLO

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the run's start."""

    prompt_tokens: int
    output_tokens: int
    sent: float
    chunk_times: tuple[float, ...]  # arrival of each chunk that carried output
    end: float
    error: str | None = None
    retry_after_s: float | None = None  # a refusal's Retry-After, when it had one

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def ttft(r: RequestRecord) -> float | None:
    return r.chunk_times[0] - r.sent if r.chunk_times else None


def tpot(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    if not r.chunk_times or r.output_tokens < 2:
        return None
    return (r.end - r.chunk_times[0]) / (r.output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def e2el(r: RequestRecord) -> float:
    return r.end - r.sent


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: list[float], qs: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    """mean and percentiles, in milliseconds, of values in seconds (NaN when there are none)."""
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{q:g}": percentile(ms, q) for q in qs})
    return out


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """DistServe's attainment: completed, TTFT within its SLO, and TPOT within its SLO (a
    one-token request has no TPOT and is judged on TTFT alone)."""
    if not r.ok:
        return False
    t, p = ttft(r), tpot(r)
    return t * 1000 <= slo.ttft_ms and (p is None or p * 1000 <= slo.tpot_ms)


def goodput(records: list[RequestRecord], duration_s: float, slo: SLO) -> float:
    """Requests per second that meet both SLOs."""
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    return sum(meets_slo(r, slo) for r in records) / duration_s


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    req_s: float
    output_tok_s: float
    prompt_tok_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    goodput_req_s: float | None  # None without an SLO
    slo_attainment: float | None  # share of all requests (failed ones count as missed)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    """The run's throughput and latency distributions over its completed requests."""
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    tpots = [p for p in map(tpot, done) if p is not None]
    return Summary(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        req_s=len(done) / duration_s,
        output_tok_s=sum(r.output_tokens for r in done) / duration_s,
        prompt_tok_s=sum(r.prompt_tokens for r in done) / duration_s,
        ttft_ms=distribution_ms([ttft(r) for r in done]), tpot_ms=distribution_ms(tpots),
        itl_ms=distribution_ms([g for r in done for g in itls(r)]), e2el_ms=distribution_ms([e2el(r) for r in done]),
        goodput_req_s=goodput(records, duration_s, slo) if slo else None,
        slo_attainment=(sum(meets_slo(r, slo) for r in records) / len(records)) if slo and records else None)

"""What a simulation reports, in the serving benchmark's terms: TTFT, TPOT and ITL
percentiles, and goodput at an SLO as DistServe defines it (requests per second that meet
both the TTFT and the TPOT SLO; a request that failed or never finished meets neither)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class CacheStats:
    """Where each request's prompt came from at its first prefill: computed, the worker's prefix
    cache, or the KV tier below it (``pdserve.planner.prefix_cache``); and the tiers' counts."""

    prompt_tokens: np.ndarray  # (N,)
    device_hit: np.ndarray  # (N,) tokens from the worker's prefix cache
    tier_hit: np.ndarray  # (N,) tokens loaded from its host's KV tier
    revisit: np.ndarray  # (N,) bool: its prefix was seen before in the trace (by arrival)
    tier_bytes: int = 0  # each host's tier (0: none)
    hosts: int = 0
    blocks_offloaded: int = 0
    blocks_loaded: int = 0

    def shares(self, only: np.ndarray | None = None) -> tuple[float, float]:
        """(share of prompt tokens from the prefix cache, share from the tier) over the requests
        ``only`` selects (None: all) that got their first token."""
        pick = slice(None) if only is None else only
        total = self.prompt_tokens[pick].sum()
        if total == 0:
            return 0.0, 0.0
        return float(self.device_hit[pick].sum() / total), float(self.tier_hit[pick].sum() / total)


@dataclass
class SimResult:
    """Per-request times (NaN where a request never got there) and the ITL histogram."""

    arrival: np.ndarray  # (N,)
    first_token: np.ndarray  # (N,)
    finish: np.ndarray  # (N,)
    output_tokens: np.ndarray  # (N,)
    itl_values: np.ndarray  # (M,) one inter-token latency per decode step kind
    itl_weights: np.ndarray  # (M,) how many tokens saw it
    duration_s: float
    gpus: int
    preemptions: int = 0
    failed: int = 0
    pool_history: dict = field(default_factory=dict)  # autoscaling: pool -> [(t, replicas, signal)]
    cache: CacheStats | None = None  # prefix cache and KV tier hits

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Mean time per output token after the first; 0 for one-token answers."""
        steps = np.maximum(self.output_tokens - 1, 1)
        return np.where(self.output_tokens > 1, (self.finish - self.first_token) / steps, 0.0)

    @property
    def completed(self) -> int:
        return int(np.isfinite(self.finish).sum())

    def percentiles(self) -> dict[str, dict[str, float]]:
        """{"ttft_s": {"p50": ...}, "tpot_s": ..., "itl_s": ...} over completed requests."""
        done = np.isfinite(self.finish)
        out = {name: _pcts(values[done]) for name, values in (("ttft_s", self.ttft), ("tpot_s", self.tpot))}
        out["itl_s"] = weighted_percentiles(self.itl_values, self.itl_weights)
        return out

    def attainment(self, slo: Slo) -> float:
        """Share of all requests that met both SLOs."""
        if len(self.arrival) == 0:
            return 1.0
        ok = np.isfinite(self.finish) & (self.ttft <= slo.ttft_s) & (self.tpot <= slo.tpot_s)
        return float(ok.sum()) / len(self.arrival)

    def goodput_rps(self, slo: Slo) -> float:
        return self.attainment(slo) * len(self.arrival) / max(self.duration_s, 1e-9)


def revisits(requests, arrival: np.ndarray) -> np.ndarray:
    """(N,) bool: request i's prefix (``prefix_hash``) came in an earlier arrival (ties: by index)."""
    out = np.zeros(len(requests), dtype=bool)
    seen: set[str] = set()
    for i in np.argsort(np.where(np.isnan(arrival), np.inf, arrival), kind="stable"):  # unsent (NaN): last
        h = requests[i].prefix_hash
        out[i] = h is not None and h in seen
        if h is not None:
            seen.add(h)
    return out


def _pcts(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}


def weighted_percentiles(values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Percentiles of ``values`` where each value occurs ``weights`` times."""
    if len(values) == 0 or weights.sum() == 0:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    order = np.argsort(values)
    v, cum = values[order], np.cumsum(weights[order])
    return {f"p{p}": float(v[min(np.searchsorted(cum, p / 100 * cum[-1]), len(v) - 1)]) for p in PERCENTILES}


def first_crossing(xs, ys, target: float) -> float | None:
    """Where the curve (xs, ys) first crosses ``target``, linearly interpolated between the two
    points around it (DistServe's ``find_intersection``: attainment against rate or SLO scale,
    crossing 90%). None if it never crosses."""
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if (y0 < target) != (y1 < target):
            return x0 + (target - y0) * (x1 - x0) / (y1 - y0)
    return None

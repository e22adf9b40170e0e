"""Synthetic workloads: arrivals (Poisson, or a bursty day) and length distributions (fixed,
or a long-tailed chat mix), as ``TraceRequest`` lists. Seeded, so a plan is reproducible."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pdserve.planner.trace import TraceError, TraceRequest


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths. ``sigma`` 0 gives fixed lengths; above 0 a log-normal around
    the means (the long tail of chat traffic: ShareGPT prompts and answers are log-normal-ish)."""

    prompt_mean: int
    output_mean: int
    sigma: float = 0.0
    max_len: int = 8192
    # Pairs with prompt + output >= max_total are dropped and drawn again, as a data set is
    # filtered to a model's context (DistServe keeps ShareGPT pairs under OPT's 2048 tokens).
    # None: no filter (each length is only clipped to max_len).
    max_total: int | None = None

    def __post_init__(self) -> None:
        for key in ("prompt_mean", "output_mean"):
            if getattr(self, key) < 1:
                raise TraceError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.sigma < 0:
            raise TraceError("sigma", f"must be >= 0, got {self.sigma}")
        if self.max_total is not None and self.max_total < 3:
            raise TraceError("max_total", f"must be >= 3 (a prompt and an output token), got {self.max_total}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.max_total is None:
            return self._draw(self.prompt_mean, n, rng), self._draw(self.output_mean, n, rng)
        prompts, outputs = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        while len(prompts) < n:
            p, o = self._draw(self.prompt_mean, n, rng), self._draw(self.output_mean, n, rng)
            keep = p + o < self.max_total
            prompts, outputs = np.concatenate([prompts, p[keep]]), np.concatenate([outputs, o[keep]])
        return prompts[:n], outputs[:n]

    def _draw(self, mean: int, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.sigma == 0:
            return np.full(n, mean, dtype=np.int64)
        mu = np.log(mean) - self.sigma ** 2 / 2  # keeps the mean at ``mean``
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, n)), 1, self.max_len).astype(np.int64)


# DistServe's chatbot workload (ShareGPT): about 755 prompt and 200 output tokens on average.
CHAT = LengthMix(755, 200, sigma=0.8, max_len=4096)


def poisson(rate: float, duration_s: float, lengths: LengthMix, seed: int = 0) -> list[TraceRequest]:
    """Open-loop Poisson arrivals at ``rate`` requests/s for ``duration_s`` seconds."""
    if rate <= 0 or duration_s <= 0:
        raise TraceError("rate" if rate <= 0 else "duration_s", f"must be > 0, got {rate if rate <= 0 else duration_s}")
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * duration_s)
    times = np.sort(rng.uniform(0, duration_s, n))
    return _build(times, lengths, rng)


def shifting(phases: list[tuple[float, float, LengthMix]], seed: int = 0) -> list[TraceRequest]:
    """Poisson phases one after another: ``(duration_s, rate, lengths)`` each, e.g. long prompts
    with short answers, then short prompts with long answers, then back (a day's mix moving)."""
    out, start = [], 0.0
    for i, (duration_s, rate, lengths) in enumerate(phases):
        out += [dataclasses.replace(r, t=r.t + start) for r in poisson(rate, duration_s, lengths, seed + i)]
        start += duration_s
    return out


def bursty_day(mean_rate: float, lengths: LengthMix, duration_s: float = 86400.0, bursts: int = 12,
               burst_x: float = 3.0, burst_s: float = 600.0, seed: int = 0) -> list[TraceRequest]:
    """A day of traffic: a diurnal curve (trough at 04:00 at 0.2x, peak at 16:00 at 1.8x the mean)
    with ``bursts`` random bursts of ``burst_x`` times the curve, each ``burst_s`` long.

    Arrivals are a non-homogeneous Poisson process, drawn by thinning.
    """
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.uniform(0, duration_s - burst_s, bursts))
    peak = mean_rate * 1.8 * burst_x
    n = rng.poisson(peak * duration_s)
    times = np.sort(rng.uniform(0, duration_s, n))
    keep = rng.uniform(0, peak, n) < demand_rate(times, mean_rate, starts, burst_x, burst_s, duration_s)
    return _build(times[keep], lengths, rng)


def demand_rate(t: np.ndarray, mean_rate: float, burst_starts: np.ndarray, burst_x: float, burst_s: float,
                duration_s: float = 86400.0) -> np.ndarray:
    """The arrival rate of ``bursty_day`` at times ``t`` (for plotting demand)."""
    phase = 2 * np.pi * (t / duration_s - 16 / 24)
    rate = mean_rate * (1.0 + 0.8 * np.cos(phase))
    in_burst = np.zeros_like(t, dtype=bool)
    for s in burst_starts:
        in_burst |= (t >= s) & (t < s + burst_s)
    return np.where(in_burst, rate * burst_x, rate)


def shared_prefix(rate: float, duration_s: float, lengths: LengthMix, num_prefixes: int, prefix_tokens: int,
                  seed: int = 0, order: str = "random") -> list[TraceRequest]:
    """Poisson arrivals whose prompts start with one of ``num_prefixes`` shared system prompts of
    ``prefix_tokens`` tokens (``lengths`` gives what follows it): each drawn at random (``order``
    "random"), or taken in turn, every prefix once before any comes again ("cyclic": a working
    set revisited, the order in which a least-recently-used cache smaller than it never hits)."""
    if order not in PREFIX_ORDERS:
        raise TraceError("prefix_order", f"must be one of {', '.join(PREFIX_ORDERS)}, got {order!r}")
    for key, value in (("num_prefixes", num_prefixes), ("prefix_tokens", prefix_tokens)):
        if value < 1:
            raise TraceError(key, f"must be >= 1, got {value}")
    base = poisson(rate, duration_s, lengths, seed)
    if order == "cyclic":
        which = np.arange(len(base)) % num_prefixes
    else:
        which = np.random.default_rng(seed + 1).integers(0, num_prefixes, len(base))
    return [TraceRequest(r.t, r.prompt_tokens + prefix_tokens, r.output_tokens, f"prefix-{w}", prefix_tokens)
            for r, w in zip(base, which)]


PREFIX_ORDERS = ("random", "cyclic")


def _build(times: np.ndarray, lengths: LengthMix, rng: np.random.Generator) -> list[TraceRequest]:
    prompts, outputs = lengths.sample(len(times), rng)
    return [TraceRequest(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs)]

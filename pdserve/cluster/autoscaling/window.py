"""What a policy sees: samples of one pool's signals over time, and the trailing window of them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


class MetricsError(ValueError):
    """A sample or a window is malformed; ``field`` names the offending value."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class PoolSample:
    """One observation of one pool at time ``t`` (seconds, any monotonic clock).

    A pool reads only its own signals: prefill ``queued_prompt_tokens`` and ``ttft_p90_s``,
    decode ``kv_usage`` and ``itl_p90_s``; the others stay at their defaults. A latency is None
    when no request finished in the sample's interval: no evidence either way.
    """

    t: float
    replicas: int  # workers ready and taking requests (draining ones excluded)
    queued_prompt_tokens: int = 0  # prefill: prompt tokens waiting, summed over the pool
    ttft_p90_s: float | None = None  # prefill: time to first token, p90
    kv_usage: float = 0.0  # decode: used KV blocks over total, mean over workers, 0..1
    itl_p90_s: float | None = None  # decode: inter-token latency, p90

    def __post_init__(self) -> None:
        if not math.isfinite(self.t):
            raise MetricsError("t", f"must be finite, got {self.t}")
        if self.replicas < 0:
            raise MetricsError("replicas", f"must be >= 0, got {self.replicas}")
        if self.queued_prompt_tokens < 0:
            raise MetricsError("queued_prompt_tokens", f"must be >= 0, got {self.queued_prompt_tokens}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise MetricsError("kv_usage", f"must be within [0, 1], got {self.kv_usage}")
        for name in ("ttft_p90_s", "itl_p90_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise MetricsError(name, f"must be >= 0 or None, got {value}")


@dataclass(frozen=True)
class MetricsWindow:
    """Samples of one pool, oldest first.

    Build it with ``trailing``: every sample of the last ``window_s`` seconds plus the one just
    before them, so that a full window's oldest sample is at or before its start and a window
    that has not yet seen ``window_s`` seconds of data is recognisably partial.
    """

    samples: tuple[PoolSample, ...]

    def __post_init__(self) -> None:
        for i in range(1, len(self.samples)):
            if self.samples[i].t < self.samples[i - 1].t:
                raise MetricsError(f"samples[{i}].t", f"must be >= samples[{i - 1}].t "
                                   f"({self.samples[i - 1].t}), got {self.samples[i].t}: samples go oldest first")

    @classmethod
    def trailing(cls, history: Sequence[PoolSample], now: float, window_s: float) -> MetricsWindow:
        """The window ending at ``now`` out of a longer ``history`` (oldest first)."""
        start = now - window_s
        first = 0
        for i, sample in enumerate(history):
            if sample.t <= start:
                first = i  # the latest sample at or before the start anchors the window
        return cls(tuple(s for s in history[first:] if s.t <= now))

    @property
    def latest(self) -> PoolSample | None:
        return self.samples[-1] if self.samples else None

    @property
    def oldest(self) -> PoolSample | None:
        return self.samples[0] if self.samples else None

    def span_s(self, now: float) -> float:
        """Seconds from the oldest sample to ``now``; 0 for an empty window."""
        return now - self.samples[0].t if self.samples else 0.0

"""Recent latencies seen at the router, for the autoscaler's SLO signals.

The Prometheus histograms keep every observation since start, in buckets; the autoscaler
needs the p90 of the last few seconds, exactly. A ``RecentLatencies`` keeps timestamped
observations for a bounded horizon and answers a quantile over any trailing window.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Callable


class RecentLatencies:
    """Observations of one latency (seconds) from the last ``horizon_s``, at most ``max_samples``."""

    def __init__(self, horizon_s: float = 300.0, max_samples: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        self.horizon_s = horizon_s
        self._clock = clock
        self._obs: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, value), oldest first

    def add(self, value: float) -> None:
        now = self._clock()
        self._obs.append((now, value))
        while self._obs and self._obs[0][0] < now - self.horizon_s:
            self._obs.popleft()

    def quantile(self, q: float, window_s: float) -> tuple[float | None, int]:
        """The ``q`` quantile (nearest rank) of the last ``window_s`` seconds' observations, and
        how many there were; (None, 0) when there were none: no evidence either way."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q: must be within (0, 1], got {q}")
        start = self._clock() - window_s
        values = sorted(v for _, v in itertools.takewhile(lambda obs: obs[0] > start, reversed(self._obs)))
        if not values:
            return None, 0
        return values[max(0, math.ceil(q * len(values)) - 1)], len(values)

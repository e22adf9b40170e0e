"""What a policy returns (``ScalingDecision``, with the inputs it used) and what the controller
remembers between decisions (``ScalerState``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from pdserve.cluster.autoscaling.window import MetricsWindow, PoolSample


@dataclass(frozen=True)
class SignalReading:
    """One signal aggregated over a window, against its target.

    ``mean`` drives scale-up (sustained load, not a spike); ``peak`` gates scale-down (every
    sample comfortably low). Both are None when no sample carried the signal (e.g. no request
    finished, so no latency): such a signal neither asks for more replicas nor blocks fewer.
    """

    name: str
    target: float
    mean: float | None
    peak: float | None

    @classmethod
    def over(cls, name: str, target: float, window: MetricsWindow,
             read: Callable[[PoolSample], float | None]) -> SignalReading:
        values = [v for v in (read(s) for s in window.samples) if v is not None]
        if not values:
            return cls(name, target, None, None)
        return cls(name, target, sum(values) / len(values), max(values))

    @property
    def mean_ratio(self) -> float | None:
        return None if self.mean is None else self.mean / self.target

    @property
    def peak_ratio(self) -> float | None:
        return None if self.peak is None else self.peak / self.target


@dataclass(frozen=True)
class DecisionInputs:
    """Everything a decision was based on, for the controller's log line and metrics."""

    replicas: int  # ready replicas in the latest sample
    samples: int  # samples in the window
    window_span_s: float  # oldest sample to now
    signals: tuple[SignalReading, ...] = ()

    @classmethod
    def of(cls, window: MetricsWindow, now: float, signals: tuple[SignalReading, ...] = ()) -> DecisionInputs:
        latest = window.latest
        return cls(latest.replicas if latest else 0, len(window.samples), window.span_s(now), signals)


@dataclass(frozen=True)
class ScalingDecision:
    """A pool's desired replica count, why, and from what.

    ``proposed`` is what the policy asked for; ``desired`` is what the guards let through
    (they differ when a guard holds or limits the change, and ``reason`` then says which).
    """

    pool: str
    current: int
    desired: int
    reason: str
    inputs: DecisionInputs
    proposed: int | None = None  # None: the policy's own desired (set by ``decide``)

    @property
    def action(self) -> str:
        """"up", "down" or "hold"."""
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"

    def held(self, reason: str) -> ScalingDecision:
        """This decision turned into a hold by a guard; the policy's wish stays in ``proposed``."""
        return dataclasses.replace(self, desired=self.current, reason=reason)

    def as_dict(self) -> dict[str, object]:
        """Flat values for a structured log line or metric labels."""
        out: dict[str, object] = {
            "pool": self.pool, "action": self.action, "current": self.current, "desired": self.desired,
            "proposed": self.proposed, "reason": self.reason, "samples": self.inputs.samples,
            "window_span_s": round(self.inputs.window_span_s, 3),
        }
        for s in self.inputs.signals:
            out[f"{s.name}_mean"], out[f"{s.name}_peak"], out[f"{s.name}_target"] = s.mean, s.peak, s.target
        return out


@dataclass(frozen=True)
class ScalerState:
    """What one pool's scaler remembers: the last desired count (a change is pending while the
    pool's ready replicas differ from it) and when it last scaled each way. Pure data; the
    controller keeps one per pool and replaces it with ``after`` following each decision."""

    desired: int | None = None  # None until the first change: the pool runs what it was started with
    last_scale_up_t: float | None = None
    last_scale_down_t: float | None = None

    @property
    def last_change_t(self) -> float | None:
        times = [t for t in (self.last_scale_up_t, self.last_scale_down_t) if t is not None]
        return max(times) if times else None

    def pending(self, replicas: int) -> bool:
        """True while actors are still starting or draining toward the last desired count."""
        return self.desired is not None and replicas != self.desired

    def after(self, decision: ScalingDecision, now: float) -> ScalerState:
        """The state following ``decision``, taken at ``now``."""
        if decision.action == "up":
            return ScalerState(decision.desired, now, self.last_scale_down_t)
        if decision.action == "down":
            return ScalerState(decision.desired, self.last_scale_up_t, now)
        return self

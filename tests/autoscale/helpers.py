"""Shared builders for autoscaling tests: samples, windows, and a small simulation that drives
``decide`` over a generated time series the way the controller will."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pdserve.cluster.autoscaling import MetricsWindow, PoolPolicyConfig, PoolSample, ScalerState, ScalingDecision, decide

# A load maps (t, ready replicas) to a sample's pool signals, e.g. {"kv_usage": 0.5}.
Load = Callable[[float, int], dict]


def steady_window(replicas: int, now: float, span_s: float, dt: float = 1.0, **signals) -> MetricsWindow:
    """Samples every ``dt`` seconds over ``span_s`` seconds ending at ``now``, all alike."""
    count = int(round(span_s / dt)) + 1
    return MetricsWindow(tuple(PoolSample(now - span_s + i * dt, replicas, **signals) for i in range(count)))


def prefill_load(total_queued_tokens: Callable[[float], float],
                 ttft_s: Callable[[float], float | None] = lambda t: None) -> Load:
    """Prefill: the queue is the pool's backlog (spread over its workers by ``decide``), TTFT as given."""
    return lambda t, n: {"queued_prompt_tokens": int(total_queued_tokens(t)), "ttft_p90_s": ttft_s(t)}


def decode_load(kv_demand: Callable[[float], float], itl_s: Callable[[float], float | None] = lambda t: None) -> Load:
    """Decode: ``kv_demand`` is the KV the running streams need, in single workers' caches;
    spread over n workers each is ``demand / n`` full (capped at a full cache)."""
    return lambda t, n: {"kv_usage": min(1.0, kv_demand(t) / n) if n else 0.0, "itl_p90_s": itl_s(t)}


@dataclass
class SimResult:
    decisions: list[tuple[float, ScalingDecision]] = field(default_factory=list)
    replicas: list[tuple[float, int]] = field(default_factory=list)  # ready replicas at each tick

    @property
    def changes(self) -> list[tuple[float, ScalingDecision]]:
        return [(t, d) for t, d in self.decisions if d.action != "hold"]

    def replicas_at(self, t: float) -> int:
        return [n for tick, n in self.replicas if tick <= t][-1]

    @property
    def final_replicas(self) -> int:
        return self.replicas[-1][1]


def simulate(pool: str, config: PoolPolicyConfig, load: Load, duration_s: float, *, dt: float = 1.0,
             start_replicas: int = 1, startup_s: float = 5.0, t0: float = 0.0) -> SimResult:
    """Run the controller loop for ``duration_s``: sample the pool every ``dt``, decide, and
    apply each change after ``startup_s`` (actors loading the model; a drained worker leaves
    the routing table at once). The pool starts already settled at ``start_replicas``."""
    result, history, state = SimResult(), [], ScalerState()
    ready, target, ready_at = start_replicas, start_replicas, None
    steps = int(round(duration_s / dt))
    for i in range(steps + 1):
        t = t0 + i * dt
        if ready_at is not None and t >= ready_at:
            ready, ready_at = target, None
        history.append(PoolSample(t, ready, **load(t, ready)))
        del history[:-int(2 * config.window_s / dt + 2)]  # older samples can no longer matter
        decision = decide(pool, MetricsWindow(tuple(history)), config, state, t)
        state = state.after(decision, t)
        if decision.action != "hold":
            target = decision.desired
            ready_at = t + (startup_s if decision.action == "up" else 0.0)
        result.decisions.append((t, decision))
        result.replicas.append((t, ready))
    return result

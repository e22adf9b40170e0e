"""The built-in policies: what each pool would like, from its signals alone.

A policy only proposes; ``decide`` applies the guards (full window, pending change, cooldowns,
step, bounds) to whatever a policy returns, built-in or a user's. Hysteresis lives here: the
up and down thresholds are a band around the target, and inside it a policy holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pdserve.cluster.autoscaling.decision import DecisionInputs, ScalerState, ScalingDecision, SignalReading
from pdserve.cluster.autoscaling.window import MetricsWindow

if TYPE_CHECKING:
    from pdserve.cluster.autoscaling.config import PoolPolicyConfig


def prefill_policy(pool: str, window: MetricsWindow, config: PoolPolicyConfig, state: ScalerState,
                   now: float) -> ScalingDecision:
    """Prefill scales on queued prompt tokens per worker (vs ``target``) and TTFT p90 (vs ``slo_s``)."""
    signals = (
        SignalReading.over("queued_prompt_tokens_per_worker", config.target, window,
                           lambda s: s.queued_prompt_tokens / s.replicas if s.replicas else None),
        SignalReading.over("ttft_p90_s", config.slo_s, window, lambda s: s.ttft_p90_s),
    )
    return threshold_policy(pool, window, config, now, signals)


def decode_policy(pool: str, window: MetricsWindow, config: PoolPolicyConfig, state: ScalerState,
                  now: float) -> ScalingDecision:
    """Decode scales on mean KV usage (vs ``target``) and ITL p90 (vs ``slo_s``)."""
    signals = (
        SignalReading.over("kv_usage", config.target, window, lambda s: s.kv_usage),
        SignalReading.over("itl_p90_s", config.slo_s, window, lambda s: s.itl_p90_s),
    )
    return threshold_policy(pool, window, config, now, signals)


def threshold_policy(pool: str, window: MetricsWindow, config: PoolPolicyConfig, now: float,
                     signals: tuple[SignalReading, ...]) -> ScalingDecision:
    """Up when ANY signal's window mean is above ``scale_up_threshold`` x its target; down when
    EVERY signal's window peak is below ``scale_down_threshold`` x its target; else hold.

    The first signal is the primary one, a per-worker load: the replicas proposed are those
    that would bring it back to the target (``ceil(n * ratio)``), at least one more or fewer.
    ``decide`` then caps the change at ``step``. Custom policies may reuse this with their own signals.
    """
    n = window.latest.replicas if window.latest else 0
    inputs = DecisionInputs.of(window, now, signals)
    up, down = config.scale_up_threshold, config.scale_down_threshold
    high = [s for s in signals if s.mean_ratio is not None and s.mean_ratio > up]
    if high:
        ratio = max(s.mean_ratio for s in high)
        desired = max(n + 1, math.ceil(n * ratio))
        why = "; ".join(f"{s.name} mean {_num(s.mean)} is {s.mean_ratio:.2f}x target {_num(s.target)} (> {up})"
                        for s in high)
        return ScalingDecision(pool, n, desired, f"up: {why}", inputs)
    if all(s.peak_ratio is None or s.peak_ratio < down for s in signals):
        primary = signals[0].peak_ratio if signals and signals[0].peak_ratio is not None else 0.0
        desired = min(n - 1, math.ceil(n * primary))
        why = ", ".join(_describe(s, "peak") for s in signals)
        return ScalingDecision(pool, n, max(desired, 0), f"down: every signal's peak < {down}x target ({why})", inputs)
    why = ", ".join(_describe(s, "mean") for s in signals)
    return ScalingDecision(pool, n, n, f"hold: within the band {down}..{up}x target ({why})", inputs)


def _describe(s: SignalReading, which: str) -> str:
    ratio = s.mean_ratio if which == "mean" else s.peak_ratio
    return f"{s.name} no data" if ratio is None else f"{s.name} {which} {ratio:.2f}x"


def _num(x: float) -> str:
    """Token counts in full (4096, not 4.1e+03), fractions and seconds to three digits."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"

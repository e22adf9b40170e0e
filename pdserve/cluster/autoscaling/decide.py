"""``decide``: one pool's policy, run behind the guards that keep autoscalers from flapping.

Guards, in order; the first that applies turns the policy's proposal into a hold:

1. stale: the latest sample is older than ``max_sample_age_s`` (the metrics pipe stalled).
2. pending: the pool's ready replicas differ from the last desired count (actors are still
   starting or draining); a new decision now would act on a pool that is mid-change.
3. bounds: a pool outside [min_replicas, max_replicas] goes straight to the bound, whatever the
   load says and with no cooldown (a bound is a promise of the config, not a reaction to load).
4. cold start: the window does not yet span ``window_s``.
5. settling: some sample in the window predates the last change or saw another replica count;
   a window must describe the pool as it is now.
6. step and bounds: a change is capped at ``step`` replicas and clamped to [min, max].
7. cooldown: ``scale_up_cooldown_s`` after any change before scaling up, the longer
   ``scale_down_cooldown_s`` after any change (a scale-up included) before scaling down.
"""

from __future__ import annotations

import dataclasses

from pdserve.cluster.autoscaling.config import PoolPolicyConfig, load_policy
from pdserve.cluster.autoscaling.decision import DecisionInputs, ScalerState, ScalingDecision
from pdserve.cluster.autoscaling.window import MetricsError, MetricsWindow


def decide(pool: str, window: MetricsWindow, config: PoolPolicyConfig, state: ScalerState,
           now: float) -> ScalingDecision:
    """The desired replica count of ``pool`` at ``now``. Pure: same inputs, same decision.

    ``window`` may hold more history than ``config.window_s``; only the trailing window counts.
    The caller records the decision with ``state.after(decision, now)`` and starts or drains
    actors toward ``decision.desired``.
    """
    if window.latest is not None and window.latest.t > now:
        raise MetricsError(f"samples[{len(window.samples) - 1}].t",
                           f"must be <= now ({now}), got {window.latest.t}: a sample from the future")
    window = MetricsWindow.trailing(window.samples, now, config.window_s)
    if window.latest is None:
        current = state.desired or 0
        return ScalingDecision(pool, current, current, "hold: no samples yet", DecisionInputs.of(window, now), current)
    proposal = _propose(pool, window, config, state, now)
    guarded = _guard(proposal, window, config, state, now)
    return guarded if guarded is not None else _limit(proposal, config, state, now)


def _propose(pool: str, window: MetricsWindow, config: PoolPolicyConfig, state: ScalerState,
             now: float) -> ScalingDecision:
    """The policy's wish, checked, with ``current`` and ``proposed`` set from the window."""
    decision = load_policy(config.policy)(pool, window, config, state, now)
    if not isinstance(decision, ScalingDecision):
        raise TypeError(f"policy {config.policy!r} returned {type(decision).__name__}, not a ScalingDecision")
    if isinstance(decision.desired, bool) or not isinstance(decision.desired, int):
        raise TypeError(f"policy {config.policy!r} returned desired={decision.desired!r}, not an int")
    return dataclasses.replace(decision, pool=pool, current=window.latest.replicas, proposed=decision.desired)


def _guard(p: ScalingDecision, window: MetricsWindow, config: PoolPolicyConfig, state: ScalerState,
           now: float) -> ScalingDecision | None:
    """Guards 1-5: a hold (or a move to a bound), or None when the policy may act."""
    latest, oldest = window.latest, window.oldest
    wish = f"(policy: {p.reason})"
    if now - latest.t > config.max_sample_age_s:
        return p.held(f"hold: stale, latest sample {now - latest.t:.1f} s old > max_sample_age_s "
                      f"{config.max_sample_age_s} {wish}")
    if state.pending(latest.replicas):
        return p.held(f"hold: pending change, {latest.replicas} replicas ready of {state.desired} desired {wish}")
    if p.current < config.min_replicas:
        return dataclasses.replace(p, desired=config.min_replicas,
                                   reason=f"up: {p.current} replicas < min_replicas {config.min_replicas}")
    if p.current > config.max_replicas:
        return dataclasses.replace(p, desired=config.max_replicas,
                                   reason=f"down: {p.current} replicas > max_replicas {config.max_replicas}")
    if window.span_s(now) < config.window_s:
        return p.held(f"hold: cold start, window spans {window.span_s(now):.1f} s of window_s {config.window_s} {wish}")
    last_change = state.last_change_t
    if any(s.replicas != latest.replicas for s in window.samples) or (
            last_change is not None and oldest.t < last_change):
        return p.held(f"hold: settling, the window still holds samples from before the last change {wish}")
    return None


def _limit(p: ScalingDecision, config: PoolPolicyConfig, state: ScalerState, now: float) -> ScalingDecision:
    """Guards 6-7 on a proposal that passed the others."""
    if p.desired == p.current:
        return p
    step = max(-config.step, min(config.step, p.desired - p.current))
    desired = max(config.min_replicas, min(config.max_replicas, p.current + step))
    if desired == p.current:
        bound = "max_replicas" if p.desired > p.current else "min_replicas"
        return p.held(f"hold: at {bound} {desired} (policy: {p.reason})")
    since = None if state.last_change_t is None else now - state.last_change_t
    cooldown_key = "scale_up_cooldown_s" if desired > p.current else "scale_down_cooldown_s"
    cooldown = getattr(config, cooldown_key)
    if since is not None and since < cooldown:
        return p.held(f"hold: {cooldown_key} {cooldown}, {since:.1f} s since the last change (policy: {p.reason})")
    limited = f" (limited to {desired} by step {config.step} and bounds)" if desired != p.desired else ""
    return dataclasses.replace(p, desired=desired, reason=p.reason + limited)

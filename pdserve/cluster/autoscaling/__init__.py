"""Per-pool autoscaling policies: pure functions from a window of pool metrics to a desired
replica count. No Ray, no I/O: the controller samples each pool, calls ``decide`` and acts.

    cfg = from_mapping(yaml_values.get("autoscaling", {}))        # {"prefill": ..., "decode": ...}
    window = MetricsWindow.trailing(history, now, cfg["prefill"].window_s)
    decision = decide("prefill", window, cfg["prefill"], state, now)
    state = state.after(decision, now)                            # then start or drain actors

Modules: ``window`` (PoolSample, MetricsWindow), ``config`` (PoolPolicyConfig, defaults,
policy loading), ``decision`` (ScalingDecision, ScalerState), ``policies`` (the built-in
prefill and decode policies), ``decide`` (the guards around any policy).

README section (for the lead to copy)
-------------------------------------

## Autoscaling

Each pool scales on its own signal, with its own settings under ``autoscaling.prefill`` and
``autoscaling.decode`` in the YAML config:

```yaml
autoscaling:
  prefill: {min_replicas: 1, max_replicas: 8, target: 4096, slo_s: 2.0}
  decode:  {max_replicas: 6, scale_down_cooldown_s: 120}
```

- **prefill** scales on the prompt tokens queued per worker (``target``) and on time to first
  token, p90 (``slo_s``). Long prompts pile up here.
- **decode** scales on the fraction of KV blocks in use, mean over workers (``target``) and on
  inter-token latency, p90 (``slo_s``). Long outputs and many streams pile up here.

A pool scales **up** when any signal's mean over the window is above ``scale_up_threshold`` x
its target, and **down** only when every signal's peak over the window is below
``scale_down_threshold`` x its target. A latency with no requests behind it counts as low.

| key | prefill | decode | why |
|---|---|---|---|
| ``min_replicas`` | 1 | 1 | a pool at zero reports no load, so nothing could scale it back up |
| ``max_replicas`` | 4 | 4 | a bound on spend; both pools must fit the cluster together |
| ``target`` | 4096 tokens/worker | 0.7 of KV | prefill: two steps of the default 2048-token budget queued; decode: headroom for running streams to grow before a full cache preempts them |
| ``slo_s`` | 2.0 (TTFT p90) | 0.2 (ITL p90) | a first token within ~2 s; 5 tokens/s, about reading speed |
| ``scale_up_threshold`` | 1.2 | 1.2 | noise of +-20% around the target changes nothing |
| ``scale_down_threshold`` | 0.5 | 0.5 | after 2 -> 1 the survivor carries at most the target: a scale-down never causes the next scale-up |
| ``window_s`` | 20 | 20 | ~20 samples and many requests: one long prompt is not "load" |
| ``scale_up_cooldown_s`` | 10 | 10 | a new worker's effect must show before the next step |
| ``scale_down_cooldown_s`` | 60 | 60 | reloading a worker removed on a short lull costs more than keeping it a minute; must be >= the up cooldown |
| ``step`` | 1 | 1 | signals lag the change that caused them; one at a time cannot overshoot much |
| ``max_sample_age_s`` | 5 | 5 | stale metrics (a stalled collector) never drive a decision |
| ``policy`` | built-in | built-in | ``"package.module:function"`` to plug in your own |

Guards that keep the autoscaler from flapping, applied to every policy, built-in or yours:
decisions only on a **full window** of samples all taken after the last change settled (no
cold-start samples); **one change in flight**: no decision while the pool's ready workers
differ from the last desired count; at most ``step`` replicas per decision; the **longer
delay before scaling down** (``scale_down_cooldown_s`` after any change); the hysteresis band;
and the bounds. A pool outside [min, max] goes straight to the bound.

A custom policy is a function ``(pool, window, config, state, now) -> ScalingDecision``, named
by import path in ``policy``. It is imported and its signature checked when the config is
read; a path that does not import or is not callable fails start-up with an error naming
the key (``autoscaling.prefill.policy``) and the path. ``threshold_policy`` is there to reuse
with signals of your own. Every decision carries its inputs (window, signals, targets) and
its reason; the controller logs them and exports ``pdserve:pool_replicas{pool}`` and
``pdserve:autoscaler_desired_replicas{pool}``.
"""

from pdserve.cluster.autoscaling.config import (DEFAULTS, POOLS, AutoscaleConfigError, PoolPolicyConfig, from_mapping,
                                        load_policy, pool_config)
from pdserve.cluster.autoscaling.decide import decide
from pdserve.cluster.autoscaling.decision import DecisionInputs, ScalerState, ScalingDecision, SignalReading
from pdserve.cluster.autoscaling.policies import decode_policy, prefill_policy, threshold_policy
from pdserve.cluster.autoscaling.window import MetricsError, MetricsWindow, PoolSample

__all__ = [
    "DEFAULTS", "POOLS", "AutoscaleConfigError", "DecisionInputs", "MetricsError", "MetricsWindow", "PoolPolicyConfig",
    "PoolSample", "ScalerState", "ScalingDecision", "SignalReading", "decide", "decode_policy", "from_mapping",
    "load_policy", "pool_config", "prefill_policy", "threshold_policy",
]

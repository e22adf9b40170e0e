"""Per-pool autoscaling configuration: one frozen ``PoolPolicyConfig`` per pool, validated at
construction, and the policy it names loaded (once) from its import path."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

POOLS = ("prefill", "decode")
PREFILL_POLICY = "pdserve.cluster.autoscaling.policies:prefill_policy"
DECODE_POLICY = "pdserve.cluster.autoscaling.policies:decode_policy"


class AutoscaleConfigError(ValueError):
    """A config value is out of range or a policy path does not load; ``key`` names the value."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")

    def under(self, prefix: str) -> AutoscaleConfigError:
        """The same error with its key qualified, e.g. ``autoscaling.prefill.policy``."""
        return AutoscaleConfigError(f"{prefix}.{self.key}", self.problem)


@dataclass(frozen=True)
class PoolPolicyConfig:
    """How one pool scales. Build it once at start-up (``pool_config`` fills a pool's
    defaults); every value is checked here so that ``decide`` never meets a bad one."""

    target: float  # per-worker target of the primary signal (prefill: queued prompt tokens; decode: KV usage 0..1)
    slo_s: float  # latency SLO on the p90 (prefill: TTFT; decode: ITL)
    policy: str  # "package.module:function", same signature as the built-in policies
    # A pool at zero reports no load (its workers report it), so nothing could scale it back up.
    min_replicas: int = 1
    # A bound on spend; both pools must fit the cluster together. Raise it on a bigger cluster.
    max_replicas: int = 4
    # Hysteresis band around the target, as observed/target: noise of +-20% around the target
    # changes nothing. Down at half the target: after 2 -> 1 the survivor carries at most the
    # target, below the up threshold, so a scale-down never triggers the next scale-up.
    scale_up_threshold: float = 1.2
    scale_down_threshold: float = 0.5
    # Averages ~20 controller samples (one a second) and many requests, so one long prompt or
    # one slow step is not "load"; short enough to react to a burst within half a minute.
    window_s: float = 20.0
    # A new worker needs tens of seconds to load the model; its effect must be visible in a
    # full window before the next step up (the full-window guard adds window_s after it settles).
    scale_up_cooldown_s: float = 10.0
    # Removing a worker on a short lull and loading it again costs far more than holding it a
    # minute; an overloaded pool hurts users, an oversized one only costs money.
    scale_down_cooldown_s: float = 60.0
    # Signals lag the change that caused them; one worker at a time cannot overshoot much.
    step: int = 1
    # The controller samples about once a second: a latest sample older than this means the
    # metrics pipe stalled, and stale numbers must not drive a decision.
    max_sample_age_s: float = 5.0

    def __post_init__(self) -> None:
        _check_int("min_replicas", self.min_replicas, low=1)
        _check_int("max_replicas", self.max_replicas, low=self.min_replicas, low_name="min_replicas")
        _check_int("step", self.step, low=1)
        for key in ("target", "slo_s", "window_s", "max_sample_age_s"):
            _check_float(key, getattr(self, key), positive=True)
        for key in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_threshold"):
            _check_float(key, getattr(self, key), positive=False)
        _check_float("scale_up_threshold", self.scale_up_threshold, positive=True)
        if not self.scale_down_threshold < 1.0:
            raise AutoscaleConfigError("scale_down_threshold",
                                       f"must be < 1.0 (the target), got {self.scale_down_threshold}")
        if not self.scale_up_threshold >= 1.0:
            raise AutoscaleConfigError("scale_up_threshold",
                                       f"must be >= 1.0 (the target), got {self.scale_up_threshold}")
        if self.scale_down_cooldown_s < self.scale_up_cooldown_s:
            raise AutoscaleConfigError("scale_down_cooldown_s", f"must be >= scale_up_cooldown_s "
                                       f"({self.scale_up_cooldown_s}), got {self.scale_down_cooldown_s}")
        load_policy(self.policy)


def pool_config(pool: str, **overrides: Any) -> PoolPolicyConfig:
    """A pool's defaults with ``overrides`` applied (and validated)."""
    if pool not in POOLS:
        raise AutoscaleConfigError("pool", f"must be one of {POOLS}, got {pool!r}")
    return dataclasses.replace(DEFAULTS[pool], **overrides)


def from_mapping(values: Mapping[str, Any], key: str = "autoscaling") -> dict[str, PoolPolicyConfig]:
    """Both pools' configs from a YAML-style mapping ``{prefill: {...}, decode: {...}}``;
    a pool left out gets its defaults. Errors name the full key, e.g. ``autoscaling.decode.step``."""
    if not isinstance(values, Mapping):
        raise AutoscaleConfigError(key, f"must be a mapping of pool to settings, got {type(values).__name__}")
    unknown = sorted(set(values) - set(POOLS))
    if unknown:
        raise AutoscaleConfigError(f"{key}.{unknown[0]}", f"unknown pool (expected one of {POOLS})")
    return {pool: _pool_from_mapping(pool, values.get(pool) or {}, f"{key}.{pool}") for pool in POOLS}


def _pool_from_mapping(pool: str, values: Mapping[str, Any], key: str) -> PoolPolicyConfig:
    if not isinstance(values, Mapping):
        raise AutoscaleConfigError(key, f"must be a mapping of settings, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(PoolPolicyConfig)}
    overrides = {}
    for name, value in values.items():
        field = str(name).replace("-", "_")  # YAML files may spell keys in kebab-case
        if field not in fields:
            raise AutoscaleConfigError(f"{key}.{name}", f"unknown setting (expected one of {sorted(fields)})")
        overrides[field] = value
    try:
        return pool_config(pool, **overrides)
    except AutoscaleConfigError as e:
        raise e.under(key) from e


@functools.lru_cache(maxsize=None)
def load_policy(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` and check it takes ``decide``'s five arguments.

    Cached, so the import happens once, when the config is built; ``decide`` then only looks it up.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise AutoscaleConfigError("policy", f"must look like 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise AutoscaleConfigError("policy", f"cannot import module {module_name!r} of {path!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise AutoscaleConfigError("policy", f"module {module_name!r} has no attribute {attr!r} (from {path!r})")
    if not callable(fn):
        raise AutoscaleConfigError("policy", f"{path!r} is a {type(fn).__name__}, not a callable")
    try:
        inspect.signature(fn).bind("pool", None, None, None, 0.0)
    except TypeError as e:
        raise AutoscaleConfigError("policy", f"{path!r} must accept (pool, window, config, state, now): {e}") from e
    except ValueError:
        pass  # builtins without a signature: the call itself will tell
    return fn


def _check_int(key: str, value: Any, low: int, low_name: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AutoscaleConfigError(key, f"must be an integer, got {value!r}")
    if value < low:
        limit = f"{low_name} ({low})" if low_name else str(low)
        raise AutoscaleConfigError(key, f"must be >= {limit}, got {value}")


def _check_float(key: str, value: Any, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AutoscaleConfigError(key, f"must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise AutoscaleConfigError(key, f"must be > 0, got {value}")
    if not positive and value < 0:
        raise AutoscaleConfigError(key, f"must be >= 0, got {value}")


DEFAULTS = {
    # 4096 queued prompt tokens per worker = two steps of the engine's default token budget
    # (max_num_batched_tokens 2048): at the target a new prompt waits about two forward steps.
    # TTFT p90 2 s: a chat user sees the first token within ~2 s; on CPU the default model
    # prefills a 2k-token prompt well inside that, so a breach means queueing, which workers fix.
    "prefill": PoolPolicyConfig(target=4096.0, slo_s=2.0, policy=PREFILL_POLICY),
    # 70% of KV blocks in use: running streams grow a block every block_size tokens and a full
    # cache preempts them, so keep headroom (up at 84%, down at 35%).
    # ITL p90 0.2 s = 5 tokens/s, about reading speed; a CPU decode step of the default model
    # takes 20-200 ms as the batch grows, so a breach means the batch is too big for one worker.
    "decode": PoolPolicyConfig(target=0.7, slo_s=0.2, policy=DECODE_POLICY),
}

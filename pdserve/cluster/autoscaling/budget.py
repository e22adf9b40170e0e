"""The budget policy: with a fixed number of elastic workers, which pool needs one more and which
can give one up. A pure function from the two pools' windows of samples to a move; no Ray, no
I/O. ``pdserve.cluster.role_balancer`` samples and switches; the simulator replays the same
function (``pdserve.planner.elastic``).

Each pool's **pressure** is its load against the targets its autoscaling policy already has
(``PoolPolicyConfig``; the defaults where autoscaling is off), the largest of its signals:

- prefill: queued prompt tokens per worker / ``target``, and TTFT p90 / ``slo_s``;
- decode: KV usage / ``target``, and ITL p90 / ``slo_s``.

Above 1, a pool misses a target. A move takes one worker from a donor pool to a taker pool when

1. the taker's pressure, averaged over the window, is above ``high`` (sustained, not a spike);
2. the donor keeps more than its minimum of workers; and
3. the donor's pressure at its peak over the window stays below ``low`` with one worker fewer:
   its load signals (queued tokens per worker, KV usage) spread over the workers left
   (``peak * n / (n - 1)``), its latency signals as they are. The donor is still comfortable
   after the move.

That is the hysteresis: right after a move the donor is below ``low`` < ``high``, so the reverse
move cannot follow until the donor's own load grows past ``high``. The guards around it, as in
``decide``: no decision on stale samples, on a window that does not yet span ``window_s``, on
one that holds samples from before the last switch (or from another worker count), or within
``dwell_s`` of the last switch. A pool both over ``high`` gets nothing from the other: with the
budget fixed there is nothing to move, and per-pool autoscaling grows the budget where it may.

**The mixed role** (``mixed``; an elastic worker in the decode pool that prefills the streams
it takes, ``pdserve.router.local_prefill``) gives the policy a half move where a whole one is
refused, so that two workers can still move (1P:1D has nothing to give: each pool is at its
minimum):

- prefill pressed and no decode worker to spare: a plain decode worker becomes mixed when the
  decode pool's peak as it is stays below ``high`` (it meets its targets). It keeps its streams
  and takes prompts too. The bar is ``high``, not ``low``: a prefill pool over ``high`` misses
  TTFT for nearly every request, so prompts in a decode worker's steps that bring its ITL near
  its SLO cost less goodput than leaving them queued.
- decode pressed on its latency (ITL) with mixed workers: one goes back to plain decode, before
  any other move, when the prefill pool's peak is below ``low`` (it can take the prompts back).
  Prompt chunks in its steps are what stretches ITL, and the switch is free.

The band is the same as a whole move's, between the two conditions: mixing needs the prefill
pool over ``high`` and unmixing needs it under ``low``.

The decode pool's windows count mixed workers as its own (their KV and streams are there); the
prefill pool's are its plain prefill workers. ``mixed=False`` in the config turns the role off.

Latency is not linear in workers the way a queue is: a decode step at a small batch costs about
what it costs at one stream (the weights are read once either way), and a prefill queue that is
empty stays empty. So 3 scales only the load signals; the latency a pool shows must itself be
below ``low``. It is a first-order guess, and ``low`` leaves room for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.cluster.autoscaling.config import PoolPolicyConfig
from pdserve.cluster.autoscaling.window import MetricsWindow, PoolSample
from pdserve.elastic_worker.roles import HAND_OVER_AFTER_S

POOLS = ("prefill", "decode")


class BudgetConfigError(ValueError):
    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"{key}: {problem}")


@dataclass(frozen=True)
class BudgetConfig:
    # A pool asks for a worker when its pressure's window mean is above this (1: at its targets).
    high: float = 1.0
    # The donor gives one up only if its projected peak stays below this. Below ``high``: the
    # band between them keeps one move from calling for its reverse.
    low: float = 0.7
    # The window a decision reads (at the controller's one sample a second, about ten samples).
    window_s: float = 10.0
    # The least time between two switches: a switch's effect must show before the next one.
    dwell_s: float = 15.0
    # Samples older than this mean the metrics stalled: no decision on them.
    max_sample_age_s: float = 5.0
    min_prefill: int = 1
    min_decode: int = 1
    # The SLOs the latency signals are weighed against (TTFT p90, ITL p90); None: the pool's
    # autoscaling ``slo_s`` (2 s and 0.2 s by default). Set them to the service's own SLOs.
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    # Whether the policy may use the mixed role (the half moves above).
    mixed: bool = True
    # A whole move's drain: how long the worker's old role may finish what it runs. Past it,
    # a decode worker's streams move with their KV to the rest of the pool (no re-prefill), so
    # a switch need not wait for its longest answer; prompts and held KV finish whatever it is.
    grace_s: float = HAND_OVER_AFTER_S

    def __post_init__(self) -> None:
        for key in ("ttft_slo_s", "itl_slo_s"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise BudgetConfigError(key, f"must be a number > 0 or None, got {value!r}")
        for key in ("high", "low", "window_s", "dwell_s", "max_sample_age_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0):
                raise BudgetConfigError(key, f"must be a number > 0, got {value!r}")
        if self.low >= self.high:
            raise BudgetConfigError("low", f"must be below high ({self.high}), got {self.low}: "
                                    "without the band a move could call for its own reverse")
        if not (isinstance(self.grace_s, (int, float)) and self.grace_s >= 0):
            raise BudgetConfigError("grace_s", f"must be a number >= 0, got {self.grace_s!r}")
        for key in ("min_prefill", "min_decode"):
            if getattr(self, key) < 1:
                raise BudgetConfigError(key, f"must be at least 1, got {getattr(self, key)}")

    def minimum(self, pool: str) -> int:
        return self.min_prefill if pool == "prefill" else self.min_decode

    def targets(self, policies: dict[str, PoolPolicyConfig]) -> dict[str, PoolPolicyConfig]:
        """Each pool's targets for its pressure: ``policies``' (the pools' autoscaling configs),
        with this config's SLOs where it sets them."""
        slo = {"prefill": self.ttft_slo_s, "decode": self.itl_slo_s}
        return {pool: policy if slo[pool] is None else dataclasses.replace(policy, slo_s=slo[pool])
                for pool, policy in policies.items()}


@dataclass(frozen=True)
class Pressure:
    """One pool's pressure over a window: its mean and peak, the signal behind the peak, and
    its workers in the latest sample."""

    pool: str
    workers: int
    mean: float
    peak: float
    signal: str  # the signal whose ratio is largest at the peak
    load_peak: float = 0.0  # the peak of the load signals alone (queued tokens per worker, KV usage)
    latency_peak: float = 0.0  # the peak of the latency signals alone (TTFT or ITL p90 over its SLO)

    def after_losing_one(self) -> float:
        """The pressure with one worker fewer: the load spread over the workers left, the latency
        as it is (inf when it has only one worker)."""
        if self.workers <= 1:
            return float("inf")
        return max(self.load_peak * self.workers / (self.workers - 1), self.latency_peak)


@dataclass(frozen=True)
class RoleMove:
    """What the policy decided: one worker helps ``taker`` at ``donor``'s cost, or hold (``taker``
    None). The worker switches from ``from_role`` to ``to_role``: the pools themselves, or for a
    half move, decode -> mixed (helping prefill) or mixed -> decode (helping decode)."""

    taker: str | None
    donor: str | None
    reason: str
    pressures: tuple[Pressure, ...] = ()
    from_role: str | None = None  # None: ``donor``
    to_role: str | None = None  # None: ``taker``

    @property
    def source(self) -> str | None:
        """The role of the worker that switches."""
        return self.from_role or self.donor

    @property
    def target(self) -> str | None:
        """The role it switches to."""
        return self.to_role or self.taker

    @property
    def label(self) -> str:
        """The switch's reason as a metric label (``pdserve:role_changes_total{reason}``)."""
        return f"{self.taker}_pressure" if self.taker else "hold"


def pressure(pool: str, window: MetricsWindow, target: PoolPolicyConfig) -> Pressure:
    """``pool``'s pressure over ``window`` against ``target``'s ``target`` and ``slo_s``."""
    per_sample = [_ratios(pool, s, target) for s in window.samples]
    values = [max(v for v in (load, latency) if v is not None) for load, latency in per_sample]
    workers = window.latest.replicas if window.latest else 0
    if not values:
        return Pressure(pool, workers, 0.0, 0.0, "none")
    load_peak = max(load for load, _ in per_sample)
    latency_peak = max((lat for _, lat in per_sample if lat is not None), default=0.0)
    names = ("queued_prompt_tokens_per_worker", "ttft_p90_s") if pool == "prefill" else ("kv_usage", "itl_p90_s")
    return Pressure(pool, workers, sum(values) / len(values), max(values),
                    names[0] if load_peak >= latency_peak else names[1], load_peak, latency_peak)


def _ratios(pool: str, s: PoolSample, target: PoolPolicyConfig) -> tuple[float, float | None]:
    """(load over its target, latency over its SLO) of one sample; the latency None when no
    request gave one in its interval (no evidence either way)."""
    if pool == "prefill":
        latency = None if s.ttft_p90_s is None else s.ttft_p90_s / target.slo_s
        return s.queued_prompt_tokens / max(s.replicas, 1) / target.target, latency
    return s.kv_usage / target.target, None if s.itl_p90_s is None else s.itl_p90_s / target.slo_s


def decide_roles(windows: dict[str, MetricsWindow], targets: dict[str, PoolPolicyConfig], config: BudgetConfig,
                 last_switch_t: float | None, now: float, mixed: int = 0) -> RoleMove:
    """One worker to move between the prefill and decode pools at ``now``, or a hold, with the
    reason. ``windows`` and ``targets`` hold both pools; ``last_switch_t`` is when the last
    switch completed (None: never); ``mixed``: how many of the decode pool's workers are mixed
    now. Pure: same inputs, same move."""
    for pool in POOLS:
        window = windows[pool]
        if window.latest is None:
            return RoleMove(None, None, f"hold: no {pool} samples yet")
        if now - window.latest.t > config.max_sample_age_s:
            return RoleMove(None, None, f"hold: stale, the latest {pool} sample is {now - window.latest.t:.1f} s old "
                            f"> max_sample_age_s {config.max_sample_age_s}")
        if window.span_s(now) < config.window_s:
            return RoleMove(None, None, f"hold: cold start, the {pool} window spans {window.span_s(now):.1f} s "
                            f"of window_s {config.window_s}")
        if any(s.replicas != window.latest.replicas for s in window.samples) or (
                last_switch_t is not None and window.oldest.t < last_switch_t):
            return RoleMove(None, None, f"hold: settling, the {pool} window holds samples from before the last change")
    pressures = tuple(pressure(pool, windows[pool], targets[pool]) for pool in POOLS)
    by_pool = {p.pool: p for p in pressures}
    if last_switch_t is not None and now - last_switch_t < config.dwell_s:
        return RoleMove(None, None, f"hold: dwell, {now - last_switch_t:.1f} s since the last switch of "
                        f"dwell_s {config.dwell_s}", pressures)
    hot = sorted((p for p in pressures if p.mean > config.high), key=lambda p: -p.mean)
    if not hot:
        return RoleMove(None, None, f"hold: both pools at or below high {config.high} ({_describe(pressures)})",
                        pressures)
    taker = hot[0]
    donor = by_pool["decode" if taker.pool == "prefill" else "prefill"]
    if donor.mean > config.high:
        return RoleMove(None, None, f"hold: both pools above high {config.high} ({_describe(pressures)}); a fixed "
                        "budget has nothing to move", pressures)
    if config.mixed and taker.pool == "decode" and mixed and taker.latency_peak >= taker.load_peak:
        if donor.peak >= config.low:
            return RoleMove(None, None, f"hold: decode pressure {taker.mean:.2f} ({taker.signal}) > high "
                            f"{config.high}, but prefill's peak {donor.peak:.2f} >= low {config.low}: it could not "
                            "take a mixed worker's prompts back", pressures)
        return RoleMove("decode", "prefill", f"mixed -> decode: decode pressure {taker.mean:.2f} ({taker.signal}) > "
                        f"high {config.high}, a mixed worker's prompts share its steps, and prefill's peak "
                        f"{donor.peak:.2f} < low {config.low}", pressures, from_role="mixed", to_role="decode")
    whole = _whole_move(taker, donor, config, pressures)
    if whole.taker is None and config.mixed and taker.pool == "prefill" and donor.workers - mixed > 0:
        if donor.peak < config.high:
            return RoleMove("prefill", "decode", f"decode -> mixed: {whole.reason.removeprefix('hold: ')}; decode's "
                            f"peak {donor.peak:.2f} < high {config.high}, so a decode worker prefills its own "
                            "streams too", pressures, from_role="decode", to_role="mixed")
    return whole


def _whole_move(taker: Pressure, donor: Pressure, config: BudgetConfig, pressures: tuple[Pressure, ...]) -> RoleMove:
    """A worker from ``donor``'s pool to ``taker``'s, or why not."""
    if donor.workers <= config.minimum(donor.pool):
        return RoleMove(None, None, f"hold: {taker.pool} needs a worker but {donor.pool} is at its minimum "
                        f"{config.minimum(donor.pool)} ({_describe(pressures)})", pressures)
    projected = donor.after_losing_one()
    if projected >= config.low:
        return RoleMove(None, None, f"hold: {taker.pool} needs a worker but {donor.pool}'s peak over "
                        f"{donor.workers - 1} worker(s) would be {projected:.2f} >= low {config.low} "
                        f"({_describe(pressures)})", pressures)
    return RoleMove(taker.pool, donor.pool,
                    f"{donor.pool} -> {taker.pool}: {taker.pool} pressure {taker.mean:.2f} ({taker.signal}) > "
                    f"high {config.high}; {donor.pool} over {donor.workers - 1} worker(s) {projected:.2f} < "
                    f"low {config.low}", pressures)


def _describe(pressures: tuple[Pressure, ...]) -> str:
    return ", ".join(f"{p.pool} mean {p.mean:.2f} peak {p.peak:.2f} ({p.signal})" for p in pressures)

"""KV-aware choice of a prefill worker: pure functions from worker snapshots and prefix
overlaps (``pdserve.router.kv_index``) to a ``Choice``. No I/O; randomness only from the ``rng`` given.

Cost of sending a prompt of P tokens to worker w, which caches its first C_w tokens, holds the
next T_w in its KV tier (``--kv-offload-bytes``; 0 without one) and has Q_w prompt tokens
queued (in the spirit of Dynamo's KV router)::

    cost_w = prefill_weight * (P - C_w - T_w) + tier_weight * T_w + load_weight * Q_w

The first and last terms are tokens the worker must compute before this prompt's first token,
so equal weights compare like with like. A tier token is not computed but copied back from
host memory or a local file and checked, which costs a small fraction of computing it
(docs/routing.md#the-kv-tier: ``tier_weight``'s default 0.1, and why). Temperature 0 takes the cheapest (ties: fewest in flight, the
one given work least recently, then id, as ``pdserve.router.policy.pick_prefill``); a positive
temperature samples with probability proportional to ``exp(-normalized_cost / temperature)``,
costs normalized to 0..1 over the candidates, which spreads a hot prefix over several workers.

SGLang's cache-aware fallback: when the queues are badly imbalanced (the longest exceeds the
shortest by more than ``balance_abs_tokens`` and by more than ``balance_rel`` times), the
prompt goes to the shortest queue whatever the cache says, so one hot prefix cannot pile
every request onto one worker.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterable, Mapping

from pdserve.router.policy import Choice, WorkerSnapshot, least_loaded, pick_prefill, prefill_candidates

POLICIES = ("kv", "load", "round_robin")
RULES = ("cache", "load", "balance", "round_robin", "only")  # Choice.rule values for prefill


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks a prefill worker (``pdserve serve --routing-policy`` and friends)."""

    # "kv": the cost above; "load": fewest queued prompt tokens; "round_robin": in turn (a
    # baseline for benchmarks). Outputs are the same under every policy: only time differs.
    policy: str = "kv"
    prefill_weight: float = 1.0  # per prompt token the worker has not cached
    # Per prompt token the worker loads from its KV tier: a copy of its bytes and a checksum.
    # Measured on the CPU path (SmolLM2-135M, bf16): 0.22 ms a 16-token block against ~56 ms to
    # compute it (0.4 %); estimated on a GPU (8B model, PCIe from host memory): ~0.1. The GPU's
    # ratio, the least favourable, keeps a tier hit behind a device hit and well ahead of a miss
    # on both (docs/routing.md#the-kv-tier).
    tier_weight: float = 0.1
    load_weight: float = 1.0  # per prompt token already queued on the worker
    temperature: float = 0.0  # 0: always the cheapest; above: softmax sampling over costs
    # Fallback to the shortest queue when max - min queued tokens exceeds this (at ~1,000
    # prompt tokens/s per CPU worker, ~8 s of work) ...
    balance_abs_tokens: int = 8192
    # ... and max exceeds min by more than this factor.
    balance_rel: float = 2.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("prefill_weight", "tier_weight", "load_weight", "temperature", "balance_abs_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)!r}")
        if self.balance_rel < 1:
            raise ValueError(f"balance_rel must be at least 1, got {self.balance_rel!r}")


def cost(w: WorkerSnapshot, prompt_tokens: int, cached_tokens: int, config: RoutingConfig,
         tier_tokens: int = 0) -> float:
    """Tokens ``w`` computes before this prompt's first token, and those it loads from its KV
    tier, weighted."""
    return (config.prefill_weight * (prompt_tokens - cached_tokens - tier_tokens) + config.tier_weight * tier_tokens
            + config.load_weight * w.queued_tokens)


def imbalanced(candidates: list[WorkerSnapshot], config: RoutingConfig) -> bool:
    """SGLang's test: the longest queue exceeds the shortest by both thresholds."""
    loads = [w.queued_tokens for w in candidates]
    hi, lo = max(loads), min(loads)
    return hi - lo > config.balance_abs_tokens and hi > config.balance_rel * lo


def pick_prefill_kv(workers: Iterable[WorkerSnapshot], overlaps: Mapping[str, int], prompt_tokens: int,
                    config: RoutingConfig, exclude: frozenset[str] = frozenset(),
                    max_queued_tokens: int | None = None, rng: random.Random | None = None,
                    tier_overlaps: Mapping[str, int] | None = None) -> Choice:
    """The prefill worker with the lowest ``cost`` (or sampled by it), given ``overlaps``:
    worker id -> prompt tokens its cache holds per the router's index (missing: 0), and
    ``tier_overlaps``: the tokens after those its KV tier holds (``KVIndex.tier_tokens``;
    missing: 0). Unhealthy, draining, excluded and full workers are never chosen, whatever
    they cache. The choice's ``cached_tokens`` are both: what the worker will not compute."""
    candidates = prefill_candidates(workers, exclude, prompt_tokens, max_queued_tokens)
    if isinstance(candidates, Choice):
        return candidates
    cached, tiered = _hits([w.worker_id for w in candidates], overlaps, tier_overlaps or {}, prompt_tokens)
    if len(candidates) == 1:
        only = candidates[0].worker_id
        return Choice(only, "the only prefill worker that can take it", rule="only",
                      cached_tokens=cached[only] + tiered[only])
    if imbalanced(candidates, config):
        best = min(candidates, key=least_loaded)
        return Choice(best.worker_id, f"queues imbalanced: shortest queue ({best.queued_tokens} tokens)",
                      rule="balance", cached_tokens=cached[best.worker_id] + tiered[best.worker_id])
    costs = {w.worker_id: cost(w, prompt_tokens, cached[w.worker_id], config, tiered[w.worker_id]) for w in candidates}
    if config.temperature > 0:
        best = _sample(candidates, costs, config.temperature, rng or random.Random())
    else:
        best = min(candidates, key=lambda w: (costs[w.worker_id], *least_loaded(w)))
    c, t = cached[best.worker_id], tiered[best.worker_id]
    in_tier = f", {t} more in its KV tier" if t else ""
    return Choice(best.worker_id, f"lowest cost {costs[best.worker_id]:g} ({c} of {prompt_tokens} prompt tokens "
                  f"cached{in_tier}, {best.queued_tokens} queued)", rule="cache" if c or t else "load",
                  cached_tokens=c + t)


def _hits(ids: list[str], overlaps: Mapping[str, int], tier_overlaps: Mapping[str, int],
          prompt_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
    """Per worker id, its cached tokens and then its tier's. A hit never covers the last token
    (it must be computed), so at most P - 1 are found in both together."""
    cached = {w: max(0, min(overlaps.get(w, 0), prompt_tokens - 1)) for w in ids}
    tiered = {w: max(0, min(tier_overlaps.get(w, 0), prompt_tokens - 1 - cached[w])) for w in ids}
    return cached, tiered


def _sample(candidates: list[WorkerSnapshot], costs: Mapping[str, float], temperature: float,
            rng: random.Random) -> WorkerSnapshot:
    """One candidate, with probability proportional to exp(-normalized cost / temperature)."""
    ordered = sorted(candidates, key=lambda w: w.worker_id)  # a seeded rng gives the same pick
    lo, hi = min(costs.values()), max(costs.values())
    span = hi - lo or 1.0
    weights = [math.exp(-(costs[w.worker_id] - lo) / span / temperature) for w in ordered]
    return rng.choices(ordered, weights=weights)[0]


def pick_prefill_round_robin(workers: Iterable[WorkerSnapshot], turn: int, exclude: frozenset[str] = frozenset(),
                             prompt_tokens: int = 0, max_queued_tokens: int | None = None) -> Choice:
    """The candidates in id order, the ``turn``-th of them (modulo): blind to load and cache."""
    candidates = prefill_candidates(workers, exclude, prompt_tokens, max_queued_tokens)
    if isinstance(candidates, Choice):
        return candidates
    ordered = sorted(candidates, key=lambda w: w.worker_id)
    return Choice(ordered[turn % len(ordered)].worker_id, f"round robin (turn {turn})", rule="round_robin")


def choose_prefill(workers: list[WorkerSnapshot], overlaps: Mapping[str, int], prompt_tokens: int,
                   config: RoutingConfig, turn: int, exclude: frozenset[str] = frozenset(),
                   max_queued_tokens: int | None = None, rng: random.Random | None = None,
                   tier_overlaps: Mapping[str, int] | None = None) -> Choice:
    """The configured policy's choice (``config.policy``); ``overlaps`` and ``tier_overlaps``
    are read by "kv" only, ``turn`` by "round_robin" only. The chosen worker's cached tokens
    (its tier's included) are reported for every policy (a metric: how much of the cache a
    policy uses)."""
    if config.policy == "kv":
        return pick_prefill_kv(workers, overlaps, prompt_tokens, config, exclude, max_queued_tokens, rng, tier_overlaps)
    if config.policy == "round_robin":
        choice = pick_prefill_round_robin(workers, turn, exclude, prompt_tokens, max_queued_tokens)
    else:
        choice = pick_prefill(workers, exclude, prompt_tokens, max_queued_tokens)
    if choice.worker_id is None:
        return choice
    cached, tiered = _hits([choice.worker_id], overlaps, tier_overlaps or {}, prompt_tokens)
    return Choice(choice.worker_id, choice.reason, rule=choice.rule,
                  cached_tokens=cached[choice.worker_id] + tiered[choice.worker_id])

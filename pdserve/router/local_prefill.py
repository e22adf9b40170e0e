"""Who prefills a request: a prefill worker (disaggregated), or the decode worker that will
stream it (local prefill). A pure rule over plain values; no I/O.

Two ways a request is prefilled locally:

- **Colocated mode** (``colocated``): the cluster has no prefill pool; every worker runs both
  phases, with prompt chunks mixed into its decode steps. Every request prefills locally.
- **Conditional disaggregation** (``max_tokens`` > 0), as Dynamo and llm-d do it: a short
  prompt costs less to compute in a mixed step on its decode worker than to queue on a
  prefill worker and move its KV over, as long as that decode worker is not busy. The rule:
  uncached prompt tokens below ``max_tokens`` and the decode worker's load below
  ``max_load``.

- **A mixed worker** (``mixed``: an elastic worker in the mixed role, pdserve/elastic_worker):
  a decode worker that also prefills its own requests, as a colocated worker does, unless a
  prefill worker's queue is shorter than its own; then the prefill pool takes the prompt and
  the mixed worker reads its KV. A cluster whose prefill workers all became mixed has no
  prefill pool left: its plain decode workers prefill their requests themselves too.
- **No prefill worker to take it** (``prefill_down``): every prefill worker is hung, dead or
  being replaced. The decode worker prefills (``NO_PREFILL_WORKER``) rather than the request
  waiting on, or failing with, an empty prefill pool.

- **Prefill that keeps up** (``overflow_ttft_s`` > 0, ``PREFILL_BEHIND``): when even the least
  queued prefill worker would start a prompt later than the TTFT budget allows, and its decode
  worker would finish it sooner, the decode worker prefills it, in time-sized chunks beside its
  streams (pdserve/engine/core/step_budget.py). Predicted TTFT is queued-plus-new tokens times a
  prompt token's cost: a prefill worker's as the router has seen it (``PrefillPace``); on a
  decode worker, the wall time it measured (a step of its streams carries ``chunk`` prompt
  tokens: the step's time over ``chunk``, in its stats), or before it has, a prefill worker's times
  ``overflow_slowdown`` (about half its step is streams). On a box where one
  core's prefill is near the offered prompt rate, a burst's prompts no longer wait seconds
  while the decode core runs steps that could carry them.

The load is the decode worker's share of KV blocks in use (what the router's decode
choice already ranks by, with the blocks this router has placed since the last poll): it
grows with both the number of streams and their lengths, which is what a prompt's extra
step work competes with. The uncached count subtracts a known prefix-cache overlap on that
decode worker (a KV-aware index may supply one; without it the whole prompt counts).

**Conversations keep their KV** (``decode_kv_reuse``, ``decide_for_attempt``). Decode workers
publish their finished blocks, prompt and answer, to the router's KV index, so a follow-up
turn finds most of its prompt on the decode worker D that served the last one: D caches its
first C_D tokens. When some decode worker caches a prefix, the attempt takes the cheapest of
three plans, each costed in tokens computed before the first token, weighted as the KV policy
weighs a prefill worker (``pdserve.router.kv_policy``: ``prefill_weight`` per token to compute,
``load_weight`` per token queued ahead)::

    local  = (prefill_weight + interference_weight * load_D) * (P - C_D) + load_weight * Q_D
    remote = min over prefill workers w of
             prefill_weight * (P - C_w) + load_weight * Q_w + move(P - C_D) + overhead
    pull   = min over prefill workers w with C_w < C_D of
             prefill_weight * (P - C_D) + load_weight * Q_w + move(C_D - C_w + P - C_D) + overhead

``move(n) = kv_move_weight * n`` (a token's KV read costs a small fraction of computing it)
and ``overhead = remote_overhead_tokens`` (two more calls and a read set up). ``local`` (reason
``decode_hit``) prefills only the suffix on D; its interference term charges the stall the
suffix's step work causes D's running streams, growing with D's load. ``pull`` (reason
``prefix_on_decode``) sends the prompt to a prefill worker that first reads D's prefix
(``prefix_from``) and computes only the suffix; ``remote`` (``prefill_cheaper``) is today's
disaggregated prefill, chosen when a prefill worker holds as much or is idle enough. On
ties the plan that moves less wins (local, then pull). Every plan decodes on D (D reads back
only the blocks it lacks), so a conversation stays where its KV is without client help.

The plans apply only when D caches *more* of the prompt than every routable prefill worker:
what it holds beyond them is a previous answer's KV, which only a decode worker has. A prefix
that a prefill worker caches as well (a shared system prompt, a prompt the decode worker read
from it) is no reason to leave disaggregation: without the rule, every decode worker that had
seen a chat template would prefill every idle-time prompt itself and one decode worker would
draw every stream that shares a system prompt. With no such decode worker (first turns, a
shared prefix, the reuse off) the attempt is decided exactly by ``decide`` above, on the decode
worker the decode choice picks.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.policy import WorkerSnapshot, pick_decode


@dataclass(frozen=True)
class LocalPrefillConfig:
    colocated: bool = False  # no prefill pool: every request prefills on its worker
    # Conditional disaggregation: prompts with fewer uncached tokens than this prefill on
    # their decode worker. 0: off, every prompt goes to the prefill pool. Off by default;
    # benchmarks/conditional.py measures a threshold (BENCHMARKS.md).
    max_tokens: int = 0
    # ... and only on a decode worker with less than this share of its KV blocks in use (0..1].
    max_load: float = 0.5
    # Conversations keep their KV (module docstring): the cost of a local prefill grows by this
    # much per suffix token and unit of the decode worker's load (the stall its running
    # streams take) ...
    interference_weight: float = 1.0
    # ... a token's KV moved between workers costs this share of computing it (a CPU worker
    # computes ~1,000 prompt tokens/s and copies a token's KV in tens of microseconds) ...
    kv_move_weight: float = 0.05
    # ... and a remote prefill costs this many tokens more: two more RPCs and a KV read set up
    # (~30 ms on a CPU worker).
    remote_overhead_tokens: float = 32.0
    # Prefill that keeps up (module docstring): a prompt whose predicted wait on the prefill
    # pool passes this many seconds is prefilled by its decode worker when that is sooner. 0: off
    # here; ``pdserve serve`` and ``pdserve worker`` set half the TTFT objective.
    overflow_ttft_s: float = 0.0
    # ... a prompt token on a decode worker costs this many times a prefill worker's, until that
    # decode worker reports what its tokens cost it (``Mixed.local_token_s``).
    overflow_slowdown: float = 2.0

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be at least 0, got {self.max_tokens}")
        if not 0 < self.max_load <= 1:
            raise ValueError(f"local_prefill_max_load must be in (0, 1], got {self.max_load}")
        if self.overflow_slowdown < 1:
            raise ValueError(f"overflow_slowdown must be at least 1, got {self.overflow_slowdown!r}")
        for name in ("interference_weight", "kv_move_weight", "remote_overhead_tokens", "overflow_ttft_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)!r}")


class Reason(str, enum.Enum):
    COLOCATED = "colocated"  # local: colocated mode
    SHORT_PROMPT = "short_prompt"  # local: the rule held
    OFF = "off"  # remote: conditional disaggregation is off
    LONG_PROMPT = "long_prompt"  # remote: too many uncached tokens
    BUSY_WORKER = "busy_worker"  # remote: the decode worker's load is at the limit
    MIXED_WORKER = "mixed_worker"  # local: a mixed worker whose queue is the shortest
    PREFILL_SHORTER = "prefill_shorter"  # remote: a prefill worker's queue is shorter than the mixed worker's
    NO_PREFILL_WORKER = "no_prefill_worker"  # local: no routable prefill worker (all mixed, hung, gone)
    DECODE_HIT = "decode_hit"  # local: the decode worker caching the longest prefix computes the suffix
    PREFIX_ON_DECODE = "prefix_on_decode"  # remote: a prefill worker reads that prefix from the decode worker
    PREFILL_CHEAPER = "prefill_cheaper"  # remote as today, though a decode worker caches a prefix
    PREFILL_BEHIND = "prefill_behind"  # local: the prefill pool's queue would break the TTFT budget
    # local: no routable prefill worker verifies KV as the decode worker does (a rollout of
    # verify_kv_transfers halfway: router.policy.verify_agrees), or its reader refused KV that
    # came without checksums on the last attempt
    VERIFY_MISMATCH = "verify_mismatch"


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: Reason
    uncached_tokens: int
    load: float
    decode_worker: str | None = None  # the decode worker this plan is for; None: the decode choice picks
    prefix_from: str | None = None  # remote: the decode worker the prefill worker reads the prefix from

    @property
    def label(self) -> str:
        """The metric label: where the prompt is prefilled."""
        return "local" if self.local else "remote"


@dataclass(frozen=True)
class Mixed:
    """What the rule needs to know of an elastic cluster's mixed workers, for one attempt."""

    worker: bool = False  # the decode worker picked is a mixed one
    own_queue: int = 0  # its queued prompt tokens
    prefill_queue: int | None = None  # the least queued prompt tokens of a routable prefill worker; None: none routable
    any_mixed: bool = False  # the cluster has a routable mixed worker
    token_s: float | None = None  # a prompt token's cost on a prefill worker (PrefillPace); None: not seen yet
    # A prompt token's wall time on the decode worker picked, as its step budget measured it;
    # None: not measured yet, so ``token_s`` times the configured ``overflow_slowdown``.
    local_token_s: float | None = None
    # The cluster has a prefill pool but no routable prefill worker now (hung, dead, being
    # replaced): the decode worker prefills, rather than the request waiting on an empty pool.
    prefill_down: bool = False


class PrefillPace:
    """What a prompt token has cost the prefill workers lately: the weighted mean of their
    answers' compute seconds (``prefill_seconds`` less ``queue_seconds``) per token computed.
    Prompts of fewer than ``min_tokens`` computed tokens say little (a step's fixed cost)."""

    def __init__(self, weight: float = 0.2, min_tokens: int = 32):
        self.weight, self.min_tokens = weight, min_tokens
        self.token_s: float | None = None

    def observe(self, computed_tokens: int, compute_s: float) -> None:
        if computed_tokens < self.min_tokens or not 0 < compute_s < math.inf:
            return
        sample = compute_s / computed_tokens
        self.token_s = sample if self.token_s is None else self.token_s + self.weight * (sample - self.token_s)


def decide(config: LocalPrefillConfig, prompt_tokens: int, load: float, cached_tokens: int | None = None,
           mixed: Mixed = Mixed()) -> Decision:
    """Whether the decode worker with ``load`` (KV blocks in use over its total, 0..1)
    prefills a ``prompt_tokens``-token prompt of which ``cached_tokens`` (if known) are in
    its prefix cache; ``mixed``: the mixed workers' part (see the module docstring). Raises
    ValueError naming the argument for impossible inputs."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {prompt_tokens}")
    if cached_tokens is not None and not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens must be in [0, prompt_tokens={prompt_tokens}], got {cached_tokens}")
    if not 0 <= load <= 1:
        raise ValueError(f"load must be in [0, 1], got {load}")
    uncached = prompt_tokens - (cached_tokens or 0)
    if config.colocated:
        return Decision(True, Reason.COLOCATED, uncached, load)
    if mixed.worker:
        if mixed.prefill_queue is not None and mixed.prefill_queue < mixed.own_queue:
            return Decision(False, Reason.PREFILL_SHORTER, uncached, load)
        return Decision(True, Reason.MIXED_WORKER, uncached, load)
    if mixed.prefill_down or (mixed.any_mixed and mixed.prefill_queue is None):
        return Decision(True, Reason.NO_PREFILL_WORKER, uncached, load)
    if behind(config, uncached, mixed):
        return Decision(True, Reason.PREFILL_BEHIND, uncached, load)
    if config.max_tokens == 0:
        return Decision(False, Reason.OFF, uncached, load)
    if uncached >= config.max_tokens:
        return Decision(False, Reason.LONG_PROMPT, uncached, load)
    if load >= config.max_load:
        return Decision(False, Reason.BUSY_WORKER, uncached, load)
    return Decision(True, Reason.SHORT_PROMPT, uncached, load)


def behind(config: LocalPrefillConfig, uncached: int, mixed: Mixed) -> bool:
    """Whether the prefill pool is too far behind for this prompt and its decode worker
    would answer sooner (module docstring, ``PREFILL_BEHIND``)."""
    if not config.overflow_ttft_s or mixed.prefill_queue is None or not mixed.token_s:
        return False
    remote = (mixed.prefill_queue + uncached) * mixed.token_s
    local = (mixed.own_queue + uncached) * (mixed.local_token_s or mixed.token_s * config.overflow_slowdown)
    return remote > config.overflow_ttft_s and local < remote


@dataclass(frozen=True)
class DecodeHolder:
    """The decode worker that caches the longest prefix of an attempt's prompt (and has room)."""

    worker_id: str
    cached_tokens: int  # prompt tokens its prefix cache holds, per the router's index
    load: float  # its KV blocks in use over its total, 0..1
    queued_tokens: int = 0  # prompt tokens queued on it (a mixed worker's, or local prefills')


@dataclass(frozen=True)
class PrefillOption:
    """One routable prefill worker as the plans see it."""

    cached_tokens: int
    queued_tokens: int


def find_holder(snapshots: Sequence[WorkerSnapshot], cached: dict[str, int], blocks: int,
                limited: bool = False) -> DecodeHolder | None:
    """The routable decode worker with the longest cached prefix (``cached``: worker -> prompt
    tokens, from the KV index) among those with room for ``blocks`` (ties: as ``pick_decode``
    ranks); None when none caches anything or none of those has room."""
    for tokens in sorted({c for c in cached.values() if c > 0}, reverse=True):
        group = [w for w in snapshots if cached.get(w.worker_id, 0) == tokens]
        choice = pick_decode(group, blocks, limited=limited)
        if choice.worker_id is not None:
            w = next(w for w in group if w.worker_id == choice.worker_id)
            return DecodeHolder(w.worker_id, tokens, worker_load(w), w.queued_tokens)
    return None


def worker_load(w: WorkerSnapshot) -> float:
    """A decode worker's load for these rules: its KV blocks in use over its total, 0..1."""
    return min(1.0, w.blocks_used / max(w.blocks_total, 1))


def prefill_options(snapshots: Sequence[WorkerSnapshot], cached: dict[str, int]) -> list[PrefillOption]:
    """The routable prefill workers, each with the prompt tokens it caches (``cached``)."""
    return [PrefillOption(cached.get(w.worker_id, 0), w.queued_tokens)
            for w in snapshots if w.role == "prefill" and w.routable]


def beyond_prefill(holder: DecodeHolder | None, prefills: Sequence[PrefillOption]) -> DecodeHolder | None:
    """``holder`` if it caches more of the prompt than every routable prefill worker (a
    previous answer's KV, which only it has), else None (module docstring)."""
    if holder is None or holder.cached_tokens <= max((w.cached_tokens for w in prefills), default=0):
        return None
    return holder


def decide_for_attempt(config: LocalPrefillConfig, routing: RoutingConfig, prompt_tokens: int, load: float,
                       holder: DecodeHolder | None, prefills: Sequence[PrefillOption] = (),
                       mixed: Mixed = Mixed()) -> Decision:
    """The plan for one attempt: ``decide`` on the picked decode worker (``load``) when no
    decode worker caches more of the prompt than every routable prefill worker (``holder``
    None, or caching no more than the best of ``prefills``), else the cheapest plan of the
    module docstring on ``holder`` given ``prefills``."""
    if beyond_prefill(holder, prefills) is None:
        return decide(config, prompt_tokens, load, mixed=mixed)
    return _decide_on_hit(config, routing, prompt_tokens, holder, prefills)


def _decide_on_hit(config: LocalPrefillConfig, routing: RoutingConfig, prompt_tokens: int, holder: DecodeHolder,
                   prefills: Sequence[PrefillOption]) -> Decision:
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {prompt_tokens}")
    if not 0 <= holder.load <= 1:
        raise ValueError(f"load must be in [0, 1], got {holder.load}")
    cached = min(holder.cached_tokens, prompt_tokens - 1)  # the last token is always computed
    suffix, d = prompt_tokens - cached, holder.worker_id
    if config.colocated:
        return Decision(True, Reason.COLOCATED, suffix, holder.load, decode_worker=d)
    local = ((routing.prefill_weight + config.interference_weight * holder.load) * suffix
             + routing.load_weight * holder.queued_tokens)
    remote, pull = math.inf, math.inf
    remote_uncached = prompt_tokens
    for w in prefills:
        c_w = max(0, min(w.cached_tokens, prompt_tokens - 1))
        queue = routing.load_weight * w.queued_tokens + config.remote_overhead_tokens
        plain = routing.prefill_weight * (prompt_tokens - c_w) + queue + config.kv_move_weight * suffix
        if plain < remote:
            remote, remote_uncached = plain, prompt_tokens - c_w
        if c_w < cached:
            pull = min(pull, routing.prefill_weight * suffix + queue + config.kv_move_weight * (cached - c_w + suffix))
    if local <= min(remote, pull):
        return Decision(True, Reason.DECODE_HIT, suffix, holder.load, decode_worker=d)
    if pull <= remote:
        return Decision(False, Reason.PREFIX_ON_DECODE, suffix, holder.load, decode_worker=d, prefix_from=d)
    return Decision(False, Reason.PREFILL_CHEAPER, remote_uncached, holder.load, decode_worker=d)

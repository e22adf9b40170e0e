"""Routing policy: pure functions from worker snapshots to a choice. No I/O.

Least outstanding work: a prefill worker's load is the prompt tokens queued on it (its
last reported queue plus what this router sent since); a decode worker's load is the KV
blocks in use (reported plus the blocks of streams this router placed since).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

# The roles a pool's work goes to: a mixed worker (pdserve/elastic_worker) takes decode streams,
# and prefills the ones it takes itself (pdserve/router/local_prefill.py), never others'.
SERVES = {"prefill": ("prefill",), "decode": ("decode", "mixed")}


@dataclass(frozen=True)
class WorkerSnapshot:
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed" (a decode worker that also prefills its own requests)
    healthy: bool
    draining: bool = False
    queued_tokens: int = 0  # prefill load
    blocks_used: int = 0  # decode load
    blocks_total: int = 0
    blocks_unbounded: int = 0  # of blocks_used: held by requests without a limit (preempted first)
    inflight: int = 0  # requests this router has on the worker
    last_placed: int = 0  # this router's placement sequence number of its last request (0: never)
    local_token_s: float | None = None  # a decode worker's measured wall seconds per prompt token it prefills; None: not yet
    verify_kv: bool | None = None  # its verify_kv_transfers setting (WorkerStats.verify_kv); None: not heard yet
    loras: frozenset[str] | None = None  # the LoRA adapters it holds (WorkerStats.lora_names); None: LoRA off or not heard

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class Choice:
    worker_id: str | None  # None: nobody can take it
    reason: str
    saturated: bool = False  # nobody can take it now, but could later (RESOURCE_EXHAUSTED)
    too_large: bool = False  # nobody could ever take it (INVALID_ARGUMENT)
    # The pool has no routable worker at all (a crash, a restart): the supervisor starts a
    # replacement, so the caller may wait for one within its deadline (UNAVAILABLE after).
    pool_empty: bool = False
    # Which rule chose (a metric label, router.kv_policy.RULES): "load", "cache", "balance",
    # "round_robin", "only" (one candidate); empty when nobody was chosen.
    rule: str = ""
    cached_tokens: int = 0  # prompt tokens the chosen prefill worker caches, per the router's index


def _no_candidate(workers: list[WorkerSnapshot], role: str) -> Choice:
    """Why nobody of ``role`` can take it: none routable at all, or every routable one was tried."""
    if any(w.role in SERVES[role] and w.routable for w in workers):
        return Choice(None, f"every healthy {role} worker was tried")
    return Choice(None, f"no healthy {role} worker", pool_empty=True)


def avoiding(pick: Callable[[frozenset[str]], Choice], exclude: frozenset[str], avoid: Iterable[str]) -> Choice:
    """``pick(exclude | avoid)`` where it finds a worker, else ``pick(exclude)``: the workers to
    ``avoid`` (a request's failed transfers, ``CallContext.avoid``) are a preference, never a
    refusal, for they may be all that is left."""
    avoid = frozenset(avoid) - exclude
    if avoid:
        choice = pick(exclude | avoid)
        if choice.worker_id is not None:
            return choice
    return pick(exclude)


def prefer_holders(workers: list[WorkerSnapshot], lora_name: str) -> list[WorkerSnapshot]:
    """The snapshots a request of LoRA adapter ``lora_name`` routes over, pool by pool: the
    routable workers that hold the adapter where any does; else those running with LoRA (one
    may have joined, or restarted, since the load: the router gives it the adapter after its
    next poll, ``pdserve.router.lora_admin``); else all. The others are made unroutable: they
    would refuse the request. "Holds" is "loaded" (``LLMEngine.lora_names``): every worker loads
    every adapter, and which of them sits in a device slot changes step by step, so it is no
    routing signal. The base model ("") routes over every worker."""
    if not lora_name:
        return workers
    levels = (lambda w: w.loras is not None and lora_name in w.loras, lambda w: w.loras is not None)
    out = list(workers)
    for roles in SERVES.values():
        members = [i for i, w in enumerate(out) if w.role in roles]
        level = next((ok for ok in levels if any(out[i].routable and ok(out[i]) for i in members)), None)
        if level is None:
            continue
        for i in members:
            if not level(out[i]):
                out[i] = dataclasses.replace(out[i], healthy=False)
    return out


def verify_agrees(holder: bool | None, reader: bool | None) -> bool:
    """Whether a holder and a reader of KV may be paired: both verify it or neither does
    (``verify_kv_transfers`` is one setting for the whole cluster; only a rollout that changes
    it, ``pdserve.cluster.rollout.roll_verify``, leaves the two halves differing). A reader that
    verifies refuses KV that comes without checksums (fail closed: the request goes round
    again), and one that does not leaves unchecked what the cluster is being set to check; so
    the router pairs neither. Unknown (not polled yet) agrees with both."""
    return holder is None or reader is None or holder == reader


def disagreeing(workers: Iterable[WorkerSnapshot], verify_kv: bool | None, role: str) -> frozenset[str]:
    """The workers of ``role``'s pool (``SERVES``) that may not pair with a worker whose
    setting is ``verify_kv`` (``verify_agrees``): the exclusions of a prefill or decode choice."""
    return frozenset(w.worker_id for w in workers
                     if w.role in SERVES[role] and not verify_agrees(w.verify_kv, verify_kv))


def pick_prefill(workers: Iterable[WorkerSnapshot], exclude: frozenset[str] = frozenset(),
                 prompt_tokens: int = 0, max_queued_tokens: int | None = None) -> Choice:
    """The routable prefill worker with the fewest queued prompt tokens (ties: fewest in flight,
    then the one given work least recently, so idle workers take turns, then id). With ``max_queued_tokens``, a worker whose queue would pass it is full."""
    candidates = prefill_candidates(workers, exclude, prompt_tokens, max_queued_tokens)
    if isinstance(candidates, Choice):
        return candidates
    best = min(candidates, key=least_loaded)
    return Choice(best.worker_id, f"least queued prompt tokens ({best.queued_tokens})", rule="load")


def least_loaded(w: WorkerSnapshot) -> tuple:
    """Sort key of prefill workers by load, with the tie-breaks ``pick_prefill`` documents."""
    return (w.queued_tokens, w.inflight, w.last_placed, w.worker_id)


def prefill_candidates(workers: Iterable[WorkerSnapshot], exclude: frozenset[str], prompt_tokens: int,
                       max_queued_tokens: int | None) -> list[WorkerSnapshot] | Choice:
    """The prefill workers that may take a prompt of ``prompt_tokens``: routable, not in
    ``exclude``, with room in their queue. When there are none, the ``Choice`` saying why."""
    workers = list(workers)
    candidates = [w for w in workers if w.role == "prefill" and w.routable and w.worker_id not in exclude]
    if not candidates:
        return _no_candidate(workers, "prefill")
    if max_queued_tokens is not None:
        candidates = [w for w in candidates if w.queued_tokens + prompt_tokens <= max_queued_tokens]
        if not candidates:
            return Choice(None, f"every prefill worker's queue is full ({max_queued_tokens} prompt tokens each)",
                          saturated=True)
    return candidates


def pick_decode(workers: Iterable[WorkerSnapshot], blocks_needed: int,
                exclude: frozenset[str] = frozenset(), limited: bool = False) -> Choice:
    """The routable decode worker with the least of its KV in use (ties as for prefill).

    Workers that cannot fit ``blocks_needed`` are skipped; if none can, the answer says so
    (the caller returns RESOURCE_EXHAUSTED rather than queueing without bound). A ``limited``
    request (the client set max_tokens) counts the blocks of requests without a limit as
    room: the decode engine preempts those first (pdserve/engine/core/scheduler.py), so requests that
    may run to the context's end cannot keep limited ones out.
    """
    workers = list(workers)
    candidates = [w for w in workers if w.role in SERVES["decode"] and w.routable and w.worker_id not in exclude]
    if not candidates:
        return _no_candidate(workers, "decode")
    largest = max(w.blocks_total for w in candidates)
    if blocks_needed > largest:
        return Choice(None, f"prompt + max_tokens needs {blocks_needed} KV blocks; the largest decode "
                      f"worker holds {largest}", too_large=True)
    def room(w: WorkerSnapshot) -> int:
        return w.blocks_total - w.blocks_used + (min(w.blocks_unbounded, w.blocks_used) if limited else 0)

    fitting = [w for w in candidates if room(w) >= blocks_needed]
    if not fitting:
        return Choice(None, f"every decode worker's KV cache is full (request needs {blocks_needed} blocks)",
                      saturated=True)
    best = min(fitting, key=lambda w: (w.blocks_used / max(w.blocks_total, 1), w.inflight, w.last_placed,
                                      w.worker_id))
    return Choice(best.worker_id, f"least KV in use ({best.blocks_used}/{best.blocks_total} blocks)")

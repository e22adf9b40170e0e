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

The load is the decode worker's share of KV blocks in use (what the router's decode
choice already ranks by, with the blocks this router has placed since the last poll): it
grows with both the number of streams and their lengths, which is what a prompt's extra
step work competes with. The uncached count subtracts a known prefix-cache overlap on that
decode worker (a KV-aware index may supply one; without it the whole prompt counts).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefillConfig:
    colocated: bool = False  # no prefill pool: every request prefills on its worker
    # Conditional disaggregation: prompts with fewer uncached tokens than this prefill on
    # their decode worker. 0: off, every prompt goes to the prefill pool. Off by default;
    # benchmarks/conditional.py measures a threshold (BENCHMARKS.md).
    max_tokens: int = 0
    # ... and only on a decode worker with less than this share of its KV blocks in use (0..1].
    max_load: float = 0.5

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be at least 0, got {self.max_tokens}")
        if not 0 < self.max_load <= 1:
            raise ValueError(f"local_prefill_max_load must be in (0, 1], got {self.max_load}")


class Reason(str, enum.Enum):
    COLOCATED = "colocated"  # local: colocated mode
    SHORT_PROMPT = "short_prompt"  # local: the rule held
    OFF = "off"  # remote: conditional disaggregation is off
    LONG_PROMPT = "long_prompt"  # remote: too many uncached tokens
    BUSY_WORKER = "busy_worker"  # remote: the decode worker's load is at the limit
    MIXED_WORKER = "mixed_worker"  # local: a mixed worker whose queue is the shortest
    PREFILL_SHORTER = "prefill_shorter"  # remote: a prefill worker's queue is shorter than the mixed worker's
    NO_PREFILL_WORKER = "no_prefill_worker"  # local: the cluster's prefill workers are all mixed now


@dataclass(frozen=True)
class Decision:
    local: bool
    reason: Reason
    uncached_tokens: int
    load: float

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
    if mixed.any_mixed and mixed.prefill_queue is None:
        return Decision(True, Reason.NO_PREFILL_WORKER, uncached, load)
    if config.max_tokens == 0:
        return Decision(False, Reason.OFF, uncached, load)
    if uncached >= config.max_tokens:
        return Decision(False, Reason.LONG_PROMPT, uncached, load)
    if load >= config.max_load:
        return Decision(False, Reason.BUSY_WORKER, uncached, load)
    return Decision(True, Reason.SHORT_PROMPT, uncached, load)

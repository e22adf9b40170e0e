"""Routing at scale with the real policy: ``router.policy.pick_prefill`` / ``pick_decode``
choose, but over the one candidate that can win instead of every worker of the pool.

Why that gives the same choice: both policies take the minimum of a key over the workers that
fit, and fitting is monotone in the key's first element (a prefill worker fits while its
queued tokens + the prompt stay under the limit; a decode worker while its free blocks cover
the request, and every decode worker has the same cache). So the worker with the smallest
key fits if any does, and the policy given only that worker makes the same choice (or says
the pool is saturated) as given all of them. ``tests/planner/test_routing.py`` checks it
against the full scan. Keys change only at a worker's own events, so a lazy heap, re-keyed
on ``touch``, yields the minimum in O(log n).
"""

from __future__ import annotations

import heapq
from typing import Callable

from planner.worker import SimWorker
from router.policy import WorkerSnapshot

KeyFn = Callable[[SimWorker], tuple]


class RoutingIndex:
    def __init__(self, key: KeyFn):
        self._key = key
        self._heap: list[tuple[tuple, int, SimWorker]] = []
        self._version: dict[str, int] = {}

    def touch(self, w: SimWorker) -> None:
        """``w``'s load changed (or it joined the pool): re-key it."""
        v = self._version.get(w.wid, 0) + 1
        self._version[w.wid] = v
        heapq.heappush(self._heap, (self._key(w), v, w))

    def remove(self, w: SimWorker) -> None:
        self._version[w.wid] = self._version.get(w.wid, 0) + 1  # every entry of it is now stale

    def best(self) -> SimWorker | None:
        while self._heap:
            _, v, w = self._heap[0]
            if v == self._version.get(w.wid):
                return w
            heapq.heappop(self._heap)
        return None


def snapshot(w: SimWorker, kind: str, inflight: int, last_placed: int) -> WorkerSnapshot:
    return WorkerSnapshot(w.wid, kind, True, queued_tokens=w.queued_tokens, blocks_used=w.used_blocks,
                          blocks_total=w.num_blocks, inflight=inflight, last_placed=last_placed)

"""Routing at scale with the real policy: ``pdserve.router.policy.pick_prefill`` / ``pick_decode``
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

from pdserve.planner.worker import SimWorker
from pdserve.router.policy import WorkerSnapshot

KeyFn = Callable[[SimWorker], tuple]


class RoutingIndex:
    """Keys must be unique per worker (the simulator's end with the worker id), so the minimum
    is one worker whatever the heap's shape: skipping a re-key that changes nothing and
    compacting stale entries never changes which worker ``best`` returns."""

    def __init__(self, key: KeyFn):
        self._key = key
        self._heap: list[tuple[tuple, int, SimWorker]] = []
        self._current: dict[str, tuple[tuple, int, SimWorker]] = {}  # worker -> its live entry
        self._version = 0

    def touch(self, w: SimWorker) -> None:
        """``w``'s load changed (or it joined the pool): re-key it."""
        key = self._key(w)
        entry = self._current.get(w.wid)
        if entry is not None and entry[0] == key:
            return  # most touches after a step leave the key as it was
        self._version += 1
        entry = (key, self._version, w)
        self._current[w.wid] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._current) + 64:
            self._compact()

    def remove(self, w: SimWorker) -> None:
        self._current.pop(w.wid, None)  # every entry of it is now stale

    def best(self) -> SimWorker | None:
        heap, current = self._heap, self._current
        while heap:
            entry = heap[0]
            if current.get(entry[2].wid) is entry:
                return entry[2]
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        """Drop stale entries (each worker re-keyed since, or removed): the heap stays O(workers)."""
        self._heap = list(self._current.values())
        heapq.heapify(self._heap)


def snapshot(w: SimWorker, kind: str, inflight: int, last_placed: int) -> WorkerSnapshot:
    return WorkerSnapshot(w.wid, kind, True, queued_tokens=w.queued_tokens, blocks_used=w.used_blocks,
                          blocks_total=w.num_blocks, inflight=inflight, last_placed=last_placed)

"""The optional ``session_id`` hint (SGLang's and Dynamo's): which decode worker served a
session's last attempt, remembered in a small LRU map.

The router finds a conversation from its tokens alone (the KV index: decode workers publish
the blocks of each answer). The hint only covers the gap before the index knows (a follow-up
sent within one stats poll of the last answer): the attempt then prefers the worker that
served the session last. A wrong or stale hint costs time, never a token."""

from __future__ import annotations

from collections import OrderedDict

MAX_SESSIONS = 4096  # sessions remembered; the least recently used is forgotten first
MAX_SESSION_ID_CHARS = 256  # a session_id longer than this is a 400 (router.validation)


class SessionHints:
    """session id -> the decode worker address that served it last, at most ``capacity``."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._workers: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, session_id: str) -> str | None:
        """The worker that served ``session_id`` last, if remembered (and now most recent)."""
        worker = self._workers.get(session_id)
        if worker is not None:
            self._workers.move_to_end(session_id)
        return worker

    def remember(self, session_id: str, worker: str) -> None:
        self._workers[session_id] = worker
        self._workers.move_to_end(session_id)
        while len(self._workers) > self.capacity:
            self._workers.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        """Drop every session that points at ``worker`` (it left the pool)."""
        for session_id in [s for s, w in self._workers.items() if w == worker]:
            del self._workers[session_id]

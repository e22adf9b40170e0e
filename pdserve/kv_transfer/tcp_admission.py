"""The block server's admission: how many connections it holds, and how many of them have not
yet shown a claimed lease's token (``pdserve.kv_transfer.tcp_wire``'s ``max_connections`` and
``max_unauthenticated``), so that a flood of connections is turned away before each costs a
thread."""

from __future__ import annotations

import threading


class Admission:
    """The connections a server holds: ``open`` in all, ``unauthenticated`` among them; who may
    come in, under the two caps; and how many were turned away. Thread-safe."""

    def __init__(self, max_connections: int, max_unauthenticated: int):
        self.max_connections, self.max_unauthenticated = max_connections, max_unauthenticated
        self.open = self.unauthenticated = self.refused = 0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            if self.open >= self.max_connections or self.unauthenticated >= self.max_unauthenticated:
                self.refused += 1
                return False
            self.open += 1
            self.unauthenticated += 1
            return True

    def _authenticated(self) -> None:
        with self._lock:
            self.unauthenticated -= 1

    def _closed(self, authenticated: bool) -> None:
        with self._lock:
            self.open -= 1
            self.unauthenticated -= not authenticated


class Ticket:
    """One admitted connection's place: ``authenticated`` once its read names a claimed lease,
    given back by ``close`` when the connection ends."""

    def __init__(self, admission: Admission):
        self._admission, self._authenticated = admission, False

    def authenticated(self) -> None:
        if not self._authenticated:
            self._authenticated = True
            self._admission._authenticated()

    def close(self) -> None:
        self._admission._closed(self._authenticated)

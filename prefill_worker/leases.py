"""Leases on held KV: which request's blocks a lease keeps, and until when. Pure Python."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    expires_at: float  # time.monotonic() deadline


@dataclass
class LeaseTable:
    leases: dict[str, Lease] = field(default_factory=dict)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)
    expired_total: int = 0

    def add(self, lease: Lease) -> None:
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id))

    def pop(self, lease_id: str) -> Lease | None:
        """Remove and return the lease (None if unknown or already gone)."""
        return self.leases.pop(lease_id, None)

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline has passed."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self.leases.pop(lease_id, None)
            if lease is not None:
                out.append(lease)
        self.expired_total += len(out)
        return out

    def __len__(self) -> int:
        return len(self.leases)

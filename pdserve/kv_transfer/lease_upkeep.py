"""The upkeep of a holder's leases, written once for every holder of KV: a prefill worker's
held prompts (``pdserve.prefill_worker.worker``) and a decode worker's held prefixes
(``pdserve.decode_worker.prefix_hold``, the reversed pull).

A lease ends in three ways that need no call from anyone (``pdserve.kv_transfer.handoff``
describes the hand-off): its reader's last read lands (the read's notice, PULLED; a reader of
streamed KV starts it only once every earlier read of the lease is done, so no read of the
lease is left running when its blocks are freed), nobody
renewed it in time (EXPIRED), or it is unclaimed and the router it was granted to stopped
polling (OWNER_LOST). ``upkeep`` applies all three to a ``LeaseTable`` and hands each lease
that ended to the holder, whose part is to free its blocks. Pure bookkeeping, no I/O: the
holder's engine thread calls it with the notices its agent delivered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pdserve.kv_transfer.handoff import Lease, LeaseTable, ReadNotice, ReleaseReason

# A holder's part when a lease ends: free its blocks (and whatever else the lease stood for).
Ended = Callable[[Lease, ReleaseReason], None]


class OwnerClock:
    """When each router incarnation last called a holder; one silent for ``timeout_s`` is
    taken for dead (routers poll every 0.2 s), and the unclaimed leases granted to it end."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}

    def seen(self, owner: str, now: float | None = None) -> None:
        if owner:
            self._seen[owner] = time.monotonic() if now is None else now

    def take_silent(self, now: float) -> set[str]:
        """The owners silent for longer than ``timeout_s``, forgotten from now on."""
        silent = {o for o, seen in list(self._seen.items()) if now - seen > self.timeout_s}
        for owner in silent:
            self._seen.pop(owner, None)
        return silent


def upkeep(table: LeaseTable, notices: Iterable[bytes], now: float, ended: Ended,
           owners: OwnerClock | None = None) -> None:
    """End the leases of ``table`` whose last read ``notices`` tell of (PULLED), whose
    deadline has passed (EXPIRED), and, with ``owners``, the unclaimed ones of routers gone
    silent (OWNER_LOST); ``ended`` is called once for each."""
    for note in notices:
        notice = ReadNotice.decode(note)
        if table.read_ended(notice):  # not an early read's, nor one rank pair's of several
            lease = table.release(notice.lease_token, ReleaseReason.PULLED)
            if lease is not None:
                ended(lease, ReleaseReason.PULLED)
    for lease in table.pop_expired(now):
        ended(lease, ReleaseReason.EXPIRED)
    silent = owners.take_silent(now) if owners is not None else set()
    if silent:
        for lease in table.pop_unclaimed_of(silent):
            ended(lease, ReleaseReason.OWNER_LOST)

"""One read as an agent tracks it: its state (``TransferState``, the lifecycle told in
``pdserve.kv_transfer.base``), its ``TransferHandle``, and the agent's running ``TransferStats``."""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from pdserve.kv_transfer.sharding import HeadSlice


class TransferState(enum.IntEnum):
    """State of one read; ``PENDING < TRANSFERRING < DONE`` is the happy path's order."""

    PENDING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4

    @property
    def is_terminal(self) -> bool:
        """True once the read can no longer change state."""
        return self >= TransferState.DONE


@dataclass
class TransferStats:
    """Cumulative counters of one agent (reader side), read by the metrics exporter.

    ``bytes`` counts only completed reads (blocks * block_bytes); ``seconds`` sums the time
    from ``start_read`` to DONE being observed. ``verify_failures`` counts the reads among
    ``failures`` whose bytes landed but did not match their checksums. Updates and
    ``snapshot`` are thread-safe.
    """

    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    cancels: int = 0
    seconds: float = 0.0
    verify_failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> TransferStats:
        """A consistent copy that later updates do not change."""
        with self._lock:
            return dataclasses.replace(self, _lock=threading.Lock())

    def record(self, state: TransferState, nbytes: int, seconds: float, verify_failed: bool = False) -> None:
        """Account one read that reached terminal ``state`` (FAILED with ``verify_failed``:
        its bytes did not match their checksums)."""
        with self._lock:
            if state == TransferState.DONE:
                self.bytes += nbytes
                self.transfers += 1
                self.seconds += seconds
            elif state == TransferState.FAILED:
                self.failures += 1
                self.verify_failures += verify_failed
            elif state == TransferState.CANCELLED:
                self.cancels += 1


@dataclass(eq=False)
class TransferHandle:
    """One READ of ``remote_block_ids`` on ``peer`` into ``local_block_ids`` (same order)."""

    transfer_id: int
    peer: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    notify: bytes
    last_block_bytes: int  # bytes of the last block to land (block_bytes: all of it)
    nbytes: int
    started_at: float  # time.monotonic() at start_read
    post_at: float  # when the read may be posted (started_at + inject_delay_s)
    # The holder's checksum of each block (``pdserve.kv_transfer.checksum``), checked once the
    # bytes land; None: not checked.
    checksums: Optional[tuple[int, ...]] = None
    # A read by head (``pdserve.kv_transfer.sharding``): which bytes of each row move, and the
    # rows of the last block; None: whole blocks. Its checksums are ``slice.groups`` a block.
    slice: Optional[HeadSlice] = None
    last_rows: int = 0
    state: TransferState = TransferState.PENDING
    error: Optional[str] = None  # why it FAILED
    verify_failed: bool = False  # FAILED because a block did not match its checksum
    finished_at: Optional[float] = None
    backend_handle: Any = field(default=None, repr=False)  # owned by the backend
    # Descriptors a side a backend posted where it named them itself (coalesced, staged); None:
    # the plan's count (``descriptors``).
    posted_descriptors: Optional[int] = None

    @property
    def descriptors(self) -> int:
        """Descriptors a side the read takes: as posted where the backend says, else one a block,
        or by head one a row of each."""
        if self.posted_descriptors is not None:
            return self.posted_descriptors
        if self.slice is None or self.slice.whole_rows:
            return len(self.local_block_ids)
        return (len(self.local_block_ids) - 1) * self.slice.block_rows + self.last_rows

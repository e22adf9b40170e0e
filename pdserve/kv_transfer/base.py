"""The KV-transfer contract: an agent per worker that READs peers' cache blocks into its own.

Lifecycle of one read, as ``poll`` reports it (``TransferState``):

- PENDING: accepted by ``start_read`` but not yet posted (only with ``inject_delay_s``).
- TRANSFERRING: posted to the backend; bytes are moving.
- DONE: every block is in place locally, matches its checksum when the read was given the
  holder's (``pdserve.kv_transfer.checksum``), and the holder is (being) notified; bytes
  counted.
- FAILED: the backend reported an error, the peer went away, ``read_timeout_s`` passed, or
  a block that landed does not match its checksum (also counted in
  ``stats.verify_failures``); counted in ``stats.failures``. Local target blocks hold
  undefined bytes.
- CANCELLED: the caller stopped it with ``cancel``; nothing counted as transferred.

Terminal states are DONE, FAILED and CANCELLED. A read stopped while bytes moved (cancelled,
or FAILED by ``read_timeout_s``) may still write its local blocks until the backend ends it (UCX
goes on writing a NIXL READ after ``release``): ``read_over`` tells, driving the backend, and
until it does the blocks are not reused (``pdserve.shell.read_quarantine``). The holder (the side whose blocks were read) learns of each completed read
through ``get_notifications``. No NIXL import here: backends live in their own modules.
"""

from __future__ import annotations

import abc
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Callable, ClassVar, Optional

import torch

from pdserve.kv_transfer import checksum
from pdserve.kv_transfer.errors import InvalidTransferRequest, TransferError
from pdserve.kv_transfer.layout import CacheLayout, block_bytes_view
from pdserve.kv_transfer.metadata import check_peer, peer_shard
from pdserve.kv_transfer.read_args import checked_read
from pdserve.kv_transfer.read import TransferHandle, TransferState, TransferStats
from pdserve.kv_transfer.sharding import HeadSlice, KVShard, head_slice
from pdserve.protos import kv_transfer_pb2

__all__ = ["KVTransferAgent", "MAX_PEER_BLOCKS"]

logger = logging.getLogger(__name__)

# wait() sleeps between polls (never spins: a spinning caller holds the GIL that the tcp
# reader thread needs) and backs off to this cap, which bounds the added latency per read.
_POLL_SLEEP_MAX_S = 2e-4
# The most blocks a peer may announce (``max_peer_blocks``'s default). A peer's block count
# sizes what this agent allocates for it (NIXL: a descriptor table of 24 bytes a block), so it
# is bounded before anything is. 4M blocks is a 96 MiB table, and more than any cache holds
# at 16 tokens a block: 1.4 TiB of the default model's KV, 8 TiB of an 8B model's.
MAX_PEER_BLOCKS = 1 << 22


class KVTransferAgent(abc.ABC):
    """Moves KV blocks between this worker's cache and its peers' (pull model).

    The whole cache is registered once at construction. Peers are added from the protobuf
    metadata that ``local_metadata`` produces on the other side. All methods are thread-safe
    (one lock per agent; backend calls are short and non-blocking).

    Options common to every backend:
      inject_delay_s: test/fault-injection hook: each read is posted this many seconds after
        ``start_read`` (state PENDING until then), so its completion is delayed by as much.
      read_timeout_s: a read not DONE this long after being posted is stopped and FAILED.
      max_peer_blocks: the most blocks a peer's metadata may announce (``add_remote``).
      shard: which KV heads the cache holds and how its blocks are laid out
        (``pdserve.kv_transfer.sharding``), published in ``local_metadata``; a tensor-parallel
        rank's agent needs one. Two agents that both have one read each other by head; None:
        this agent reads and serves whole blocks only.
    """

    backend_name: ClassVar[str]
    # Whether the holder serves each read itself and checks it with ``read_guard`` against the
    # read's ``notify`` (tcp). False for one-sided reads (NIXL), where a read with an empty
    # ``notify`` completes without any work on the holder's side.
    guards_reads: ClassVar[bool] = False

    def __init__(self, name: str, cache: torch.Tensor, *, inject_delay_s: float = 0.0,
                 read_timeout_s: float = 30.0, max_peer_blocks: int = MAX_PEER_BLOCKS,
                 shard: Optional[KVShard] = None):
        if not isinstance(name, str) or not name:
            raise InvalidTransferRequest("agent name must be a non-empty string", field="name")
        if inject_delay_s < 0:
            raise InvalidTransferRequest(f"inject_delay_s must be >= 0, got {inject_delay_s}",
                                         field="inject_delay_s", limit=0)
        if read_timeout_s <= 0:
            raise InvalidTransferRequest(f"read_timeout_s must be > 0, got {read_timeout_s}",
                                         field="read_timeout_s", limit=0)
        if max_peer_blocks < 1:
            raise InvalidTransferRequest(f"max_peer_blocks must be >= 1, got {max_peer_blocks}",
                                         field="max_peer_blocks", limit=1)
        self.name = name
        self.cache = cache
        self.layout = CacheLayout.of(cache)
        if shard is not None and shard.block_bytes != self.layout.block_bytes:
            raise InvalidTransferRequest(f"shard describes {shard.block_bytes} bytes a block but the cache's blocks "
                                         f"are {self.layout.block_bytes}", field="shard", limit=self.layout.block_bytes)
        self.shard = shard
        self._block_rows = block_bytes_view(cache)  # (num_blocks, block_bytes) uint8, for checksums
        self.inject_delay_s = float(inject_delay_s)
        self.read_timeout_s = float(read_timeout_s)
        self.max_peer_blocks = int(max_peer_blocks)
        self.stats = TransferStats()
        self._lock = threading.RLock()
        self._peers: dict[str, kv_transfer_pb2.AgentMetadata] = {}
        self._slices: dict[str, Optional[HeadSlice]] = {}  # peer -> what a read of it moves (None: blocks)
        self._inflight: dict[int, TransferHandle] = {}
        self._landing: dict[int, TransferHandle] = {}  # terminal reads whose backend may still write (read_over)
        self._ids = itertools.count()
        self._closed = False
        # Holder side: (lease token from the read's notify, block ids) -> whether to serve
        # the read. Backends that serve reads themselves (tcp) ask it; NIXL reads are
        # one-sided and never reach it. None: serve every read.
        self.read_guard: Optional[Callable[[str, list[int]], bool]] = None

    # ----------------------------------------------------------------- metadata / peers

    def local_metadata(self) -> kv_transfer_pb2.AgentMetadata:
        """What a peer needs to read from this agent; send it over the control channel."""
        self._check_open()
        meta = kv_transfer_pb2.AgentMetadata(
            agent_name=self.name, backend=self.backend_name,
            base_address=self.layout.base_address, block_bytes=self.layout.block_bytes,
            num_blocks=self.layout.num_blocks, memory_type=self.layout.memory_type,
            device_id=self.layout.device_id)
        if self.shard is not None:
            meta.shard.CopyFrom(self.shard.to_proto())
        self._fill_backend_metadata(meta)
        return meta

    def add_remote(self, meta: kv_transfer_pb2.AgentMetadata) -> str:
        """Register a peer from its metadata and return its name (the ``peer`` argument of
        ``start_read``). Idempotent: the same metadata again is a cached no-op; new metadata
        under a known name (a restarted peer) replaces the old connection. Raises
        InvalidTransferRequest for metadata this agent cannot read from, such as a shard that
        shares no head with this agent's."""
        self._check_remote(meta)
        theirs = peer_shard(meta)
        hs = head_slice(self.shard, theirs) if self.shard is not None and theirs is not None else None
        name = meta.agent_name
        with self._lock:
            self._check_open()
            known = self._peers.get(name)
            if known is not None and known == meta:
                return name
            if known is not None:
                self._peers.pop(name)
                self._drop_peer(name)
            self._connect_peer(meta)
            self._peers[name], self._slices[name] = meta, hs
        return name

    def _check_remote(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        check_peer(meta, name=self.name, backend=self.backend_name, layout=self.layout, shard=self.shard,
                   max_peer_blocks=self.max_peer_blocks)

    # ----------------------------------------------------------------- reads

    def start_read(self, peer: str, remote_block_ids: Sequence[int],
                   local_block_ids: Sequence[int], notify: bytes = b"",
                   last_block_bytes: Optional[int] = None,
                   checksums: Optional[Sequence[int]] = None) -> TransferHandle:
        """Begin READing ``remote_block_ids`` of ``peer`` into ``local_block_ids`` (pairwise).

        Returns at once; follow with ``poll``/``wait``. When the read completes the peer gets
        ``notify`` from its ``get_notifications`` (empty ``notify``: no notification).
        ``last_block_bytes``: move only the first this-many bytes of the last block (a
        partly filled block); None moves it whole. ``checksums``: the holder's checksum of
        each block (``block_checksums`` on its side), checked when the bytes land: a block
        that does not match fails the read. None: not checked.
        A peer holding other heads than this agent's (both have shards) is read by head: of each
        block, only the heads both hold move, into their place here; ``last_block_bytes`` counts
        this agent's bytes (whole tokens), and ``checksums`` has the holder's sums of the
        checksum groups those heads span (``RankRead.checksums``), that many a block.
        Raises InvalidTransferRequest for an unknown peer, unequal lengths or ids out of range.
        """
        with self._lock:
            self._check_open()
            meta = self._peers.get(peer)
            if meta is None:
                raise InvalidTransferRequest(
                    f"unknown peer {peer!r}: call add_remote with its metadata first",
                    field="peer", peer=peer)
            handle = checked_read(next(self._ids), peer, meta, self.layout, self._slices[peer], remote_block_ids,
                                  local_block_ids, notify, last_block_bytes, checksums, self.inject_delay_s)
            self._inflight[handle.transfer_id] = handle
            if self.inject_delay_s == 0:
                self._post(handle)
            return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """Advance and return the read's state without blocking."""
        with self._lock:
            if handle.state.is_terminal:
                return handle.state
            self._check_owned(handle)
            now = time.monotonic()
            if handle.state == TransferState.PENDING:
                if now >= handle.post_at:
                    self._post(handle)
                return handle.state
            try:
                state = self._poll_backend(handle)
            except Exception as exc:  # backend errors (peer gone, UCX error) fail this read
                self._finish(handle, TransferState.FAILED, f"{type(exc).__name__}: {exc}")
                return handle.state
            if state.is_terminal:
                error = None if state == TransferState.DONE else "backend reported an error"
                self._finish(handle, state, handle.error or error)
            elif now - handle.post_at > self.read_timeout_s:
                self._finish(handle, TransferState.FAILED,
                             f"not done {self.read_timeout_s}s after posting (read_timeout_s)")
            return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferState:
        """Poll until the read is terminal or ``timeout_s`` passes; returns the last state."""
        deadline = time.monotonic() + timeout_s
        sleep = 1e-5
        while True:
            state = self.poll(handle)
            if state.is_terminal or time.monotonic() >= deadline:
                return state
            time.sleep(sleep)
            sleep = min(sleep * 2, _POLL_SLEEP_MAX_S)

    def block_checksums(self, block_ids: Sequence[int],
                        last_block_bytes: Optional[int] = None) -> tuple[int, ...]:
        """The checksums of this cache's ``block_ids`` (in order; the last one over its first
        ``last_block_bytes``, None: whole) that a reader of them checks: call it once their
        contents are final, and send them with the lease. With a shard of ``checksum_groups``
        G > 1, G sums a block (``checksums_per_block``), group g over its g-th G-th of the heads
        of every row, so that a reader of a part of the heads checks what it read."""
        shard = self.shard
        if shard is None or shard.checksum_groups == 1:
            return checksum.block_checksums(self._block_rows, block_ids, last_block_bytes)
        last_rows = shard.block_rows if last_block_bytes is None else int(last_block_bytes) // shard.row_bytes
        return checksum.row_checksums(self._block_rows, block_ids, shard.row_bytes, 0,
                                      shard.row_bytes // shard.checksum_groups, shard.checksum_groups, last_rows)

    @property
    def checksums_per_block(self) -> int:
        """How many sums ``block_checksums`` gives a block."""
        return 1 if self.shard is None else self.shard.checksum_groups

    def _verified(self, handle: TransferHandle) -> bool:
        """Whether the bytes of a read the backend reports DONE match its checksums (True when
        it has none); a mismatch is logged with the block and the peer, and marks the handle."""
        error = checksum.verify(self._block_rows, handle)
        if error is not None:
            handle.verify_failed, handle.error = True, error
            logger.warning("KV read %d from peer %r failed verification: %s", handle.transfer_id, handle.peer, error)
        return error is None

    def cancel(self, handle: TransferHandle) -> TransferState:
        """Cancel a read that is not yet terminal and free its resources; counts nothing
        as transferred. A terminal read is left as it is. Returns the final state."""
        with self._lock:
            if not handle.state.is_terminal:
                self._check_owned(handle)
                self._finish(handle, TransferState.CANCELLED, None)
            return handle.state

    def read_over(self, handle: TransferHandle) -> bool:
        """Whether no byte of this read can land in its local blocks any more: it is terminal
        and its backend has ended it. Each call drives a read stopped in flight (module docstring)."""
        with self._lock:
            if not handle.state.is_terminal:
                return False
            if self._landing.get(handle.transfer_id) is not handle:
                return True
            if not self._end_backend(handle):
                return False
            del self._landing[handle.transfer_id]
            return True

    def landing(self) -> int:
        """Reads terminal for their caller whose backend has not yet ended them (``read_over``)."""
        with self._lock:
            return len(self._landing)

    def expect_reads(self, expected: bool, urgent: bool = True) -> None:
        """Tell the agent whether a peer may be reading from it now, so a backend that needs
        holder-side progress (NIXL) drives it only then; ``urgent`` False: no reader waits on
        those reads (streamed KV's early reads), so slower progress will do. The default needs
        none."""

    def in_flight(self) -> int:
        """Number of reads started and not yet terminal."""
        with self._lock:
            return len(self._inflight)

    def _check_owned(self, handle: TransferHandle) -> None:
        if self._inflight.get(handle.transfer_id) is not handle:
            raise InvalidTransferRequest(
                f"transfer {handle.transfer_id} was not started by agent {self.name!r}",
                field="handle", peer=handle.peer)

    def _post(self, handle: TransferHandle) -> None:
        handle.state = TransferState.TRANSFERRING
        try:
            state = self._start_backend(handle)
        except Exception as exc:  # e.g. the peer is already gone: a counted failure
            self._finish(handle, TransferState.FAILED, f"{type(exc).__name__}: {exc}")
            return
        if state.is_terminal:
            self._finish(handle, state, None if state == TransferState.DONE else
                         handle.error or "backend reported an error when posting")

    def _finish(self, handle: TransferHandle, state: TransferState,
                error: Optional[str]) -> None:
        """End the read in ``state``; a read that would be DONE is FAILED if its blocks do not
        match their checksums (every way a read completes, at its post or its poll, ends here)."""
        if state == TransferState.DONE and not self._verified(handle):
            state, error = TransferState.FAILED, handle.error
        handle.finished_at = time.monotonic()
        handle.state = state
        handle.error = error
        self._inflight.pop(handle.transfer_id, None)
        if handle.backend_handle is not None and not self._end_backend(handle):
            self._landing[handle.transfer_id] = handle  # still writing: read_over drives it on
        self.stats.record(state, handle.nbytes, handle.finished_at - handle.started_at, handle.verify_failed)

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Cancel reads in flight, drop peers and close the backend. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for handle in list(self._inflight.values()):
                self.cancel(handle)
            for name in list(self._peers):
                self._drop_peer(name)
            self._peers.clear()
            self._slices.clear()
            self._closed = True
            self._close_backend()

    def _end_backend(self, handle: TransferHandle) -> bool:
        """Ask the backend to end the read (``_free_backend``); True, and the handle's backend
        part dropped, once it has."""
        try:
            over = self._free_backend(handle)
        except Exception:  # a backend that cannot tell has not ended the read
            logger.warning("ending KV read %d failed", handle.transfer_id, exc_info=True)
            over = False
        if over:
            handle.backend_handle = None
        return over

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed", backend=self.backend_name)

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- backend hooks

    @abc.abstractmethod
    def get_notifications(self) -> list[bytes]:
        """Notifications received (as holder) since the last call, oldest first per peer."""

    @abc.abstractmethod
    def _fill_backend_metadata(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        """Set backend_metadata / tcp_address on this agent's metadata."""

    @abc.abstractmethod
    def _connect_peer(self, meta: kv_transfer_pb2.AgentMetadata) -> None:
        """Make ``meta.agent_name`` readable; raise TransferError if it cannot be."""

    @abc.abstractmethod
    def _drop_peer(self, name: str) -> None:
        """Forget a peer added by ``_connect_peer``; must not raise."""

    @abc.abstractmethod
    def _start_backend(self, handle: TransferHandle) -> TransferState:
        """Post the read; set ``handle.backend_handle``; return TRANSFERRING or terminal."""

    @abc.abstractmethod
    def _poll_backend(self, handle: TransferHandle) -> TransferState:
        """Non-blocking progress check of a posted read."""

    @abc.abstractmethod
    def _free_backend(self, handle: TransferHandle) -> bool:
        """Stop the read of ``handle.backend_handle`` if it is still running (cancel, timeout)
        and free it once the backend says it has ended; return whether it has (no byte lands
        after). Called again (``read_over``) until it returns True; must not raise."""

    @abc.abstractmethod
    def _close_backend(self) -> None:
        """Release everything the backend holds; must not raise."""


"""The KV hand-off from a prefill worker to a decode worker, in one place.

A prompt's KV changes hands like this:

1. The prefill worker computes it and keeps its blocks HELD under a lease (``LeaseTable.grant``),
   with the checksum of each block, taken once its contents are final
   (``pdserve.kv_transfer.checksum``). It answers ``Prefill`` with a ``KVHandle``: where the
   blocks are, which blocks, how many tokens, their checksums, and the lease token. The token
   is a secret: only the router and the decode worker the router picks learn it.
2. The decode worker allocates its own blocks, then claims the lease (``Claim`` RPC, then
   ``LeaseTable.claim``) before it reads a byte. A claim is refused for an unknown token,
   block ids that are not exactly the lease's, an expired lease or one already claimed (a
   replay). A claim renews the lease for ``lease_seconds``, and the reader renews its claim
   (``Claim`` with ``renew``, ``LeaseTable.renew_claim``) every third of that until its read
   has ended: a claimed lease is never freed by expiry under a reader that is alive and
   reading, however long its read waits to start or takes, and the lease of a reader that
   died expires ``lease_seconds`` after its last renewal. (The holder cannot tell when a
   one-sided NIXL read ends; only the reader can.)
3. The read runs (NIXL or tcp); the tcp holder serves only the blocks of a claimed lease
   (``LeaseTable.read_allowed``). Every read tells the holder a ``ReadNotice`` (the lease
   token, and whether it is the lease's last read). The last read's notice ends the lease
   (PULLED). The reader checks every block it read against its checksum before it uses it: a
   mismatch fails the transfer (the request re-prefills elsewhere).
4. Every other end is a ``Release`` naming the token and a ``ReleaseReason``: the decode side
   gave up (ABORTED, TRANSFER_FAILED), or it could not take the request after claiming and
   hands its claim back unread (RETURNED: the lease stays held, claimable again by the decode
   worker the router tries next). ``LeaseTable.release`` applies either kind, and
   ``ReleaseReason.ends_lease`` tells them apart. An unclaimed lease whose router has died (it
   stopped polling the holder's Stats) is freed at once (OWNER_LOST): only that router knew
   the token. A lease nobody releases expires (EXPIRED).

Streamed KV (``PrefillStream``): the lease is granted as soon as the prompt has blocks and
its first chunk has run, not after the whole prompt, and is renewed at every chunk. The decode
worker claims it early and reads each block once its chunk is done, while later chunks
compute. Those early reads carry a notice with ``ends_lease`` False: they are authorized by
the lease like any read but do not end it. Each block's checksum is taken when the chunk that
computed it has run and travels with the progress that announces it (``WatchKV``). The last
read, after the whole prompt, ends the lease (PULLED) as before. Any other end (the decode
side gave up, the prompt failed) is the same Release as above.

Words, each with one meaning across pdserve:

- *release*: let go of a lease: end it, or (RETURNED) only the claim on it. The ``Release``
  RPC, ``LeaseTable.release`` and ``ReleaseReason`` use it, and nothing else does.
- *free*: give KV blocks back to the engine's pool (``LLMEngine.free_held``); a lease's end
  frees its blocks.
- *abort*: stop a request wherever it is, freeing what it holds (``LLMEngine.abort``, the
  workers' ``Abort`` RPC). ABORTED, as a release reason, means the lease's request was
  aborted before its KV was read. On a prefill worker, KV handed out under a lease belongs to
  the lease: aborting by request id does not free it.
- *cancel*: stop one operation in flight, not a request: a KV read
  (``KVTransferAgent.cancel``, state CANCELLED), an asyncio task or gRPC call.
- *forget*: a prefill worker drops its record of a request, the one exit every path ends in
  (``PrefillWorker.forget``).

Pure Python, no I/O. The prefill worker owns one ``LeaseTable``. Its engine thread grants,
ends and expires leases; claims and give-backs come straight from the gRPC loop, so a
claim never waits behind a long prefill step. One lock makes every operation atomic.
"""

from __future__ import annotations

import enum
import heapq
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.protos import worker_pb2

if TYPE_CHECKING:
    from pdserve.engine.attention.kv_cache import CacheSpec


@dataclass(frozen=True)
class KVHandle:
    """Where a prompt's KV is held, and the capability to read it."""

    prefill_address: str  # host:port of the holder's gRPC server
    block_ids: tuple[int, ...]  # in token order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    lease_token: str  # secret: claims, reads and releases name it
    # The checksum of each block final when the handle was made (a prefix of block_ids; all of
    # them but for streamed KV's early handle); () where the holder checksums nothing.
    block_checksums: tuple[int, ...] = ()
    # The salt the holder keyed the blocks by (``kv_salt``, its LoRA adapter's fingerprint in it);
    # "" where not stated. A reader whose own salt differs refuses an adapter's KV (worker.proto).
    kv_salt: str = ""

    def last_block_bytes(self, spec: CacheSpec) -> int:
        """Bytes of the last, partly filled block that a read must move (``spec.tail_bytes``)."""
        return spec.tail_bytes(self.num_tokens - (len(self.block_ids) - 1) * spec.block_size)

    def to_proto(self) -> worker_pb2.KVHandle:
        return worker_pb2.KVHandle(prefill_address=self.prefill_address, block_ids=list(self.block_ids),
                                   num_tokens=self.num_tokens, lease_token=self.lease_token,
                                   block_checksums=list(self.block_checksums), kv_salt=self.kv_salt)

    @classmethod
    def from_proto(cls, p: worker_pb2.KVHandle) -> KVHandle:
        return cls(p.prefill_address, tuple(p.block_ids), p.num_tokens, p.lease_token, tuple(p.block_checksums),
                   p.kv_salt)

    @classmethod
    def of_lease(cls, prefill_address: str, lease: Lease, num_tokens: int, kv_salt: str = "") -> KVHandle:
        """The handle to ``lease``'s blocks, with the checksums taken so far."""
        return cls(prefill_address, lease.block_ids, num_tokens, lease.token, tuple(lease.checksums), kv_salt)


class ReleaseReason(str, enum.Enum):
    """Why a lease ends (or, for RETURNED, goes back to unclaimed); the prefill side counts each."""

    PULLED = "pulled"  # the read completed (the holder's notification)
    ABORTED = "aborted"  # the request ended before its KV was read
    TRANSFER_FAILED = "transfer_failed"  # the read failed; the router re-prefills elsewhere
    RETURNED = "returned"  # claimed, then handed back unread: the lease stays held for a retry
    OWNER_LOST = "owner_lost"  # unclaimed, and the router it was granted to stopped polling (died)
    EXPIRED = "expired"  # nobody released it in time

    @property
    def ends_lease(self) -> bool:
        """Whether a release for this reason ends the lease (and frees its blocks). RETURNED
        lets go of the claim only: the lease stays held for the next reader."""
        return self is not ReleaseReason.RETURNED


class LeaseRefused(Exception):
    """A claim the holder refused before any byte moved; ``reason`` is one of REFUSALS."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


REFUSALS = ("unknown_token", "blocks_mismatch", "expired", "already_claimed")

@dataclass(frozen=True)
class ReadNotice:
    """What a read tells the holder, carried as the read's ``notify`` bytes: the lease that
    authorizes it, and whether it is the lease's last read (which ends the lease, PULLED) or
    an early read of a streamed lease (which leaves it held).

    Between workers of different tensor-parallel sizes a transfer is ``parts`` reads, one per
    rank pair (``pdserve.kv_transfer.sharding.RankRead``), each landing on its own holder rank:
    each pair's last read carries its ``part``, and the lease ends once every part's has landed
    (``LeaseTable.read_ended``), so no rank's blocks are freed under another pair's read."""

    lease_token: str
    ends_lease: bool
    part: int = 0
    parts: int = 1

    # The bytes: a last read's notice is the bare token (what any holder can check); an early
    # read's puts this marker before it, a last read's of one of several parts "part/parts:".
    # Tokens are url-safe base64 and never contain ':'.
    _EARLY = "partial:"

    def encode(self) -> bytes:
        if not self.ends_lease:
            return (self._EARLY + self.lease_token).encode()
        if self.parts == 1:
            return self.lease_token.encode()
        return f"{self.part}/{self.parts}:{self.lease_token}".encode()

    @classmethod
    def decode(cls, note: bytes | str) -> ReadNotice:
        """The notice in a read's ``notify`` (bytes from a notification, or the text a tcp
        holder's read guard is given)."""
        text = note.decode(errors="replace") if isinstance(note, bytes) else note
        if text.startswith(cls._EARLY):
            return cls(text[len(cls._EARLY):], ends_lease=False)
        head, sep, token = text.partition(":")
        part, slash, parts = head.partition("/")
        if sep and slash and part.isdigit() and parts.isdigit() and int(part) < int(parts):
            return cls(token, True, int(part), int(parts))
        return cls(text, ends_lease=True)


@dataclass
class Lease:
    token: str
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # time.monotonic() deadline
    claimed: bool = False
    owner: str = ""  # the router incarnation it was granted to ("": unknown, only expiry frees it)
    # The checksums of each block whose contents are final, in block order (a prefix of
    # block_ids while a streamed prompt computes), ``sums_per_block`` a block (a tensor-parallel
    # holder's: every rank's checksum groups, rank by rank); appended by the engine thread only.
    checksums: list[int] = field(default_factory=list)
    sums_per_block: int = 1
    parts_read: set[int] = field(default_factory=set)  # the parts whose last read has landed (ReadNotice)

    def checksum_final(self, block_checksums: Callable[[Sequence[int], int | None], tuple[int, ...]],
                       spec: CacheSpec, num_tokens: int, done: bool) -> None:
        """Once a step has computed ``num_tokens`` of the lease's tokens (``done``: all of
        them), append the checksums (``block_checksums(ids, last_block_bytes)``, the holder
        agent's) of its blocks final now that have none yet: the full blocks, and once
        ``done`` the last, partly filled one, over the bytes a read of it moves
        (``spec.tail_bytes``). ``block_checksums`` may give several sums a block (a
        tensor-parallel holder's: each rank's groups, rank by rank); the lease keeps as many a
        block."""
        n, start, block_size = len(self.block_ids), len(self.checksums) // self.sums_per_block, spec.block_size
        end = n if done else min(num_tokens // block_size, n)
        if end > start:
            tail = spec.tail_bytes(num_tokens - (n - 1) * block_size) if done else None
            sums = block_checksums(self.block_ids[start:end], tail)
            self.sums_per_block = len(sums) // (end - start)  # a tensor-parallel holder's: every rank's groups
            self.checksums.extend(sums)


@dataclass
class LeaseTable:
    """Leases on held KV, by token. Safe to call from any thread: each method holds the
    table's lock for its whole check-and-change."""

    leases: dict[str, Lease] = field(default_factory=dict)
    released_by: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in ReleaseReason})
    _deadlines: list[tuple[float, str]] = field(default_factory=list)
    _claimed_blocks: dict[str, frozenset[int]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def grant(self, request_id: str, block_ids: list[int], now: float, ttl_s: float, owner: str = "",
              checksums: tuple[int, ...] = (), sums_per_block: int = 1) -> Lease:
        lease = Lease(secrets.token_urlsafe(24), request_id, tuple(block_ids), now + ttl_s, owner=owner,
                      checksums=list(checksums), sums_per_block=sums_per_block)
        with self._lock:
            self.leases[lease.token] = lease
            heapq.heappush(self._deadlines, (lease.expires_at, lease.token))
        return lease

    def claim(self, token: str, block_ids: list[int], now: float, ttl_s: float) -> Lease:
        """Claim a lease for one read of exactly its blocks; renews it to ``now + ttl_s``.
        Raises LeaseRefused (nothing changes) for an unknown token, other blocks, an expired
        lease or one already claimed."""
        with self._lock:
            lease = self.leases.get(token)
            if lease is None:
                raise LeaseRefused("unknown_token", "no lease with this token (released, expired or never granted)")
            if tuple(block_ids) != lease.block_ids:
                raise LeaseRefused("blocks_mismatch", f"the claim names {len(block_ids)} block ids that are not "
                                                      f"the lease's {len(lease.block_ids)}")
            if now >= lease.expires_at:
                raise LeaseRefused("expired", "the lease has expired")
            if lease.claimed:
                raise LeaseRefused("already_claimed", "the lease is already claimed by a reader")
            lease.claimed = True
            self._renew(lease, now + ttl_s)
            self._claimed_blocks[token] = frozenset(lease.block_ids)
            return lease

    def renew_claim(self, token: str, now: float, ttl_s: float) -> Lease | None:
        """The reader of a claimed lease still reads: push its deadline to ``now + ttl_s`` and
        return it; None (nothing changes) if the lease has ended or is not claimed."""
        with self._lock:
            lease = self.leases.get(token)
            if lease is None or not lease.claimed:
                return None
            self._renew(lease, now + ttl_s)
            return lease

    def release(self, token: str, reason: ReleaseReason) -> Lease | None:
        """Apply a ``Release``. A reason that ``ends_lease`` removes the lease; RETURNED puts a
        claimed lease back to unclaimed, still held until it expires. Returns the lease it
        changed, None if nothing changed (an unknown token, or RETURNED for an unclaimed lease).
        The blocks of a lease that ended are the caller's to free."""
        with self._lock:
            lease = self.leases.get(token)
            if lease is None or not (reason.ends_lease or lease.claimed):
                return None
            self._claimed_blocks.pop(token, None)
            self.released_by[reason.value] += 1
            if reason.ends_lease:
                del self.leases[token]
            else:
                lease.claimed = False
                lease.parts_read.clear()
            return lease

    def read_ended(self, notice: ReadNotice) -> bool:
        """Whether the last read ``notice`` tells of ends its lease (to be ended PULLED): a
        lease read in one part at once, one read in ``parts`` once every part's last read has
        landed. An early read's notice never does."""
        if not notice.ends_lease:
            return False
        if notice.parts == 1:
            return True
        with self._lock:
            lease = self.leases.get(notice.lease_token)
            if lease is None:
                return False
            lease.parts_read.add(notice.part)
            return len(lease.parts_read) >= notice.parts

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline has passed: unclaimed ones nobody took
        in time, and claimed ones whose reader stopped renewing its claim (it died)."""
        with self._lock:
            out = []
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, token = heapq.heappop(self._deadlines)
                lease = self.leases.get(token)
                if lease is not None and lease.expires_at == deadline:  # else renewed: a later entry exists
                    out.append(self.release(token, ReleaseReason.EXPIRED))
            return out

    def pop_unclaimed_of(self, owners: set[str]) -> list[Lease]:
        """Remove and return the unclaimed leases granted to any of ``owners`` (OWNER_LOST). A
        claimed lease stays: its reader releases it, or it expires."""
        with self._lock:
            lost = [l.token for l in self.leases.values() if l.owner in owners and not l.claimed]
            return [self.release(token, ReleaseReason.OWNER_LOST) for token in lost]

    def renew(self, token: str, expires_at: float) -> bool:
        """Push a lease's deadline to ``expires_at`` (never earlier); False if it is gone."""
        with self._lock:
            lease = self.leases.get(token)
            if lease is None:
                return False
            self._renew(lease, expires_at)
            return True

    def is_claimed(self, token: str) -> bool:
        with self._lock:
            return token in self._claimed_blocks

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((l.expires_at for l in self.leases.values()), default=None)

    def read_allowed(self, note: str, block_ids: list[int]) -> bool:
        """Whether a read of ``block_ids`` whose notify is ``note`` (a ``ReadNotice``) is
        covered by the claimed lease it names."""
        token = ReadNotice.decode(note).lease_token
        with self._lock:
            claimed = self._claimed_blocks.get(token)
            return claimed is not None and set(block_ids) <= claimed

    def get(self, token: str) -> Lease | None:
        """The lease ``token``, None once it has ended (or if it never existed)."""
        with self._lock:
            return self.leases.get(token)

    def _renew(self, lease: Lease, expires_at: float) -> None:
        lease.expires_at = max(lease.expires_at, expires_at)
        heapq.heappush(self._deadlines, (lease.expires_at, lease.token))

    @property
    def expired_total(self) -> int:
        return self.released_by[ReleaseReason.EXPIRED.value]

    def __len__(self) -> int:
        return len(self.leases)

    @property
    def num_claimed(self) -> int:
        """Leases a reader has claimed and not yet finished: reads in flight, or about to be."""
        return len(self._claimed_blocks)


_REASON_FROM_WIRE = {
    worker_pb2.RELEASE_REASON_UNSPECIFIED: ReleaseReason.ABORTED,
    worker_pb2.RELEASE_REASON_ABORTED: ReleaseReason.ABORTED,
    worker_pb2.RELEASE_REASON_TRANSFER_FAILED: ReleaseReason.TRANSFER_FAILED,
    worker_pb2.RELEASE_REASON_RETURNED: ReleaseReason.RETURNED,
}
_REASON_TO_WIRE = {v: k for k, v in _REASON_FROM_WIRE.items() if k != worker_pb2.RELEASE_REASON_UNSPECIFIED}


def reason_from_wire(reason: int) -> ReleaseReason:
    return _REASON_FROM_WIRE.get(reason, ReleaseReason.ABORTED)


def release_request(token: str, reason: ReleaseReason) -> worker_pb2.ReleaseRequest:
    """The ``Release`` a router or decode worker sends (PULLED and EXPIRED never travel)."""
    return worker_pb2.ReleaseRequest(lease_token=token, reason=_REASON_TO_WIRE[reason])

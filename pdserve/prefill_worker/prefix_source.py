"""The reversed pull, the prefill worker's calls to the decode worker that holds a prefix:
its agent's metadata (once per incarnation, as a decode worker learns a prefill worker's),
the claim on its lease before the read, and the release of a lease whose read failed.
``read_prefix`` runs one prompt's read (``pdserve.prefill_worker.prefix_pull`` is its engine
side) and never fails the prompt: whatever goes wrong, the prompt is computed whole."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc

from pdserve.kv_transfer import TransferError, TransferState, UnverifiedTransfer
from pdserve.kv_transfer.handoff import KVHandle, ReleaseReason, release_request
from pdserve.kv_transfer.rank_agents import RankAgents, RankSources
from pdserve.prefill_worker.prefix_pull import PrefixPulled, PrefixPulls
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.wire.grpc_util import aio_channel
from pdserve.wire.tls import TlsConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0  # metadata and claim calls: a holder that does not answer costs the prompt no more


@dataclass(frozen=True)
class PrefixSource:
    """A held prefix and how to read it: the holder's agents, connected, and its stub."""

    kv: KVHandle
    peer: RankSources
    stub: worker_pb2_grpc.DecodeWorkerStub

    async def claim(self) -> None:
        """Claim the lease for the read (raises grpc.aio.AioRpcError if refused)."""
        await self.stub.Claim(worker_pb2.ClaimRequest(lease_token=self.kv.lease_token, block_ids=list(self.kv.block_ids)),
                              timeout=CALL_TIMEOUT_S)

    async def release(self, reason: ReleaseReason) -> None:
        """End the lease unread (best effort: it expires anyway, and the router releases it too)."""
        try:
            await self.stub.Release(release_request(self.kv.lease_token, reason), timeout=5)
        except grpc.aio.AioRpcError:
            pass


class PrefixPeers:
    """The decode workers this prefill worker reads prefixes from, by address: a channel, and
    their agents, added once per incarnation (a digest of the metadata they hand out)."""

    def __init__(self, agent: RankAgents, tls: TlsConfig | None):
        self.agent, self.tls = agent, tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, tuple[RankSources, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def source(self, kv: KVHandle) -> PrefixSource | None:
        """How to read ``kv``'s prefix; None (logged) if its holder cannot be reached or does not fit."""
        address = kv.prefill_address  # the holder's: a decode worker's here
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.tls, peer="decode")
        stub = worker_pb2_grpc.DecodeWorkerStub(self._channels[address])
        try:
            return PrefixSource(kv, await self._peer(address, stub), stub)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            log.info("decode worker %s cannot serve its prefix: %s", address, exc)
            return None

    async def _peer(self, address: str, stub: worker_pb2_grpc.DecodeWorkerStub) -> RankSources:
        async with self._locks.setdefault(address, asyncio.Lock()):
            known = self._peers.get(address)
            if known is None:
                meta = await stub.GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=CALL_TIMEOUT_S)
                incarnation = hashlib.sha256(meta.SerializeToString(deterministic=True)).hexdigest()[:16]
                self._peers[address] = known = (await asyncio.to_thread(self.agent.connect, meta), incarnation)
            return known[0]

    def forget(self, address: str) -> None:
        """A read from ``address`` failed: its worker may be a new incarnation; look again next time."""
        self._peers.pop(address, None)


async def read_prefix(call: Callable[..., Awaitable], pulls: PrefixPulls, peers: PrefixPeers, request_id: str,
                      prompt: list[int], cache_salt: str, kv: KVHandle, stream: asyncio.Queue,
                      wanted: bool = True) -> PrefixPulled:
    """Read the prefix ``kv`` holds into this worker's cache before ``prompt`` is queued; what
    came of it. ``call`` runs a function on the engine thread; ``stream`` is the request's
    queue, where ``pulls`` says when the read ended. ``wanted`` False: refused (counted; the
    router releases the hold). Never raises but for cancellation (the caller's ``forget`` then
    drops the pin): a failure is ``PrefixPulled(0, error=...)``."""
    if not wanted:
        pulls.refused += 1
        return PrefixPulled(0, error="refused")
    source = await peers.source(kv)
    if source is None:
        pulls.agent.stats.record(TransferState.FAILED, 0, 0.0)
        return PrefixPulled(0, error="the holder cannot be reached")
    own, todo = await call(pulls.pin, request_id, prompt, cache_salt, kv)
    if not todo:
        await source.release(ReleaseReason.ABORTED)  # nothing to read: the holder may let go now
        return PrefixPulled(own * pulls.engine.blocks.block_size)
    claimed = False
    try:
        await source.claim()
        claimed = True
        await call(pulls.start, request_id, kv, source.peer)
    except UnverifiedTransfer as exc:  # fail closed: nothing was read; the prompt is computed whole
        await call(pulls.drop, request_id)
        pulls.unverified += 1
        await source.release(ReleaseReason.TRANSFER_FAILED)
        log.warning("request %s: prefix not read: %s", request_id, exc)
        return PrefixPulled(0, error=f"refused: {exc}")
    except (grpc.aio.AioRpcError, TransferError) as exc:
        await call(pulls.drop, request_id)
        pulls.agent.stats.record(TransferState.FAILED, 0, 0.0)
        if claimed:  # a lease claimed by another reader (a retry's) is not this worker's to end
            await source.release(ReleaseReason.TRANSFER_FAILED)
        return PrefixPulled(0, error=f"the read could not start: {exc}")
    pulled = await stream.get()
    if pulled.error is not None:
        peers.forget(kv.prefill_address)
        await source.release(ReleaseReason.TRANSFER_FAILED)
    return pulled

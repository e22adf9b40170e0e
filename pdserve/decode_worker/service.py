"""gRPC face of the decode worker (``pdserve.v1.DecodeWorker``).

Peers are known by the agent a prefill worker's address serves *and its incarnation* (a digest
of the metadata it hands out: a restarted worker registers new memory). A prefill worker that
restarts on the same address (a Kubernetes container restart keeps the pod IP and the fixed
internal port) would otherwise be read with its dead predecessor's metadata forever. So after
a transfer from an address fails, its metadata is fetched again at once, and a new incarnation
replaces the peer before the router retries; the router takes a source or a reader whose
transfers keep failing out of routing for a while (``pdserve.router.transfer_faults``). Each
address has its own lock for this: a prefill worker that does not answer its metadata call (up
to 10 s) holds up the requests that read from it, not those that read from the others.

A claimed lease is the reader's for as long as it reads: ``_LeaseUse`` renews its claim every
third of the holder's ``lease_seconds`` (from the event loop, so a long engine step never
delays it) until its reads have ended, so the holder never frees the blocks under it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys

import grpc

from pdserve.decode_worker.spans import DecodeSpans
from pdserve.decode_worker.worker import (DecodeWorker, HandedOver, KVArrived, KVProgressed, KVUnverified,
                                          LocallyPrefilled, TransferFailed)
from pdserve.engine.errors import CacheCapacityError, InvalidRequestError, StepFailed
from pdserve.kv_transfer import TransferError
from pdserve.kv_transfer.handoff import KVHandle, ReleaseReason, release_request
from pdserve.kv_transfer.rank_agents import RankSources
from pdserve.decode_worker.prefix_rpcs import PrefixHoldRpcs
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.wire import tracing
from pdserve.wire.convert import finish_to_wire, sampling_from_proto, top_to_proto
from pdserve.wire.failure import Failure, abort_with
from pdserve.wire.grpc_util import abort_invalid, aio_channel
from pdserve.shell.service import ShellRpcs

log = logging.getLogger(__name__)  # request ids are the router's (a client's X-Request-Id)


class DecodeService(PrefixHoldRpcs, ShellRpcs, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, metrics_address: str = "", address: str = ""):
        self.worker = worker
        self.metrics_address = metrics_address
        self.address = address  # what peers dial (a held prefix's handle names it)
        self._peers: dict[str, tuple[RankSources, str]] = {}  # prefill address -> (its ranks' peers, incarnation)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # prefill address -> the lock on its peer entry

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.worker.config.tls, peer="prefill")
        return worker_pb2_grpc.PrefillWorkerStub(self._channels[address])

    async def _peer(self, address: str, check_again: bool = False) -> RankSources:
        """The prefill worker's agents at ``address`` (one per tensor-parallel rank it reads),
        added once per incarnation (metadata travels over gRPC). ``check_again``: fetch its metadata even if known, and replace the
        peer if the worker there is a new incarnation."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            known = self._peers.get(address)
            if known is None or check_again:
                meta = await self._stub(address).GetAgentMetadata(worker_pb2.AgentMetadataRequest(), timeout=10)
                incarnation = hashlib.sha256(meta.SerializeToString(deterministic=True)).hexdigest()[:16]
                if known is None or known[1] != incarnation:
                    if known is not None:
                        log.info("prefill worker %s is a new incarnation (%s, was %s); its peer is replaced",
                                 address, incarnation, known[1])
                    self._peers[address] = (await asyncio.to_thread(self.worker.add_peer, meta), incarnation)
            return self._peers[address][0]

    async def _check_source(self, address: str) -> None:
        """After a failed transfer: the worker at ``address`` may have restarted; look again
        (best effort: an unreachable one stays as it was, and the router judges it)."""
        try:
            await self._peer(address, check_again=True)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            log.info("prefill worker %s could not be checked again after a failed transfer: %s", address, exc)

    async def Decode(self, request, context):
        # The router offers the same KV to another decode worker.
        await self.admit(context, grpc.StatusCode.RESOURCE_EXHAUSTED)
        spans = None  # the call's spans while tracing (pdserve.decode_worker.spans)
        if tracing.enabled():
            config = self.worker.config
            spans = DecodeSpans(context, request, config.worker_id, config.kv_transfer_backend)
        if request.local_prefill:
            async for resp in self._prefill_and_decode(request, context, spans):
                yield resp
            return
        log.debug("decode %s: %d prompt tokens from %s", request.request_id, len(request.prompt_token_ids),
                  request.kv.prefill_address)
        kv = KVHandle.from_proto(request.kv)
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        try:
            peer = await self._peer(kv.prefill_address)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            self.worker.source_unreachable()
            if spans is not None:
                spans.end(exc)
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER,
                             f"kv transfer failed: prefill worker {kv.prefill_address} unreachable ({reason})")
        lease = _LeaseUse(self._stub(kv.prefill_address), kv)
        watch = lease.watch if request.kv_streamed else None
        stream = self.worker.decode(request.request_id, list(request.prompt_token_ids), request.first_token_id,
                                    params, kv, peer, lease.claim, watch)
        try:
            async for item in stream:
                if isinstance(item, KVProgressed):
                    yield worker_pb2.DecodeResponse(kv_progress=True)
                    continue
                if isinstance(item, KVArrived):
                    lease.read_done()  # the holder frees its copy on the read's notification
                    if spans is not None:
                        spans.kv_arrived(item)
                    yield worker_pb2.DecodeResponse(kv_bytes=item.nbytes, kv_transfer_seconds=item.seconds)
                    continue
                if spans is not None:
                    spans.output(len(item.new_token_ids))
                yield _output_to_wire(item)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        except CacheCapacityError as exc:
            await lease.end(ReleaseReason.RETURNED)  # unread: the router's next decode worker may claim it
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode worker KV cache full: {exc}")
        except LeaseClaimFailed as exc:
            self.worker.source_unreachable()
            await self._check_source(kv.prefill_address)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER, f"kv transfer failed: {exc}")
        except KVUnverified as exc:  # nothing read: the router prefills it again, on this worker
            await lease.end(ReleaseReason.TRANSFER_FAILED)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_UNVERIFIED, f"kv refused unread: {exc}")
        except TransferFailed as exc:
            await lease.end(ReleaseReason.TRANSFER_FAILED)
            await self._check_source(kv.prefill_address)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER, f"kv transfer failed: {exc}")
        except StepFailed as exc:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.STEP_FAILED, str(exc))
        except HandedOver as exc:
            yield await _handed_over(context, exc)
        except asyncio.CancelledError:
            # The router gave up on this call, or died. Either way no other decode worker will
            # be offered this KV (a router that goes on re-prefills), so it is freed now, not
            # when its lease runs out.
            lease.abandoned = True
            raise
        finally:
            await stream.aclose()
            await lease.end(ReleaseReason.ABORTED)  # a no-op unless claimed and never read
            if spans is not None:
                spans.end(sys.exc_info()[1])  # the error this call ends with, if any

    async def _prefill_and_decode(self, request, context, spans: DecodeSpans | None):
        """``Decode`` with ``local_prefill``: no KV to pull; this worker runs the prompt itself.
        The first response is ``prefilled`` (the first token, as a prefill answer carries it),
        then outputs as for any decode."""
        log.debug("decode %s: %d prompt tokens, prefilled here", request.request_id, len(request.prompt_token_ids))
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        stream = self.worker.prefill_and_decode(request.request_id, list(request.prompt_token_ids), params)
        prefill_seconds = None
        try:
            async for item in stream:
                if isinstance(item, LocallyPrefilled):
                    prefill_seconds = item.seconds
                    continue
                if spans is not None:
                    spans.output(len(item.new_token_ids))
                if prefill_seconds is None or not item.new_token_ids:
                    yield _output_to_wire(item)
                    continue
                yield worker_pb2.DecodeResponse(prefilled=_prefill_answer(request.request_id, item, prefill_seconds))
                prefill_seconds = None
                if len(item.new_token_ids) > 1:  # more than the first token in one output
                    yield _output_to_wire(item, start=1)
        except InvalidRequestError as exc:
            await abort_invalid(context, exc)
        except StepFailed as exc:
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.STEP_FAILED, str(exc))
        except HandedOver as exc:
            yield await _handed_over(context, exc)
        finally:
            await stream.aclose()
            if spans is not None:
                spans.end(sys.exc_info()[1])


async def _handed_over(context, exc: HandedOver) -> worker_pb2.DecodeResponse:
    """The last message of a stream handed over with its KV (the router moves it to another
    decode worker); without KV the call ends UNAVAILABLE (the router re-prefills it)."""
    if exc.kv is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"stream handed over: {exc}")
    return worker_pb2.DecodeResponse(handed_over=exc.kv.to_proto())


def _output_to_wire(item, start: int = 0) -> worker_pb2.DecodeResponse:
    """``item``'s tokens from ``start`` on (and its finish reason)."""
    return worker_pb2.DecodeResponse(
        token_ids=item.new_token_ids[start:], logprobs=item.new_logprobs[start:],
        top_logprobs=[top_to_proto(top) for top in item.new_top_logprobs[start:]],
        finish_reason=finish_to_wire(item.finish_reason if item.finished else None))


def _prefill_answer(request_id: str, item, seconds: float) -> worker_pb2.PrefillResponse:
    """The first output of a request prefilled here, in a prefill answer's form (no KV: it
    stays here). ``item.finish_reason`` only when the first token is also the last."""
    last = item.finished and len(item.new_token_ids) == 1
    return worker_pb2.PrefillResponse(
        request_id=request_id, first_token_id=item.new_token_ids[0],
        first_logprob=item.new_logprobs[0] if item.new_logprobs else 0.0,
        first_top_logprobs=top_to_proto(item.new_top_logprobs[0]) if item.new_top_logprobs else None,
        finish_reason=finish_to_wire(item.finish_reason if last else None),
        num_cached_tokens=item.num_cached_tokens, prefill_seconds=seconds,
        prompt_logprobs=[lp for lp, _ in item.prompt_logprobs or ()],
        prompt_top_logprobs=[top_to_proto(top) for _, top in item.prompt_logprobs or ()])


class LeaseClaimFailed(Exception):
    """The holder refused the claim, or could not be asked: nothing was read."""


class _LeaseUse:
    """This decode worker's use of one lease: claim it before reading, keep the claim renewed
    while the reads run, and end it (once) if it was claimed, or abandoned by the router, and
    the read never finished."""

    def __init__(self, stub: worker_pb2_grpc.PrefillWorkerStub, kv: KVHandle):
        self.stub, self.kv = stub, kv
        self.claimed = self.done = self.abandoned = False
        self._renewing: asyncio.Task | None = None

    def _request(self, renew: bool = False) -> worker_pb2.ClaimRequest:
        return worker_pb2.ClaimRequest(lease_token=self.kv.lease_token, block_ids=list(self.kv.block_ids), renew=renew)

    async def claim(self) -> None:
        try:
            answer = await self.stub.Claim(self._request(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise LeaseClaimFailed(f"claim refused by {self.kv.prefill_address}: {exc.details()}") from exc
        self.claimed = True
        if answer.lease_seconds > 0:
            self._renewing = asyncio.create_task(self._keep_claimed(answer.lease_seconds / 3))

    async def _keep_claimed(self, every_s: float) -> None:
        """Renew the claim every ``every_s`` until the reads end (``read_done``, ``end``). A
        call that fails is tried again at the next turn; a refusal means the lease has ended
        (its last read's notice, a release): nothing left to renew."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.stub.Claim(self._request(renew=True), timeout=every_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    return
                log.info("renewing the claim on %s failed (%s); trying again in %.1f s", self.kv.prefill_address,
                         exc.code().name, every_s)

    def read_done(self) -> None:
        """Every read has ended well: the holder frees its copy on the last one's notice."""
        self.done = True
        self._stop_renewing()

    def _stop_renewing(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None

    async def watch(self):
        """The claimed streamed lease's progress: (tokens computed, the first token once done,
        the checksums of the blocks final so far). Raises TransferFailed if the holder stops
        answering or the prompt stops."""
        call = self.stub.WatchKV(worker_pb2.WatchKVRequest(lease_token=self.kv.lease_token))
        sums: list[int] = []
        try:
            async for progress in call:
                sums[progress.checksums_from:] = progress.block_checksums  # each message continues the last
                yield progress.ready_tokens, progress.first_token_id if progress.done else None, tuple(sums)
        except grpc.aio.AioRpcError as exc:
            raise TransferFailed(f"the prefill worker {self.kv.prefill_address} stopped streaming the KV: "
                                 f"{exc.code().name} {exc.details()}") from exc
        finally:
            call.cancel()

    async def end(self, reason: ReleaseReason) -> None:
        """Release (or hand back) a lease we claimed, or that the router abandoned, and did not
        read (best effort: it expires anyway)."""
        self._stop_renewing()
        if self.done or not (self.claimed or self.abandoned):
            return
        self.done = True
        try:
            await self.stub.Release(release_request(self.kv.lease_token, reason), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # the prefill worker is gone, or its lease will expire


def add_to_server(server: grpc.aio.Server, worker: DecodeWorker, metrics_address: str = "", address: str = "") -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeService(worker, metrics_address, address), server)

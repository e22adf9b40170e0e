"""gRPC face of the prefill worker (``pdserve.v1.PrefillWorker``)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.engine.errors import InvalidRequestError, StepFailed
from pdserve.kv_transfer.handoff import KVHandle, reason_from_wire
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.prefill_worker.kv_stream import KVEarly, KVLeaseEnded, KVReady
from pdserve.prefill_worker.record import PrefillResult
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.wire import tracing
from pdserve.wire.convert import finish_to_wire, sampling_from_proto, top_to_proto
from pdserve.wire.failure import Failure, abort_with
from pdserve.wire.grpc_util import abort_invalid
from pdserve.shell.lease_rpcs import answer_claim
from pdserve.shell.service import ShellRpcs

log = logging.getLogger(__name__)  # request ids are the router's (a client's X-Request-Id)


class PrefillService(ShellRpcs, worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, address: str, metrics_address: str = ""):
        self.worker = worker
        self.address = address
        self.metrics_address = metrics_address

    async def Prefill(self, request, context):
        await self.admit(context, grpc.StatusCode.UNAVAILABLE)  # refused: the router tries another
        if self.worker.inject_never_answer:  # test-only (tests/conformance): accepted, never answered
            self.worker.never_answered += 1
            await asyncio.Event().wait()  # until the caller gives up and the call is cancelled
        log.debug("prefill %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids))
        span = self._span(request, context, "prefill_worker.Prefill")
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        try:
            r = await self.worker.prefill(request.request_id, list(request.prompt_token_ids), params,
                                          owner=request.router_id, prefix=_prefix(request))
        except InvalidRequestError as exc:
            tracing.end_span(span, error=exc)
            await abort_invalid(context, exc)
        except StepFailed as exc:
            tracing.end_span(span, error=exc)
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.STEP_FAILED, str(exc))
        except BaseException as exc:  # the caller gave up (cancelled): the span says so
            tracing.end_span(span, error=exc if isinstance(exc, Exception) else "cancelled")
            raise
        _end_spans(span, r)
        return self._answer(request, r, params)

    async def PrefillStream(self, request, context):
        """``Prefill``, with the KV handle sent early (``kv_streaming``) while the prompt still
        computes; the last message is the answer."""
        await self.admit(context, grpc.StatusCode.UNAVAILABLE)
        log.debug("prefill %s: %d prompt tokens, KV streamed", request.request_id, len(request.prompt_token_ids))
        span = self._span(request, context, "prefill_worker.PrefillStream")
        params = sampling_from_proto(request.sampling, keep_stop_strings=False)
        prompt = list(request.prompt_token_ids)
        result, error = None, "cancelled"
        try:
            async for item in self.worker.prefill_stream(request.request_id, prompt, params, owner=request.router_id,
                                                         stream_kv=True, prefix=_prefix(request)):
                if isinstance(item, KVEarly):
                    tracing.add_event(span, "kv_early", {"pdserve.ready_tokens": item.ready_tokens})
                    kv = KVHandle(self.address, item.lease.block_ids, len(prompt), item.lease.token,
                                  item.checksums, self.worker.salt_of(params)).to_proto()
                    yield worker_pb2.PrefillResponse(request_id=request.request_id, kv=kv, kv_streaming=True)
                elif isinstance(item, PrefillResult):
                    result = item
                    yield self._answer(request, item, params)
                else:
                    assert isinstance(item, KVReady)  # for WatchKV callers, not the router
            error = None
        except (InvalidRequestError, StepFailed, KVLeaseEnded) as exc:
            error = exc
            if isinstance(exc, InvalidRequestError):
                await abort_invalid(context, exc)
            elif isinstance(exc, StepFailed):
                await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.STEP_FAILED, str(exc))
            else:
                await abort_with(context, grpc.StatusCode.UNAVAILABLE, Failure.KV_TRANSFER, f"prefill stopped: {exc}")
        finally:
            if result is not None and error is None:
                _end_spans(span, result)
            else:
                tracing.end_span(span, error=error)

    def _span(self, request, context, name: str):
        """The server span of a prefill call (None while tracing is off)."""
        if not tracing.enabled():
            return None
        return tracing.server_span(context, name, {
            tracing.REQUEST_ID: request.request_id, tracing.WORKER_ID: self.worker.config.worker_id,
            tracing.PROMPT_TOKENS: len(request.prompt_token_ids)})

    async def WatchKV(self, request, context):
        """A streamed lease's progress, for the decode worker that claimed it: each message
        carries the checksums of the blocks that became final since the last one."""
        token = request.lease_token
        watch = self.worker.watch(token)
        if watch is None or not self.worker.leases.is_claimed(token):
            await abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, Failure.KV_TRANSFER,
                             "no claimed streamed lease with this token (claim it first; it may have ended)")
        sent, summed = -1, 0
        while True:
            changed = watch.changed
            if watch.failed is not None:
                await abort_with(context, grpc.StatusCode.ABORTED, Failure.KV_TRANSFER, watch.failed)
            done = watch.first_token is not None
            if done or watch.ready_tokens != sent:
                sent, sums = watch.ready_tokens, watch.checksums[summed:]
                yield worker_pb2.KVProgress(ready_tokens=sent, done=done, first_token_id=watch.first_token or 0,
                                            checksums_from=summed, block_checksums=sums)
                summed += len(sums)
            if done:
                return
            await changed.wait()

    def _answer(self, request, r: PrefillResult, params) -> worker_pb2.PrefillResponse:
        kv = None
        if r.lease is not None:
            kv = KVHandle.of_lease(self.address, r.lease, r.num_prompt_tokens, self.worker.salt_of(params)).to_proto()
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=r.first_token_id, first_logprob=r.first_logprob,
            finish_reason=finish_to_wire(r.finish_reason), kv=kv, num_cached_tokens=r.num_cached_tokens,
            prefill_seconds=r.seconds, queue_seconds=r.queue_seconds,
            first_top_logprobs=top_to_proto(r.first_top_logprobs),
            prompt_logprobs=[lp for lp, _ in r.prompt_logprobs or ()],
            prompt_top_logprobs=[top_to_proto(top) for _, top in r.prompt_logprobs or ()])

    async def Release(self, request, context):
        released = await self.worker.release(request.lease_token, reason_from_wire(request.reason))
        return worker_pb2.ReleaseResponse(released=released)

    async def Claim(self, request, context):
        """A claim, or (``renew``) its reader's renewal; the answer says how long it lasts."""
        return await answer_claim(context, lambda: self.worker.claim(request.lease_token, list(request.block_ids),
                                                                     request.renew), self.worker.config.lease_seconds)

    async def GetAgentMetadata(self, request, context):
        return self.worker.agent.local_metadata()


def _prefix(request: worker_pb2.PrefillRequest) -> KVHandle | None:
    """The prefix a decode worker holds for this prompt (the reversed pull), if any."""
    return KVHandle.from_proto(request.prefix) if request.prefix.block_ids else None


def _end_spans(span, r: PrefillResult) -> None:
    """The prefill's queue wait and chunks, from the times the worker kept, under ``span``,
    which ends."""
    if span is None:
        return
    queued_until = r.arrived_at + r.queue_seconds
    tracing.record_span("prefill.queue", span, r.arrived_at, queued_until)
    for i, (start, end, computed) in enumerate(r.chunks):
        tracing.record_span("prefill.chunk", span, start, end, {"pdserve.chunk.index": i, tracing.CHUNK_TOKENS: computed})
    tracing.end_span(span, attributes={tracing.CACHED_TOKENS: r.num_cached_tokens, tracing.CHUNKS: len(r.chunks),
                                       tracing.TIME_IN_QUEUE: r.queue_seconds})


def add_to_server(server: grpc.aio.Server, worker: PrefillWorker, address: str, metrics_address: str = "") -> None:
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillService(worker, address, metrics_address), server)

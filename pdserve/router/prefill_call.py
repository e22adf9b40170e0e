"""The prefill call of one attempt: route the prompt to a prefill worker (trying others
while they are gone, full or do not answer within the call's bound; with none left, the run
prefills on a decode worker: ``NoPrefillWorker``), and, when its KV streams, wait for the
answer while the decode side already reads. For the reversed pull, the hold on a decode
worker's cached prefix that the prefill worker reads first (``hold_prefix``), and its release
(``release_hold_later``)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.protos import worker_pb2
from pdserve.router.errors import AttemptLost, NoPrefillWorker, RouteError, route_error
from pdserve.router.policy import avoiding, disagreeing
from pdserve.router.request_budget import prefill_call_timeout_s
from pdserve.router.worker_calls import (CallContext, Fault, Started, detach, ignore_errors, last_message, triage,
                                         unavailable, unless_hung)
from pdserve.wire import tracing

log = logging.getLogger(__name__)

# A hold is a lookup in the decode worker's prefix cache, answered between two of its steps.
# One that takes longer than this is not worth waiting for: the prompt is prefilled without it.
HOLD_TIMEOUT_S = 2.0


async def prefill(ctx: CallContext, request: worker_pb2.PrefillRequest, stream_kv: bool, cache_salt: str,
                  verify_kv: bool | None = None):
    """(the prefill worker's answer, its address, None). With ``stream_kv`` the answer may be
    the early KV handle (``kv_streaming``); then the third is the open call, whose last
    message is the answer (``streamed_answer``). ``verify_kv``: the planned decode worker's
    setting; prefill workers that disagree are passed over (``verify_agrees``), and where only
    they are left the attempt is lost to a local prefill."""
    prompt = list(request.prompt_token_ids)
    tried: set[str] = set()
    last = "no prefill worker"
    for _ in range(ctx.limits.max_prefill_attempts):
        route = ctx.spans.route("prefill") if ctx.spans is not None else None
        mismatched = disagreeing(ctx.pool.snapshots(ctx.lora_name), verify_kv, "prefill")
        # An empty prefill pool is not waited on: a decode worker prefills the prompt instead.
        choice = await ctx.budget.admit(lambda: avoiding(lambda excluded: ctx.pool.route_prefill(
            prompt, ctx.limits.routing, excluded, ctx.limits.max_queued_tokens_per_prefill, cache_salt,
            ctx.lora_name), frozenset(tried) | mismatched, ctx.avoid), ctx.pool.interval_s, wait_empty=False)
        if route is not None:
            tracing.end_span(route, attributes={tracing.ROUTE_RULE: choice.rule or "", tracing.CACHED_TOKENS:
                                                choice.cached_tokens, tracing.WORKER_ID: choice.worker_id or ""})
        if choice.worker_id is None:
            if choice.saturated:
                raise route_error(choice)
            if mismatched and not choice.pool_empty:
                raise AttemptLost(f"no prefill worker left with verify_kv_transfers {'on' if verify_kv else 'off'}, "
                                  "as the decode worker", local=True)
            break
        client = ctx.pool.workers[choice.worker_id]
        tried.add(client.address)
        ctx.metrics.routed(choice.rule, choice.cached_tokens)
        method = "PrefillStream" if stream_kv else "Prefill"
        span = ctx.spans.call(method, client.address) if ctx.spans is not None else None
        tokens = len(prompt) - choice.cached_tokens
        try:
            timeout = _call_timeout(ctx, tokens, client.snapshot().queued_tokens)
            with ctx.pool.placed(client, tokens=tokens):
                if not stream_kv:
                    call = client.stub.Prefill(request, timeout=timeout, **tracing.metadata_kwargs(span))
                    answer = await unless_hung(call, client, stall_s=ctx.limits.prefill_call_min_s,
                                               poll_s=ctx.pool.interval_s)
                    tracing.end_span(span)
                    return answer, client.address, None
                call = client.stub.PrefillStream(request, timeout=timeout, **tracing.metadata_kwargs(span))
                first = await unless_hung(call.read(), client, call, stall_s=ctx.limits.prefill_call_min_s,
                                          poll_s=ctx.pool.interval_s)
                if first is grpc.aio.EOF:
                    raise unavailable(f"prefill worker {client.address} ended the stream without an answer")
                tracing.end_span(span)  # the early handle (or the answer) came back
                return first, client.address, (call if first.kv_streaming else None)
        except grpc.aio.AioRpcError as exc:
            tracing.end_span(span, error=f"{exc.code().name} {exc.details()}")
            fault = triage(exc, ctx.budget)
            if fault is Fault.REFUSED:
                raise
            last = f"prefill worker {client.address}: {exc.code().name} {exc.details()}"
            if fault not in (Fault.BUSY, Fault.STEP):  # a failed step leaves its worker serving
                ctx.pool.mark_down(client.address)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the call's bound, not the request's
                ctx.pool.call_unanswered(client.address)
            ctx.metrics.retried()
            log.warning("request %s: %s; trying another", ctx.request_id, last)
        except BaseException as exc:
            tracing.end_span(span, error=exc)
            raise
    if "RESOURCE_EXHAUSTED" in last:
        raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no prefill worker could take the request ({last})")
    raise NoPrefillWorker(f"no prefill worker could take the request ({last})")


def _call_timeout(ctx: CallContext, tokens: int, queued_tokens: int) -> float:
    """The bound of one prefill call of ``tokens`` uncached prompt tokens behind
    ``queued_tokens`` (``pdserve.router.request_budget.prefill_call_timeout_s``)."""
    limits = ctx.limits
    return prefill_call_timeout_s(ctx.budget.remaining_s(), tokens, queued_tokens, ctx.pool.prefill_pace.token_s,
                                  limits.prefill_call_min_s, limits.prefill_call_slack, limits.prefill_token_s_guess)


async def streamed_answer(ctx: CallContext, call, address: str, decoding: Started) -> worker_pb2.PrefillResponse:
    """The answer of a PrefillStream whose KV is streaming to ``decoding`` meanwhile. A
    failure of either side before the answer loses this attempt (re-prefill), as a failed
    transfer does; a decode side that failed first cancels the prefill."""
    client = ctx.pool.workers.get(address)
    answer = asyncio.ensure_future(last_message(call))
    try:
        while not answer.done():
            waits = {answer} | ({decoding.first} if not decoding.first.done() else set())
            lost = asyncio.ensure_future(client.lost.wait()) if client is not None else None
            try:
                await asyncio.wait(waits | ({lost} if lost else set()), timeout=ctx.budget.remaining_s(),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if lost is not None:
                    lost.cancel()
            ctx.budget.remaining_s()
            if decoding.first.done() and decoding.first.exception() is not None:
                raise decoding.first.exception()
            if lost is not None and lost.done() and not answer.done():
                raise AttemptLost(f"prefill worker {address} is hung (no engine progress, hang_timeout_s)")
        return answer.result()
    except grpc.aio.AioRpcError as exc:
        if triage(exc, ctx.budget) not in (Fault.TRANSFER, Fault.STEP):
            ctx.pool.mark_down(address)
        raise AttemptLost(f"prefill worker {address} while the KV streamed: {exc.code().name} "
                          f"{exc.details()}") from exc
    finally:
        if not answer.done():
            answer.cancel()
            call.cancel()


async def hold_prefix(ctx: CallContext, address: str, worker_rid: str, prompt: list[int],
                      cache_salt: str) -> worker_pb2.KVHandle | None:
    """Ask the decode worker at ``address`` to hold ``prompt``'s cached prefix for the prefill
    worker (``HoldPrefix``); its handle, or None (logged) where it holds nothing: nothing
    cached, a worker gone or not routable, or one that refuses. None costs only time: the
    prefill worker computes the whole prompt."""
    client = ctx.pool.workers.get(address)
    if client is None or client.role != "decode" or not client.healthy or client.hung:
        log.info("request %s: decode worker %s cannot hold its prefix (gone or not routable)", ctx.request_id, address)
        return None
    request = worker_pb2.HoldPrefixRequest(request_id=worker_rid, prompt_token_ids=prompt, cache_salt=cache_salt,
                                           router_id=ctx.pool.router_id)
    try:
        held = await client.stub.HoldPrefix(request, timeout=min(HOLD_TIMEOUT_S, ctx.budget.remaining_s()))
    except grpc.aio.AioRpcError as exc:
        log.info("request %s: decode worker %s did not hold its prefix (%s %s); prefilling it whole",
                 ctx.request_id, address, exc.code().name, exc.details())
        return None
    return held.kv if held.kv.block_ids else None


def release_hold_later(ctx: CallContext, address: str, lease_token: str) -> None:
    """End a prefix hold on the decode worker at ``address`` once the prefill call is over (best
    effort: a read's notice ended it already if the prefill worker read it, and it expires)."""
    client = ctx.pool.workers.get(address)
    if client is None or client.role != "decode":
        return
    release = client.stub.Release(release_request(lease_token, ReleaseReason.ABORTED), timeout=5)
    detach(ignore_errors(release))

"""The decode call of one attempt: the Decode stream on the first decode worker that takes
it, bounded by how long it may stay silent. It yields what the client's output is made of:
a locally prefilled stream's first message (``DecodeResponse.prefilled``, a prefill answer)
and then token outputs; the KV-arrived and KV-progress notices are taken here."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc

from pdserve.protos import worker_pb2
from pdserve.router.errors import AttemptLost, route_error
from pdserve.router.policy import Choice, avoiding, disagreeing, pick_decode
from pdserve.router.worker_calls import CallContext, Fault, triage
from pdserve.wire import tracing


async def decode(ctx: CallContext, request: worker_pb2.DecodeRequest, blocks: int, source: str | None,
                 prefer: str | None = None) -> AsyncIterator[worker_pb2.PrefillResponse | worker_pb2.DecodeResponse]:
    """The stream of ``request`` (``blocks`` of KV on the decode worker); ``source`` is the
    prefill worker whose KV it reads (None: local prefill). ``prefer``: the decode worker the
    attempt's plan is for (``Attempt.decode_worker``), tried first while it is routable and has
    room; else, and after it, the least loaded (``pick_decode``). A decode worker that is full
    before it sent anything is passed over for another; any other failure loses the attempt.
    The source itself is never picked: an elastic worker that took the decode role while it
    still held KV as a prefill worker cannot read from its own agent (with no other decode
    worker, the attempt is lost and the run re-prefills), nor a decode worker that disagrees
    with the source on verifying KV (``verify_agrees``; with only such left, the attempt is lost
    to a local prefill); a decode worker that refused the KV unread, for it came without
    checksums, loses the attempt to one too."""
    tried: set[str] = set()
    snapshots = ctx.pool.snapshots(ctx.lora_name)
    passed = frozenset(w.worker_id for w in snapshots if w.worker_id == source and w.role != "prefill")
    # A reader must verify the KV as its holder does (``verify_agrees``): the others are passed over.
    holder = next((w.verify_kv for w in snapshots if w.worker_id == source), None) if source else None
    mismatched = disagreeing(snapshots, holder, "decode") if source else frozenset()
    passed |= mismatched
    while True:
        route = ctx.spans.route("decode") if ctx.spans is not None else None
        choice = await ctx.budget.admit(lambda: _pick(ctx, blocks, passed | tried, prefer), ctx.pool.interval_s)
        tracing.end_span(route, attributes={tracing.WORKER_ID: choice.worker_id or ""} if route else None)
        if choice.worker_id is None:
            if (tried or passed) and not choice.saturated:
                raise AttemptLost(choice.reason + (f"; {len(mismatched)} disagree with the holder on "
                                                   "verify_kv_transfers" if mismatched else ""), local=bool(mismatched))
            raise route_error(choice)
        client = ctx.pool.workers[choice.worker_id]
        tried.add(client.address)
        span = ctx.spans.call("Decode", client.address) if ctx.spans is not None else None
        call = client.stub.Decode(request, timeout=ctx.budget.remaining_s(), **tracing.metadata_kwargs(span))
        started = False
        error = None
        try:
            # a local prefill's prompt queues on the worker too (a mixed worker's queue is routed by)
            prompt = len(request.prompt_token_ids) if request.local_prefill else 0
            with ctx.pool.placed(client, tokens=prompt, blocks=blocks):
                async with contextlib.aclosing(_idle_bounded(ctx, call, client)) as messages:
                    async for resp in messages:
                        if not started:
                            ctx.decode_workers.append(client.address)
                        started = True
                        if resp.kv_progress:  # streamed KV: more of it read while prefill goes on
                            continue
                        if resp.HasField("handed_over"):  # it stops decoding, and holds the KV for the next worker
                            raise AttemptLost(f"decode worker {client.address} handed the stream over with its KV",
                                              moved=resp.handed_over)
                        if resp.kv_bytes:  # the KV-arrived notice, not output
                            ctx.pool.transfer_ok(source, client.address)
                            ctx.metrics.kv_transferred(resp.kv_transfer_seconds)
                            tracing.add_event(span, "kv_arrived", {tracing.KV_BYTES: resp.kv_bytes,
                                                                   tracing.KV_TRANSFER_TIME: resp.kv_transfer_seconds})
                            continue
                        yield resp.prefilled if resp.HasField("prefilled") else resp
            return
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name} {exc.details()}"
            fault = triage(exc, ctx.budget)
            if fault is Fault.BUSY and not started:
                continue  # the KV is still held: another decode worker may take it
            if fault is Fault.UNVERIFIED:  # refused unread: neither worker is at fault, the pair is
                raise AttemptLost(f"decode worker {client.address}: {exc.details()}", local=True) from exc
            if fault is Fault.TRANSFER:
                ctx.pool.transfer_failed(source, client.address)  # either end, if it keeps failing
                ctx.avoid.update(a for a in (source, client.address) if a is not None)
            elif fault is not Fault.STEP:  # a failed step (not the request's fault) leaves it serving
                ctx.pool.mark_down(client.address)  # the decode worker itself failed
            raise AttemptLost(f"decode worker {client.address}: {exc.code().name} {exc.details()}") from exc
        except Exception as exc:
            error = exc
            raise
        finally:
            call.cancel()
            tracing.end_span(span, error=error)


def _pick(ctx: CallContext, blocks: int, exclude: frozenset[str], prefer: str | None) -> Choice:
    """``prefer`` if it may take the stream now (routable, room for ``blocks``, not excluded),
    else the least loaded decode worker; a worker of one of the request's failed transfers
    (``CallContext.avoid``) only where no other can take it."""
    snapshots = ctx.pool.snapshots(ctx.lora_name)

    def pick(excluded: frozenset[str]) -> Choice:
        if prefer is not None and prefer not in excluded:
            preferred = pick_decode([w for w in snapshots if w.worker_id == prefer], blocks, excluded,
                                    limited=ctx.limited)
            if preferred.worker_id is not None:
                return preferred
        return pick_decode(snapshots, blocks, excluded, limited=ctx.limited)

    return avoiding(pick, exclude, ctx.avoid)


async def _idle_bounded(ctx: CallContext, call, client):
    """``call``'s messages; a gap longer than ``decode_idle_timeout_s`` loses the attempt, and
    so does the worker found hung meanwhile (``pdserve.router.liveness``, usually much
    sooner); a gap that reaches the request's deadline is DEADLINE_EXCEEDED."""
    messages = aiter(call)
    while True:
        idle_s = min(ctx.limits.decode_idle_timeout_s, ctx.budget.remaining_s())
        following = asyncio.ensure_future(anext(messages))
        hung = asyncio.ensure_future(client.lost.wait())
        try:
            done, _ = await asyncio.wait({following, hung}, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung.cancel()
            if not following.done():
                following.cancel()
        if following in done:
            try:
                resp = following.result()
            except StopAsyncIteration:
                return
            yield resp
            continue
        if hung in done:
            raise AttemptLost(f"decode worker {client.address} is hung (no engine progress for "
                              f"{ctx.pool.hang_timeout_s:g} s, hang_timeout_s)")
        ctx.budget.remaining_s()
        raise AttemptLost(f"decode worker {client.address} sent nothing for {idle_s:g} s (decode_idle_timeout_s)")

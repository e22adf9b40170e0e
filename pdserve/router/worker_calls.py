"""Calls to workers from one request's run, and what their answers mean: what a call needs
of its request (``CallContext``), the one reading of a worker's error (``triage``), waiting on
a call unless its worker is found hung, the last message of a streaming call, and a decode
stream started in the background (streamed KV)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.limits import RouterLimits
from pdserve.router.pool import WorkerPool
from pdserve.router.request_budget import RequestBudget
from pdserve.wire.failure import Failure, failure_of
from pdserve.wire.metrics import RequestMetrics

if TYPE_CHECKING:
    from pdserve.router.request_spans import RequestSpans


@dataclass(frozen=True)
class CallContext:
    """What a call to a worker needs of the request it serves."""

    request_id: str  # the client's, for logs (workers know each attempt by its own id)
    pool: WorkerPool
    limits: RouterLimits
    budget: RequestBudget
    metrics: RequestMetrics
    limited: bool  # the client set max_tokens (``pdserve.router.policy.pick_decode``)
    spans: RequestSpans | None = None  # its trace (``pdserve.router.request_spans``); None: tracing off
    # The decode workers whose streams this request's attempts opened, in order (the last one
    # holds the finished stream's KV: ``RequestRun`` tells the KV index so).
    decode_workers: list[str] = field(default_factory=list)
    lora_name: str = ""  # its LoRA adapter: routed to workers that hold it (router.policy.prefer_holders)
    # The two ends of each of this request's KV transfers that failed. Its later attempts pass
    # them over while another worker can take the call (``avoiding``): the router cannot tell
    # which end stalled (a holder that never sends and a reader that never receives look the
    # same to the reader), and a migration back onto the same pair would likely fail alike.
    avoid: set[str] = field(default_factory=set)


class Fault(enum.Enum):
    """What a worker's error means for the attempt, once the request's own faults are out."""

    WORKER = "the worker died, hung or cannot be reached"
    BUSY = "the worker has no room now (RESOURCE_EXHAUSTED)"
    TRANSFER = "the prompt's KV did not move"
    UNVERIFIED = "the reader refused KV that came without checksums (the pair disagrees on verify_kv_transfers)"
    STEP = "a step holding the request raised, and the fault was not the request's"
    REFUSED = "the worker refused the call for another reason"


# A worker that cannot be reached: another may serve the call.
_WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


def triage(exc: grpc.aio.AioRpcError, budget: RequestBudget) -> Fault:
    """The one reading of a worker call's error. Raises what ends the request whichever worker
    serves it: its own fault (INVALID_ARGUMENT, naming the field: bad input, or a fault its
    worker pinned on it alone, which elsewhere would fail again) or its deadline passed (not
    the worker's fault). Returns what else the error says: a step that failed holding it
    without being its fault (``Fault.STEP``: another worker may serve it) and the rest."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidRequestError(error_field(exc), exc.details()) from exc
    budget.remaining_s()
    failure = failure_of(exc)
    if failure is Failure.STEP_FAILED:
        return Fault.STEP
    if failure is Failure.KV_TRANSFER:
        return Fault.TRANSFER
    if failure is Failure.KV_UNVERIFIED:
        return Fault.UNVERIFIED
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Fault.BUSY
    return Fault.WORKER if exc.code() in _WORKER_GONE else Fault.REFUSED


async def unless_hung(awaitable, client, call=None, stall_s: float | None = None, poll_s: float = 0.2):
    """``awaitable``'s result (a unary ``call``, or a read of the streaming ``call``), unless
    ``client`` is found hung first, or, with ``stall_s``, has shown no progress for that long
    (``pdserve.router.liveness``: a SIGSTOPped worker stops at its last answered poll): then the
    call is cancelled and it fails UNAVAILABLE, as for a dead worker (the caller tries another)."""
    call = call if call is not None else awaitable
    answer = asyncio.ensure_future(awaitable)
    hung = asyncio.ensure_future(_lost_or_stalled(client, stall_s, poll_s))
    try:
        await asyncio.wait({answer, hung}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hung.cancel()
        if not answer.done():
            call.cancel()
            answer.cancel()
    if answer.done():
        return answer.result()
    waited = f"{stall_s:g} s" if stall_s is not None else "hang_timeout_s"
    raise unavailable(f"worker {client.address} is hung (no engine progress for {waited})")


async def _lost_or_stalled(client, stall_s: float | None, poll_s: float) -> None:
    """Returns once ``client`` is found hung, or has made no progress for ``stall_s``."""
    if stall_s is None:
        await client.lost.wait()
        return
    while not client.lost.is_set():
        seen = client.liveness
        if seen is not None and time.monotonic() - seen.progressed_at > stall_s:
            return
        await asyncio.sleep(poll_s)


def unavailable(message: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


async def last_message(call):
    """The last message of a streaming call (its first one already read)."""
    last = None
    while (message := await call.read()) is not grpc.aio.EOF:
        last = message
    if last is None or last.kv_streaming:
        raise unavailable("the prefill worker ended the stream without an answer")
    return last


class Started:
    """An async iterator whose first item is being fetched in the background already (a
    decode stream started while the prefill still runs)."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.first = asyncio.ensure_future(first_or_none(iterator))

    async def stream(self):
        item = await self.first
        if item is None:
            return
        yield item
        async for item in self.iterator:
            yield item

    async def close(self) -> None:
        if not self.first.done():
            self.first.cancel()
            with contextlib.suppress(BaseException):
                await self.first
        await self.iterator.aclose()


async def first_or_none(iterator):
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None


_detached: set[asyncio.Task] = set()


def detach(coro) -> asyncio.Task:
    """Run ``coro`` as a task nobody awaits, holding a reference to it until it ends: the
    event loop keeps only weak ones, so an unreferenced task can be collected mid-flight."""
    task = asyncio.ensure_future(coro)
    _detached.add(task)
    task.add_done_callback(_detached.discard)
    return task


async def ignore_errors(awaitable) -> None:
    try:
        await awaitable
    except grpc.aio.AioRpcError:
        pass


def error_field(exc: grpc.aio.AioRpcError) -> str:
    """The request field a worker's INVALID_ARGUMENT names (its ``pdserve-field`` trailer)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "pdserve-field":
            return value
    return "request"

"""Why a worker RPC failed, as a typed code in trailing metadata (never matched in error text).

The router decides from the code what to do next: a failed KV transfer is the decode
worker's peer's fault (re-prefill, keep the decode worker); a failed step is not the
request's fault (try it elsewhere, do not mark the worker down). A request's own fault is
not one of these: the worker ends its call INVALID_ARGUMENT naming the field
(``grpc_util.abort_invalid``), which the router never retries.
"""

from __future__ import annotations

import enum

import grpc

FAILURE_KEY = "pdserve-failure"


class Failure(str, enum.Enum):
    KV_TRANSFER = "kv_transfer"  # the prompt's KV did not arrive (peer unreachable, read failed, lease refused)
    # The holder sent the KV without checksums and the reader verifies: refused unread (fail
    # closed). The pair disagrees on verification; the request is prefilled again locally.
    KV_UNVERIFIED = "kv_unverified"
    # The step holding the request raised, and no part of it ran when the engine split its
    # batch to find whose fault it was (engine.step_isolation): pinned on no request, the
    # request was aborted. Its own fault (it raised alone while the rest ran) is not this:
    # that ends INVALID_ARGUMENT, field "step".
    STEP_FAILED = "step_failed"


async def abort_with(context: grpc.aio.ServicerContext, code: grpc.StatusCode, failure: Failure,
                     message: str) -> None:
    """End the RPC with ``code``, ``message`` and ``failure`` in the trailing metadata."""
    context.set_trailing_metadata(((FAILURE_KEY, failure.value),))
    await context.abort(code, message)


def failure_of(exc: grpc.aio.AioRpcError) -> Failure | None:
    """The failure code a worker attached to ``exc``, if any."""
    for key, value in exc.trailing_metadata() or ():
        if key == FAILURE_KEY:
            try:
                return Failure(value)
            except ValueError:
                return None
    return None

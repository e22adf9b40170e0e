"""How a request run fails: the error a client gets, and the loss of one attempt that the
run recovers from by re-prefilling elsewhere."""

from __future__ import annotations

import grpc

from pdserve.engine.errors import InvalidRequestError
from pdserve.protos import worker_pb2
from pdserve.router.adapters import UnknownModel
from pdserve.router.policy import Choice


class RouteError(Exception):
    """The request cannot be served; ``code`` is the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        super().__init__(message)


class NoPrefillWorker(RouteError):
    """No prefill worker answered this attempt's prefill (every one is hung, dead, gone, or was
    tried and failed): the run prefills the prompt on a decode worker instead, which can
    (``pdserve.router.request_run``). Anywhere else it reads as UNAVAILABLE."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class AttemptLost(Exception):
    """This attempt cannot go on (its transfer failed, a worker died or hung, the decode
    stream ended early): the run re-prefills prompt + tokens sent and continues. ``moved``:
    the decode worker handed the stream over and holds its KV under this lease; the run goes on
    from it on another decode worker instead (``pdserve.router.attempts.MovedKV``). ``local``:
    the next attempt prefills on a decode worker, for no pair agrees on verifying the KV (a
    reader refused KV without checksums, or no decode worker verifies as the holder does)."""

    def __init__(self, message: str, moved: worker_pb2.KVHandle | None = None, local: bool = False):
        super().__init__(message)
        self.moved = moved
        self.local = local


def route_error(choice: Choice) -> Exception:
    """The client's error for a routing choice that found no worker."""
    if choice.too_large:
        return InvalidRequestError("max_tokens", choice.reason)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if choice.saturated else grpc.StatusCode.UNAVAILABLE
    return RouteError(code, choice.reason)


def invalid_status(exc: InvalidRequestError) -> grpc.StatusCode:
    """The gRPC status of a refused request: NOT_FOUND for a model or adapter not served (the
    router's ``UnknownModel``, or a worker's refusal naming ``model``: the adapter went between
    the router's check and the worker's), as HTTP answers 404; INVALID_ARGUMENT otherwise."""
    if isinstance(exc, UnknownModel) or exc.field == "model":
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INVALID_ARGUMENT


def failure_code(exc: Exception) -> str:
    """The gRPC status name a failed request ends with, for the failure counter."""
    if isinstance(exc, RouteError):
        return exc.code.name
    if isinstance(exc, InvalidRequestError):
        return invalid_status(exc).name
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return grpc.StatusCode.INTERNAL.name

"""The HTTP front's refusal, raised wherever a request body is read (validation, tools), and
how the front answers one, or a router or engine error, in OpenAI's error shape."""

from __future__ import annotations

import grpc
from aiohttp import web

from pdserve.engine.errors import InvalidRequestError
from pdserve.router.adapters import UnknownModel
from pdserve.router.errors import RouteError


class HttpError(Exception):
    """A request the HTTP front refuses before it reaches the router's validation."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        self.status, self.kind, self.param = status, kind, param
        super().__init__(message)


_ROUTE_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
                 grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
                 grpc.StatusCode.DEADLINE_EXCEEDED: (408, "timeout")}


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   retry_after_s: int | None = None) -> web.Response:
    """An OpenAI-style error body (``Retry-After`` on a 429 when given)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": str(retry_after_s)} if status == 429 and retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)


def as_http_error(exc: Exception) -> HttpError:
    """What the HTTP front answers for an exception a request raised (one it does not know: raised again)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, InvalidRequestError):
        if isinstance(exc, UnknownModel) or exc.field == "model":  # vLLM's: "The model `x` does not exist."
            return HttpError(404, exc.reason, "NotFoundError", exc.field)
        return HttpError(400, str(exc), "BadRequestError", exc.field)
    if isinstance(exc, RouteError):
        status, kind = _ROUTE_STATUS.get(exc.code, (503, "service_unavailable"))
        return HttpError(status, str(exc), kind)
    raise exc

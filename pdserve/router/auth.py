"""Client authentication on the public plane: one API key, as in ``vllm serve --api-key``.

gRPC callers send metadata ``authorization: Bearer <key>``; HTTP callers the header
``Authorization: Bearer <key>`` (what the ``openai`` client sends for ``api_key=``). A missing
or wrong key is ``UNAUTHENTICATED`` / HTTP 401. Health checks, reflection, ``/health`` and
``/metrics`` stay open, so that load balancers and Prometheus need no secret; every other HTTP
path (``/tokenize``, ``/detokenize``, ``/version``, ``/metrics/targets`` too) needs the key, and
is refused before its body is read.

The key comes from ``--api-key``, ``PDSERVE_API_KEY`` or ``--api-key-file`` (``read_key``).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from aiohttp import web

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_HTTP_PATHS = ("/health", "/metrics")  # the only HTTP paths open without the key


class ApiKeyError(ValueError):
    """The key setting cannot be used; names the setting."""


def read_key(key: str | None, key_file: str | None) -> str | None:
    """The API key: ``key`` itself, or the first line of ``key_file`` (keeps it out of ``ps``)."""
    if key and key_file:
        raise ApiKeyError("api_key and api_key_file are both set; give one")
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ApiKeyError(f"api_key_file: cannot read {key_file}: {exc.strerror}") from exc
        if not key:
            raise ApiKeyError(f"api_key_file: {key_file} is empty")
    return key or None


def _matches(value: str | None, key: str) -> bool:
    """``Bearer <key>``, compared in constant time."""
    scheme, _, given = (value or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every public gRPC call without the key, except health and reflection."""

    def __init__(self, key: str):
        self._key = key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization")
        if _matches(given, self._key):
            return handler
        return _refusing(handler, "missing API key" if given is None else "invalid API key")


def _refusing(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(refuse, **codec)
    return grpc.unary_unary_rpc_method_handler(refuse, **codec)


def http_middleware(key: str) -> Callable:
    """aiohttp middleware: 401 in OpenAI's error shape for a request without the key, on
    every path but ``OPEN_HTTP_PATHS``."""
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization")
        if _matches(given, key):
            return await handler(request)
        message = "missing API key" if given is None else "invalid API key"
        body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
        return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})

    return check

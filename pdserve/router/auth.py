"""Client authentication on the public plane: API keys, each naming its tenant
(``pdserve.router.tenants``); one key alone, as in ``vllm serve --api-key``, is one tenant.

gRPC callers send metadata ``authorization: Bearer <key>``; HTTP callers the header
``Authorization: Bearer <key>`` (what the ``openai`` client sends for ``api_key=``). A missing
or wrong key is ``UNAUTHENTICATED`` / HTTP 401. Health checks, reflection, ``/health`` and
``/metrics`` stay open, so that load balancers and Prometheus need no secret; every other HTTP
path (``/tokenize``, ``/detokenize``, ``/version``, ``/metrics/targets`` too) needs a key, and
is refused before its body is read. Past the check, each front asks ``ApiKeys.tenant_of``
for the caller's tenant itself (``GenerationService.tenant_of``).

The keys come from ``--api-key``, ``PDSERVE_API_KEY`` or ``--api-key-file`` (one key,
``read_key``), or ``--api-keys-file`` (many, ``load_api_keys``). The router keeps only their
SHA-256 digests, and compares a presented key with every one of them in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from aiohttp import web

from pdserve.router.tenants import (DEFAULT_TENANT, ApiKeysFileError, Tenant, TenantLimits, key_digest,
                                   read_api_keys_file)

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


def read_keys(key: str | None, key_file: str | None, keys_file: str | None) -> tuple[str | None, "ApiKeys | None"]:
    """The public plane's keys from the settings, as the router's config takes them: (the one
    key of ``api_key``/``api_key_file``, None) or (None, the tenants of ``api_keys_file``);
    (None, None): the public plane is open. Raises ``ApiKeyError`` naming the setting."""
    one = read_key(key, key_file)
    if keys_file is None:
        return one, None
    if one:
        raise ApiKeyError("api_keys_file and api_key (or api_key_file) are both set; give one (the file may "
                          "hold that key too)")
    try:
        return None, ApiKeys(read_api_keys_file(keys_file))
    except ApiKeysFileError as exc:
        raise ApiKeyError(str(exc)) from None


@dataclass(frozen=True)
class ApiKeys:
    """Every key the router accepts, as (SHA-256 digest, its tenant). Never printed."""

    entries: tuple[tuple[bytes, Tenant], ...]

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.entries)} keys, {len(self.tenants())} tenants)"

    @classmethod
    def single(cls, key: str) -> "ApiKeys":
        # The one key's holder runs the cluster: it may load LoRA adapters (router.lora_admin).
        return cls(((key_digest(key), Tenant(DEFAULT_TENANT, TenantLimits(admin=True))),))

    def tenants(self) -> tuple[Tenant, ...]:
        return tuple({t.name: t for _, t in self.entries}.values())

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant of ``Bearer <key>``; None for a missing or unknown key. Every digest is
        compared, whichever matches, so the time taken tells nothing of which or how much."""
        scheme, _, given = (authorization or "").partition(" ")
        digest = key_digest(given.strip())
        found = None
        for known, tenant in self.entries:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found if scheme.lower() == "bearer" else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every public gRPC call without a known key, except health and reflection."""

    def __init__(self, keys: ApiKeys | str):
        self._keys = ApiKeys.single(keys) if isinstance(keys, str) else keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization")
        if self._keys.tenant_of(given) is not None:
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


def http_middleware(keys: ApiKeys | str) -> Callable:
    """aiohttp middleware: 401 in OpenAI's error shape for a request without a known key, on
    every path but ``OPEN_HTTP_PATHS``."""
    keys = ApiKeys.single(keys) if isinstance(keys, str) else keys

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization")
        if keys.tenant_of(given) is not None:
            return await handler(request)
        message = "missing API key" if given is None else "invalid API key"
        body = {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
        return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})

    return check

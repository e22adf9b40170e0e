"""The internal plane fails closed: where it may bind without mTLS, and which role may call
which internal RPC.

Router admin, worker RPCs and KV metadata can rewrite the routing table, drain workers and
hand out the layout of every cache. So:

- ``check_bind``: an internal server binds a non-loopback address only with mTLS (a CA that
  client certificates must chain to), unless the operator says ``--insecure-internal``.
- ``RoleInterceptor``: each caller's certificate names its roles (SAN URIs
  ``spiffe://pdserve/<role>``, ``pdserve.wire.tls.certificate_roles``), and each internal RPC
  accepts only the roles that need it (``ALLOWED``); anyone else is PERMISSION_DENIED naming
  the method and the roles. A method not listed is refused to everyone, and handlers that
  take a stream of requests are checked like the rest. A caller without a certificate exists
  only on a plane without mTLS (loopback, or insecure by choice), where roles cannot be told
  apart and are not checked (an unlisted method is refused there too).
- The other end: a channel checks the server it reached holds the role it meant to call
  (``pdserve.wire.grpc_util.aio_channel``'s ``peer``), so a decode worker's certificate cannot
  serve as a prefill worker, nor a worker's as the router's admin.

The same interceptor decodes every unary internal request itself: grpc.aio answers a message
its deserializer cannot read with UNKNOWN; garbage must be INVALID_ARGUMENT.
"""

from __future__ import annotations

import ipaddress
import inspect

import grpc
from google.protobuf.message import DecodeError

from pdserve.wire.tls import TlsConfig, certificate_roles

ROLES = ("router", "prefill", "decode", "controller")
_WILDCARDS = ("", "0.0.0.0", "::")

_ADMIN, _PREFILL, _DECODE = "/pdserve.v1.RouterAdmin/", "/pdserve.v1.PrefillWorker/", "/pdserve.v1.DecodeWorker/"
_HEALTH = "/grpc.health.v1.Health/"
ALLOWED: dict[str, frozenset[str]] = {
    # The controller owns the routing table, and replaces it whole. A plain-process worker
    # (pdserve/cluster/worker_cli.py) adds or takes out itself alone, under the role its
    # certificate names and at a host it names (router/admin.py); a plain router reads the table (cluster/worker_router.py).
    _ADMIN + "SetMembership": frozenset({"controller"}),
    _ADMIN + "Join": frozenset({"prefill", "decode"}),
    _ADMIN + "Leave": frozenset({"prefill", "decode"}),
    _ADMIN + "GetMembership": frozenset({"controller", "router"}),
    _ADMIN + "GetLatency": frozenset({"controller", "router"}),  # a plain router observes itself (worker_router)
    _PREFILL + "Prefill": frozenset({"router"}),
    _PREFILL + "PrefillStream": frozenset({"router"}),
    _PREFILL + "Abort": frozenset({"router"}),
    _PREFILL + "WatchKV": frozenset({"decode"}),
    _PREFILL + "Claim": frozenset({"decode"}),
    _PREFILL + "GetAgentMetadata": frozenset({"decode"}),
    _PREFILL + "Release": frozenset({"router", "decode"}),
    _PREFILL + "Stats": frozenset({"router", "controller"}),
    _PREFILL + "Drain": frozenset({"controller"}),
    _DECODE + "Decode": frozenset({"router"}),
    _DECODE + "Abort": frozenset({"router"}),
    # The reversed pull: a decode worker holds a cached prefix, a prefill worker reads it.
    _DECODE + "HoldPrefix": frozenset({"router"}),
    _DECODE + "Claim": frozenset({"prefill"}),
    _DECODE + "GetAgentMetadata": frozenset({"prefill"}),
    _DECODE + "Release": frozenset({"router", "prefill"}),
    _DECODE + "Stats": frozenset({"router", "controller"}),
    _DECODE + "Drain": frozenset({"controller"}),
    # LoRA adapters: the router loads and unloads them on every worker of both pools
    # (POST /v1/load_lora_adapter, router/adapters.py), and gives a joining worker those it lacks.
    _PREFILL + "LoadLoRA": frozenset({"router"}),
    _PREFILL + "UnloadLoRA": frozenset({"router"}),
    _DECODE + "LoadLoRA": frozenset({"router"}),
    _DECODE + "UnloadLoRA": frozenset({"router"}),
    "/pdserve.v1.ElasticWorker/SetRole": frozenset({"controller"}),
    # Every internal server's health: any component may ask (probes go to the plain HTTP port).
    _HEALTH + "Check": frozenset(ROLES),
    _HEALTH + "Watch": frozenset(ROLES),
    _HEALTH + "List": frozenset(ROLES),
}


class InsecureInternalError(ValueError):
    """An internal server would listen beyond loopback without mTLS; names the setting."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a wildcard or a name is not)."""
    if host in _WILDCARDS:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: TlsConfig | None, insecure_internal: bool, what: str) -> None:
    """Refuse to bind ``what`` on ``host`` beyond loopback without mTLS, unless insecure by choice."""
    if is_loopback(host) or insecure_internal or (tls is not None and tls.requires_client_cert):
        return
    raise InsecureInternalError(
        f"{what} would listen on {host or '0.0.0.0'} without mTLS, where anyone who reaches it can drain "
        f"workers, rewrite the routing table and read KV metadata; set tls_ca, tls_cert and tls_key "
        f"(python -m pdserve.cluster.certs makes them), bind a loopback address, or pass --insecure-internal")


def peer_roles(context: grpc.aio.ServicerContext) -> frozenset[str] | None:
    """The roles the caller's certificate names (empty for a certificate that names none),
    None for a caller without a certificate."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None if not context.peer_identities() else frozenset()
    return certificate_roles(pems[0]) & frozenset(ROLES)


def peer_certificate(context: grpc.aio.ServicerContext) -> bytes | None:
    """The PEM certificate the caller presented, None for a caller without one."""
    pems = context.auth_context().get("x509_pem_cert")
    return pems[0] if pems else None


def refusal(method: str, roles: frozenset[str] | None) -> str | None:
    """Why a caller holding ``roles`` (None: no certificate) may not call ``method``; None if it may."""
    allowed = ALLOWED.get(method)
    if allowed is None:
        return f"{method} is not an RPC of the internal plane (wire.internal_plane.ALLOWED lists them)"
    if roles is None or roles & allowed:
        return None
    who = f"roles {', '.join(sorted(roles))}" if roles else "a certificate that names no pdserve role"
    return f"{method} accepts only {', '.join(sorted(allowed))}; the caller presented {who}"


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for an internal RPC whose caller's role is not in ``ALLOWED`` (or that
    is not listed at all), whatever the shape of its handler, and INVALID_ARGUMENT for a unary
    request that is not its message."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary or handler.unary_stream:
            return _guarded(handler, details.method)
        return _guarded_streaming_request(handler, details.method)


async def _check_role(method: str, context) -> None:
    reason = refusal(method, peer_roles(context))
    if reason is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes, with the role check and the decoding in front of its behaviour."""
    decode = handler.request_deserializer

    async def check(raw: bytes, context):
        await _check_role(method, context)
        if decode is None:
            return raw
        try:
            return decode(raw)
        except (DecodeError, RuntimeError, ValueError) as exc:  # upb may raise any of them on garbage
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid request of {method}: {exc}")

    codec = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        inner = handler.unary_stream

        async def streaming(raw, context):
            request = await check(raw, context)
            async for item in _items(inner(request, context)):
                yield item

        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    inner = handler.unary_unary

    async def unary(raw, context):
        request = await check(raw, context)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def _guarded_streaming_request(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler that takes a stream of requests, with the role check before its behaviour
    reads any (gRPC decodes each as it comes, with the handler's own deserializer)."""
    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.stream_stream:
        inner = handler.stream_stream

        async def bidi(requests, context):
            await _check_role(method, context)
            async for item in _items(inner(requests, context)):
                yield item

        return grpc.stream_stream_rpc_method_handler(bidi, **codec)
    inner = handler.stream_unary

    async def client_streaming(requests, context):
        await _check_role(method, context)
        result = inner(requests, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.stream_unary_rpc_method_handler(client_streaming, **codec)


async def _items(result):
    """The responses of a streaming behaviour, async or not; one closed early (the client
    went) runs its own cleanup at once."""
    if hasattr(result, "__aiter__"):
        try:
            async for item in result:
                yield item
        finally:
            await result.aclose()
    else:
        for item in result:
            yield item

"""The internal plane fails closed: where it may bind without mTLS, and which role may call
which internal RPC.

Router admin, worker RPCs and KV metadata can rewrite the routing table, drain workers and
hand out the layout of every cache. So:

- ``check_bind``: an internal server binds a non-loopback address only with mTLS (a CA that
  client certificates must chain to), unless the operator says ``--insecure-internal``.
- ``RoleInterceptor``: each caller's certificate names its role (``pdserve.cluster.certs`` issues
  common names ``pdserve-<role>``), and each internal RPC accepts only the roles that need it
  (``ALLOWED``); anyone else is PERMISSION_DENIED naming the method and the roles. A caller
  without a certificate exists only on a plane without mTLS (loopback, or insecure by choice),
  where roles cannot be told apart and are not checked.

The same interceptor decodes every internal request itself: grpc.aio answers a message its
deserializer cannot read with UNKNOWN; garbage must be INVALID_ARGUMENT.
"""

from __future__ import annotations

import ipaddress
import inspect

import grpc
from google.protobuf.message import DecodeError

from pdserve.wire.tls import TlsConfig

ROLES = ("router", "prefill", "decode", "controller")
ROLE_PREFIX = "pdserve-"  # a certificate's common name: pdserve-<role>
_WILDCARDS = ("", "0.0.0.0", "::")

_ADMIN, _PREFILL, _DECODE = "/pdserve.v1.RouterAdmin/", "/pdserve.v1.PrefillWorker/", "/pdserve.v1.DecodeWorker/"
ALLOWED: dict[str, frozenset[str]] = {
    # The controller owns the routing table; plain-process workers (pdserve/cluster/worker_cli.py)
    # register themselves, and a plain router reads it (pdserve/cluster/worker_router.py).
    _ADMIN + "SetMembership": frozenset({"controller", "prefill", "decode"}),
    _ADMIN + "GetMembership": frozenset({"controller", "prefill", "decode", "router"}),
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
    _DECODE + "Stats": frozenset({"router", "controller"}),
    _DECODE + "Drain": frozenset({"controller"}),
    "/pdserve.v1.ElasticWorker/SetRole": frozenset({"controller"}),
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


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role the caller's certificate names, "" for a certificate that names none, None for
    a caller without a certificate."""
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None if not context.peer_identities() else ""
    name = names[0].decode(errors="replace")
    role = name[len(ROLE_PREFIX):] if name.startswith(ROLE_PREFIX) else ""
    return role if role in ROLES else ""


def refusal(method: str, role: str | None) -> str | None:
    """Why a caller of ``role`` may not call ``method``; None if it may."""
    allowed = ALLOWED.get(method)
    if allowed is None or role is None or role in allowed:
        return None
    who = f"role {role!r}" if role else "a certificate that names no pdserve role"
    return f"{method} accepts only {', '.join(sorted(allowed))}; the caller presented {who}"


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for an internal RPC whose caller's role is not in ``ALLOWED``, and
    INVALID_ARGUMENT for a request that is not its message (unary requests)."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        return _guarded(handler, details.method)


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes, with the role check and the decoding in front of its behaviour."""
    decode = handler.request_deserializer

    async def check(raw: bytes, context):
        reason = refusal(method, peer_role(context))
        if reason is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
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
            result = inner(request, context)
            if hasattr(result, "__aiter__"):
                try:
                    async for item in result:
                        yield item
                finally:  # closed early (the client went): the servicer's own cleanup runs now
                    await result.aclose()
            else:
                for item in result:
                    yield item

        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    inner = handler.unary_unary

    async def unary(raw, context):
        request = await check(raw, context)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(unary, **codec)

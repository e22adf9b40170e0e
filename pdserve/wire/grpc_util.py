"""gRPC settings shared by every process: message limits, keepalive, error mapping, and the
only places servers bind and channels open (with TLS when a ``TlsConfig`` is given)."""

from __future__ import annotations

from typing import Sequence

import grpc

from pdserve.engine.errors import InvalidRequestError
from pdserve.wire.address import Endpoint, resolve
from pdserve.wire.tls import TlsConfig

# What a channel may receive and anyone may send: agent metadata blobs can be large.
MAX_MESSAGE_BYTES = 64 << 20
# What a server accepts in one request, unless told otherwise: every request between our
# processes is far smaller (a prompt of 8192 token ids is ~40 KB). A larger one is refused by
# the transport with RESOURCE_EXHAUSTED before any handler runs.
MAX_RECEIVE_BYTES = 4 << 20
KEEPALIVE_TIME_MS = 10_000  # a dead peer is noticed within this plus the timeout
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A server must accept the pings our own clients send on idle channels: by default it allows
# one per 5 minutes and answers the third early one with GOAWAY "too_many_pings", which drops
# the connection (the next call reconnects) and makes the client back off its keepalive.
SERVER_OPTIONS = OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
]


# gRPC core spreads each connection's age by up to this share either way (its max-age filter).
CONNECTION_AGE_JITTER = 0.1


def aio_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               max_receive_bytes: int = MAX_RECEIVE_BYTES, connection_age_s: float | None = None) -> grpc.aio.Server:
    """A server that takes requests of at most ``max_receive_bytes`` (larger: RESOURCE_EXHAUSTED).
    With ``connection_age_s`` each client connection is sent GOAWAY once it is that old
    (give or take ``CONNECTION_AGE_JITTER``) while the server goes on serving: the client's
    next call opens a new connection, and the calls running on the old one finish there."""
    if max_receive_bytes <= 0:
        raise ValueError(f"max_receive_bytes must be > 0, got {max_receive_bytes}")
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    if connection_age_s:
        options.append(("grpc.max_connection_age_ms", max(1, round(connection_age_s * 1000))))
    return grpc.aio.server(options=options, interceptors=list(interceptors) or None)


def aio_channel(address: str, tls: TlsConfig | None = None, *, peer: str | None = None) -> grpc.aio.Channel:
    """A channel to an internal server of role ``peer`` (``pdserve.wire.internal_plane.ROLES``):
    mTLS with ``tls``, where the handshake fails unless the server's certificate names that
    role; plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=OPTIONS + _peer_options(tls, peer))


def channel(address: str, tls: TlsConfig | None = None, *, peer: str | None = None) -> grpc.Channel:
    """The blocking twin of ``aio_channel`` (the controller's threads)."""
    if tls is None:
        return grpc.insecure_channel(address, options=OPTIONS)
    return grpc.secure_channel(address, tls.channel_credentials(), options=OPTIONS + _peer_options(tls, peer))


def _peer_options(tls: TlsConfig, peer: str | None) -> list[tuple[str, str]]:
    if peer is None:  # a programming error: every mTLS channel knows whom it calls
        raise ValueError("an mTLS channel names the role of the server it calls (peer=...)")
    return tls.channel_options(peer)


def bind(server: grpc.aio.Server, host: str | Endpoint | None, port: int, tls: TlsConfig | None = None) -> str:
    """Bind ``host:port`` (0 picks a free port; TLS with ``tls``) and return the address peers
    should dial: the advertised host (``pdserve.wire.address``), never a wildcard."""
    endpoint = host if isinstance(host, Endpoint) else resolve(host)
    target = f"{endpoint.bind_host}:{port}"
    bound = server.add_insecure_port(target) if tls is None else server.add_secure_port(
        target, tls.server_credentials())
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {target}")
    return endpoint.advertise(bound)


async def abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidRequestError,
                        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
    """INVALID_ARGUMENT (or ``code``: the router's NOT_FOUND for a model it does not serve)
    naming the field; the field also travels as trailing metadata."""
    context.set_trailing_metadata((("pdserve-field", exc.field),))
    await context.abort(code, str(exc))

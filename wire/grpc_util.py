"""gRPC settings shared by every process: message limits, keepalive, error mapping."""

from __future__ import annotations

import grpc

from engine.errors import InvalidRequestError

# Prompts of many thousand token ids and agent metadata blobs exceed the 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20
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


def aio_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> str:
    """Bind ``host:port`` (0 picks a free port) and return the address clients should use."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return f"{host}:{bound}"


async def abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidRequestError) -> None:
    """INVALID_ARGUMENT naming the field; the field also travels as trailing metadata."""
    context.set_trailing_metadata((("pdserve-field", exc.field),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

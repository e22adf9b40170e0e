"""Our servers accept the keepalive pings our clients send on an idle channel.

A server left at gRPC's default (one ping per 5 minutes) answers the third early ping with
GOAWAY "too_many_pings": the connection drops and the channel falls back to IDLE. Real
server, real client, the options every pdserve process uses, with their two ping intervals
(the client's keepalive time and the pace the server allows) divided by ``SCALE``: the ratio
between them, which is what decides GOAWAY, is the real one, and the test idles 3.5 pings
(3.5 s) instead of 35 s. A server at the default allowance still strikes out in that time.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.wire import grpc_util
from pdserve.wire.grpc_util import aio_channel, aio_server, bind

SCALE = 10
PING_INTERVALS = ("grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms")


def scaled(options: list[tuple[str, object]]) -> list[tuple[str, object]]:
    return [(name, value // SCALE if name in PING_INTERVALS else value) for name, value in options]


class _Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def idle_channel_state(pings: float, until_dropped: bool = False) -> grpc.ChannelConnectivity:
    """The channel's state after an idle spell of ``pings`` client keepalive intervals; with
    ``until_dropped``, at the first moment within that spell it is no longer READY."""
    async def run() -> grpc.ChannelConnectivity:
        server = aio_server()
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
        address = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with aio_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                idle_s = pings * dict(grpc_util.OPTIONS)["grpc.keepalive_time_ms"] / 1000
                if until_dropped:
                    try:
                        await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), idle_s)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(idle_s)
                state = channel.get_state()
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return state
        finally:
            await server.stop(0)

    return asyncio.run(run())


@pytest.fixture
def scaled_options(monkeypatch):
    monkeypatch.setattr(grpc_util, "OPTIONS", scaled(grpc_util.OPTIONS))
    monkeypatch.setattr(grpc_util, "SERVER_OPTIONS", scaled(grpc_util.SERVER_OPTIONS))


@pytest.mark.slow
def test_an_idle_channel_stays_connected_past_the_ping_strike_limit(scaled_options):
    # Three keepalive pings and then some: the third is where a default server sends GOAWAY.
    assert idle_channel_state(3.5) == grpc.ChannelConnectivity.READY


@pytest.mark.slow
def test_a_server_at_the_default_ping_allowance_drops_the_idle_channel(scaled_options, monkeypatch):
    """The control: without our server option an idle spell ends the connection (at the third
    ping, given ten: a loaded machine may send them late), so the scaled intervals are long
    enough for gRPC to count the strikes."""
    monkeypatch.setattr(grpc_util, "SERVER_OPTIONS", grpc_util.OPTIONS)
    assert idle_channel_state(10, until_dropped=True) != grpc.ChannelConnectivity.READY

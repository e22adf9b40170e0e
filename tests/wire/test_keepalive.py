"""Our servers accept the keepalive pings our clients send on an idle channel.

A server left at gRPC's default (one ping per 5 minutes) answers the third early ping with
GOAWAY "too_many_pings": the connection drops and the channel falls back to IDLE. Real
server, real client, the settings every pdserve process uses.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.wire.grpc_util import KEEPALIVE_TIME_MS, aio_channel, aio_server, bind


class _Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.slow
def test_an_idle_channel_stays_connected_past_the_ping_strike_limit():
    async def run() -> grpc.ChannelConnectivity:
        server = aio_server()
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
        address = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with aio_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                # Three keepalive pings and then some: the third is where a default server
                # sends GOAWAY.
                await asyncio.sleep(3.5 * KEEPALIVE_TIME_MS / 1000)
                state = channel.get_state()
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return state
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == grpc.ChannelConnectivity.READY

"""A plain-process worker's ``/health`` (its Kubernetes readiness) says 503 until the router's
table lists it, then 200, then 503 once it drains: a rolling update must not count a new worker
pod ready, and stop the old one, before the router can route to the new one.

The router's table is an in-process ``RouterAdmin`` servicer over real gRPC (the membership
calls a worker makes); the worker side is ``pdserve.cluster.worker_cli``'s own ``Membership``
and ``Health``, served over real HTTP.
"""

import asyncio
import socket

import aiohttp
import grpc

from pdserve.cluster.worker_cli import Health, Membership
from pdserve.protos import admin_pb2, admin_pb2_grpc


class Table(admin_pb2_grpc.RouterAdminServicer):
    """The router's membership table, and nothing else; ``reachable`` False answers UNAVAILABLE."""

    def __init__(self):
        self.members = []
        self.reachable = False

    async def Join(self, request, context):
        if not self.reachable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        changed = request.address not in [m.address for m in self.members]
        self.members = [m for m in self.members if m.address != request.address] + [request]
        return admin_pb2.JoinAck(changed=changed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def status(session: aiohttp.ClientSession, port: int) -> int:
    async with session.get(f"http://127.0.0.1:{port}/health") as r:
        return r.status


def test_a_worker_is_ready_only_once_the_router_lists_it_and_until_it_drains():
    async def run() -> list[int]:
        table = Table()
        server = grpc.aio.server()
        admin_pb2_grpc.add_RouterAdminServicer_to_server(table, server)
        admin = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        membership = Membership(admin, None, "decode", "127.0.0.1:1", "decode-0")
        health, port = Health(lambda: membership.joined), free_port()
        runner = await health.serve("127.0.0.1", port)
        keeper = asyncio.create_task(membership.keep_joined(0.05))
        seen = []
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.sleep(0.3)  # several join attempts against a router not answering yet
                seen.append(await status(session, port))
                table.reachable = True
                for _ in range(100):
                    if [m.address for m in table.members] == ["127.0.0.1:1"] and membership.joined:
                        break
                    await asyncio.sleep(0.05)
                seen.append(await status(session, port))
                health.draining = True
                seen.append(await status(session, port))
        finally:
            keeper.cancel()
            await runner.cleanup()
            await server.stop(0)
        return seen

    assert asyncio.run(run()) == [503, 200, 503]

"""Running a role's asyncio gRPC server on a background thread of a Ray actor. Every server
also serves ``grpc.health.v1``."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.wire.address import Endpoint
from pdserve.wire.tls import TlsConfig


@dataclass
class RunningServer:
    address: str
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    on_stop: list[Callable[[], object]] = field(default_factory=list)
    service: object = None  # the main servicer, for in-process callers (tests, the HTTP front)
    http_address: str | None = None  # the router's OpenAI HTTP front
    internal_address: str | None = None  # the router's internal plane (RouterAdmin); workers: ``address``
    drain: Callable[[float], Awaitable[None]] | None = None  # a worker's graceful stop (SIGTERM), given its grace in s
    worker: object = None  # a worker's shell (``pdserve.shell.worker``), for test-only fault injection

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        for fn in self.on_stop:
            result = fn()
            if asyncio.iscoroutine(result):
                await result


async def start_server(host: str | Endpoint | None, port: int, register: Callable[[grpc.aio.Server, str], None],
                       service: str, on_stop: list[Callable[[], object]], *,
                       tls: TlsConfig | None = None, max_receive_bytes: int | None = None,
                       insecure_internal: bool = False) -> RunningServer:
    """Bind (``host`` None: the node's IP; see ``pdserve.wire.address``), let ``register`` add the
    servicers (it gets the advertised address), add health, start. With ``tls`` the server
    speaks mTLS and refuses clients without a certificate signed by its CA, and each RPC
    accepts only the roles that need it; beyond loopback it needs ``tls`` unless
    ``insecure_internal`` (``pdserve.wire.internal_plane``). Requests over ``max_receive_bytes``
    (None: ``pdserve.wire.grpc_util.MAX_RECEIVE_BYTES``) are RESOURCE_EXHAUSTED."""
    from pdserve.wire.address import resolve
    from pdserve.wire.grpc_util import MAX_RECEIVE_BYTES, aio_server, bind
    from pdserve.wire.internal_plane import RoleInterceptor, check_bind

    endpoint = host if isinstance(host, Endpoint) else resolve(host)
    check_bind(endpoint.bind_host, tls, insecure_internal, service)
    server = aio_server([RoleInterceptor()], max_receive_bytes=max_receive_bytes or MAX_RECEIVE_BYTES)
    address = bind(server, endpoint, port, tls)
    register(server, address)
    health = add_health(server, [service])
    await server.start()
    await set_serving(health, [service], True)
    return RunningServer(address, server, health, on_stop)


def add_health(server: grpc.aio.Server, services: list[str]) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await servicer.set(name, status)


class ServerThread:
    """Hosts an asyncio server on a thread with its own event loop (for Ray actors)."""

    def __init__(self, start: Callable[[], Awaitable[RunningServer]], name: str = "grpc-server"):
        self._start = start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self.running: RunningServer | None = None

    def start(self) -> str:
        """Start the server; returns its address once it accepts calls."""
        self._thread.start()
        self.running = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self.running.address

    def submit(self, coro) -> object:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self, grace_s: float = 2.0) -> None:
        if self.running is not None:
            self.submit(self.running.stop(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

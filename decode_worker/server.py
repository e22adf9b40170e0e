"""Starts a decode worker's gRPC server."""

from __future__ import annotations

from decode_worker.service import add_to_server
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from wire.grpc_util import aio_server, bind
from wire.server import RunningServer, add_health, set_serving

SERVICE = "pdserve.v1.DecodeWorker"


async def start(config: DecodeWorkerConfig, worker: DecodeWorker | None = None) -> RunningServer:
    worker = worker or DecodeWorker(config)
    worker.start()
    server = aio_server()
    address = bind(server, config.host, config.port)
    add_to_server(server, worker)
    health = add_health(server, [SERVICE])
    await server.start()
    await set_serving(health, [SERVICE], True)
    return RunningServer(address, server, health, [worker.stop])

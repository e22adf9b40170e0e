"""Starts a prefill worker's gRPC server."""

from __future__ import annotations

from prefill_worker.service import add_to_server
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from wire.grpc_util import aio_server, bind
from wire.server import RunningServer, add_health, set_serving

SERVICE = "pdserve.v1.PrefillWorker"


async def start(config: PrefillWorkerConfig, worker: PrefillWorker | None = None) -> RunningServer:
    worker = worker or PrefillWorker(config)
    worker.start()
    server = aio_server()
    address = bind(server, config.host, config.port)
    add_to_server(server, worker, address)
    health = add_health(server, [SERVICE])
    await server.start()
    await set_serving(health, [SERVICE], True)
    return RunningServer(address, server, health, [worker.stop])

"""Starts a decode worker's gRPC server."""

from __future__ import annotations

from decode_worker.service import add_to_server
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from wire.server import RunningServer, start_server


async def start(config: DecodeWorkerConfig, worker: DecodeWorker | None = None) -> RunningServer:
    worker = worker or DecodeWorker(config)
    worker.start()
    return await start_server(config.host, config.port, lambda server, address: add_to_server(server, worker),
                              "pdserve.v1.DecodeWorker", [worker.stop])

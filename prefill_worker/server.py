"""Starts a prefill worker's gRPC server."""

from __future__ import annotations

from prefill_worker.service import add_to_server
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from wire.server import RunningServer, start_server


async def start(config: PrefillWorkerConfig, worker: PrefillWorker | None = None) -> RunningServer:
    worker = worker or PrefillWorker(config)
    worker.start()
    return await start_server(config.host, config.port, lambda server, address: add_to_server(server, worker, address),
                              "pdserve.v1.PrefillWorker", [worker.stop])

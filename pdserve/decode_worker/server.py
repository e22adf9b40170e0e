"""Starts a decode worker: the shared worker shell around the decode service."""

from __future__ import annotations

from pdserve.decode_worker.service import add_to_server
from pdserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from pdserve.wire.server import RunningServer
from pdserve.shell.server import serve


async def start(config: DecodeWorkerConfig, worker: DecodeWorker | None = None) -> RunningServer:
    worker = worker or DecodeWorker(config)
    return await serve(worker, lambda server, address, metrics: add_to_server(server, worker, metrics, address),
                       "pdserve.v1.DecodeWorker")

"""Starts a decode worker: the shared worker shell around the decode service."""

from __future__ import annotations

from decode_worker.service import add_to_server
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from wire.server import RunningServer
from wire.worker_shell import serve


async def start(config: DecodeWorkerConfig, worker: DecodeWorker | None = None) -> RunningServer:
    worker = worker or DecodeWorker(config)
    return await serve(worker, lambda server, address, metrics: add_to_server(server, worker, metrics),
                       "pdserve.v1.DecodeWorker")

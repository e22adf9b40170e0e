"""Starts a prefill worker: the shared worker shell around the prefill service."""

from __future__ import annotations

from pdserve.prefill_worker.service import add_to_server
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.wire.server import RunningServer
from pdserve.shell.server import serve


async def start(config: PrefillWorkerConfig, worker: PrefillWorker | None = None) -> RunningServer:
    worker = worker or PrefillWorker(config)
    return await serve(worker, lambda server, address, metrics: add_to_server(server, worker, address, metrics),
                       "pdserve.v1.PrefillWorker")

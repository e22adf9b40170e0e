"""Starts a prefill worker: its gRPC server and its Prometheus /metrics."""

from __future__ import annotations

from prefill_worker.service import add_to_server, prefill_stats
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from wire.metrics import WorkerSource, serve_worker
from wire.server import RunningServer, start_server


async def start(config: PrefillWorkerConfig, worker: PrefillWorker | None = None) -> RunningServer:
    worker = worker or PrefillWorker(config)
    worker.start()
    metrics = serve_worker(worker.endpoint, config.metrics_port, WorkerSource(
        "prefill", config.worker_id, lambda: prefill_stats(worker), worker.engine.blocks.block_size))
    return await start_server(worker.endpoint, config.port,
                              lambda server, address: add_to_server(server, worker, address, metrics.address),
                              "pdserve.v1.PrefillWorker", [metrics.stop, worker.stop],
                              tls=config.tls)

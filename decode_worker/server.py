"""Starts a decode worker: its gRPC server and its Prometheus /metrics."""

from __future__ import annotations

from decode_worker.service import add_to_server, decode_stats
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from wire.metrics import WorkerSource, serve_worker
from wire.server import RunningServer, start_server


async def start(config: DecodeWorkerConfig, worker: DecodeWorker | None = None) -> RunningServer:
    worker = worker or DecodeWorker(config)
    worker.start()
    metrics = serve_worker(worker.endpoint, config.metrics_port, WorkerSource(
        "decode", config.worker_id, lambda: decode_stats(worker), worker.engine.blocks.block_size))
    return await start_server(worker.endpoint, config.port,
                              lambda server, address: add_to_server(server, worker, metrics.address),
                              "pdserve.v1.DecodeWorker", [metrics.stop, worker.stop],
                              tls=config.tls)

"""A worker's process face: its gRPC server, health and /metrics, started and stopped together
(``serve``), and the drain that SIGTERM runs."""

from __future__ import annotations

import logging
from typing import Callable

import grpc

from pdserve.shell.worker import WorkerShell
from pdserve.wire import tracing
from pdserve.wire.server import RunningServer, set_serving, start_server
from pdserve.wire.worker_metrics import WorkerSource, serve_worker

log = logging.getLogger(__name__)


async def serve(worker: WorkerShell, register: Callable[[grpc.aio.Server, str, str], None],
                service: str) -> RunningServer:
    """Start ``worker`` (a ``WorkerShell``, or one with the same start, stop, stats, drain and
    in_flight: ``pdserve.elastic_worker.worker.ElasticWorker``), its /metrics and its gRPC server; ``register(server, address,
    metrics_address)`` adds the role's servicer. The returned server's ``drain(grace_s)``
    (SIGTERM) turns health NOT_SERVING, lets in-flight requests finish within ``grace_s``
    (the process's ``drain_grace_seconds``), then stops everything."""
    config = worker.config
    tracing.configure(config.otlp_traces_endpoint, worker.role, config.worker_id)
    worker.start()
    metrics = serve_worker(worker.endpoint, config.metrics_port, WorkerSource(
        worker.role, config.worker_id, worker.stats, worker.engine.blocks.block_size, config.model_name),
        tls=config.tls, insecure_internal=config.insecure_internal)
    running = await start_server(worker.endpoint, config.port,
                                 lambda server, address: register(server, address, metrics.address),
                                 service, [metrics.stop, worker.stop], tls=config.tls,
                                 max_receive_bytes=config.max_receive_bytes,
                                 insecure_internal=config.insecure_internal)

    async def drain(grace_s: float) -> None:
        await set_serving(running.health, [service], False)
        idle = await worker.drain(grace_s)
        if not idle:
            log.warning("%s: %d request(s) still in flight after %.0f s of drain; stopping",
                        config.worker_id, worker.in_flight(), grace_s)
        await running.stop()

    running.drain = drain
    running.worker = worker
    return running

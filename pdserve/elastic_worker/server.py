"""Starts an elastic worker: one server with both roles' services and ``SetRole``."""

from __future__ import annotations

from pdserve.decode_worker import service as decode_service
from pdserve.elastic_worker.service import ElasticService
from pdserve.elastic_worker.worker import ElasticWorker, ElasticWorkerConfig
from pdserve.prefill_worker import service as prefill_service
from pdserve.protos import worker_pb2_grpc
from pdserve.shell.server import serve
from pdserve.wire.server import RunningServer


async def start(config: ElasticWorkerConfig, worker: ElasticWorker | None = None) -> RunningServer:
    worker = worker or ElasticWorker(config)

    def register(server, address: str, metrics_address: str) -> None:
        worker.address = address  # where the KV of streams it hands over is read from
        prefill_service.add_to_server(server, worker.prefill, address, metrics_address)
        decode_service.add_to_server(server, worker.decode, metrics_address, address)
        worker_pb2_grpc.add_ElasticWorkerServicer_to_server(ElasticService(worker), server)

    return await serve(worker, register, "pdserve.v1.ElasticWorker")

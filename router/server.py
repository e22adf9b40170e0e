"""Starts the router: public gRPC API with health and reflection, over a worker pool."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from engine.loader import materialize, read_model_config
from engine.tokenizer import Tokenizer
from protos import admin_pb2_grpc, pdserve_pb2
from router import http_api
from router.admin import RouterAdminService
from router.frontend import ModelInfo
from router.orchestrator import RouterLimits
from router.pool import WorkerPool
from router.service import GenerationService
from wire.grpc_util import aio_server, bind
from wire.server import RunningServer, add_health, set_serving

SERVICE = "pdserve.v1.Generation"


@dataclass(frozen=True)
class RouterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # model, max_model_len, block size
    model_name: str = "smollm2"  # the id ListModels and the OpenAI API report
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 8000  # OpenAI-compatible HTTP; None: gRPC only
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    stats_interval_s: float = 0.2
    limits: RouterLimits = field(default_factory=RouterLimits)


def load_model_info(config: RouterConfig) -> ModelInfo:
    model_dir = materialize(config.engine.model, progress=False)
    cfg = read_model_config(model_dir)
    max_len = min(config.engine.max_model_len or cfg.max_model_len, cfg.max_model_len)
    return ModelInfo(config.model_name, cfg, max_len, config.engine.cache.block_size, Tokenizer(model_dir))


async def start(config: RouterConfig) -> RunningServer:
    model = await asyncio.to_thread(load_model_info, config)
    pool = WorkerPool(config.stats_interval_s)
    for address in config.prefill_addresses:
        pool.add("prefill", address)
    for address in config.decode_addresses:
        pool.add("decode", address)
    await pool.start()
    server = aio_server()
    address = bind(server, config.host, config.port)
    service = GenerationService(model, pool, config.limits)
    service.add_to(server)  # raw-bytes deserializers: garbage is INVALID_ARGUMENT, not UNKNOWN
    admin_pb2_grpc.add_RouterAdminServicer_to_server(RouterAdminService(pool), server)
    health = add_health(server, [SERVICE])
    names = (pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name, "grpc.health.v1.Health",
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    await server.start()
    running = RunningServer(address, server, health, [pool.close], service)
    if config.http_port is not None:
        runner, running.http_address = await http_api.start(service, config.host, config.http_port)
        running.on_stop.insert(0, runner.cleanup)
    asyncio.create_task(_track_health(service, health))
    return running


async def _track_health(service: GenerationService, health) -> None:
    """SERVING while at least one prefill and one decode worker answer and the router is not draining."""
    pool = service.pool
    serving = None
    while True:
        ready = pool.ready() and not service.draining
        if ready != serving:
            await set_serving(health, [SERVICE], ready)
            serving = ready
        await asyncio.sleep(pool.interval_s)

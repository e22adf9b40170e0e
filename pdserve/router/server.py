"""Starts the router: the public gRPC API with health and reflection (and the OpenAI HTTP
API), and apart from it the internal ``RouterAdmin`` the controller uses, over a worker pool.

The public port is all a client may reach. ``RouterAdmin`` can rewrite the routing table, so
it lives only on the internal plane (a private address, mTLS when configured)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

from grpc_reflection.v1alpha import reflection

from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import materialize, read_model_config
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protos import admin_pb2_grpc, pdserve_pb2
from pdserve.router import http_api, loop_lag, tool_parsers
from pdserve.router.adapters import AdapterTable
from pdserve.router.admin import RouterAdminService
from pdserve.router.auth import ApiKeyInterceptor, ApiKeys
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.lora_admin import LoRAAdmin
from pdserve.router.pool import POOLS, WorkerPool
from pdserve.router.service import GenerationService
from pdserve.router.worker_calls import detach
from pdserve.wire import metrics, tracing
from pdserve.wire.address import resolve
from pdserve.wire.grpc_util import aio_server, bind
from pdserve.wire.internal_plane import RoleInterceptor, check_bind
from pdserve.wire.server import RunningServer, add_health, set_serving
from pdserve.wire.tls import TlsConfig

SERVICE = "pdserve.v1.Generation"
# Client work runs on the tokenizer threads (router.client_work), but Python code there holds
# the GIL for a whole switch interval (5 ms by default) each time the loop's thread asks for
# it back, and the loop asks at every socket call: /health under a flood of 20 bodies of
# 3.8 MB took up to 420 ms at 5 ms, 107 ms at 0.5 ms (scripts/health_under_flood.py).
ROUTER_SWITCH_INTERVAL_S = 0.0005
ADMIN_SERVICE = "pdserve.v1.RouterAdmin"


@dataclass(frozen=True)
class RouterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # model, max_model_len, block size
    served_model_names: tuple[str, ...] = ("smollm2",)  # the ids ListModels and /v1/models list; first reported
    tokenizer: str | None = None  # tokenizer directory; None: the model's
    chat_template: str | None = None  # Jinja chat template (a file or the text); None: the tokenizer's
    # Reads tool calls in the model's text for tool_choice "auto" (router.tool_parsers):
    # "auto" picks one from the chat template; "none": "auto" tool choice is refused.
    tool_call_parser: str = tool_parsers.DEFAULT_PARSER
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter may change the adapters served
    # (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they answer 403 naming the flag.
    allow_runtime_lora_updating: bool = False
    host: str = "127.0.0.1"  # public plane bind address (gRPC Generation and OpenAI HTTP)
    grpc_port: int = 50051
    http_port: int | None = 8000  # OpenAI-compatible HTTP; None: gRPC only
    advertise_host: str | None = None  # the public address to report; None: from host (wire.address)
    api_key: str | None = field(default=None, repr=False)  # required on the public plane when set (router.auth); never printed
    # Many keys, each naming its tenant (--api-keys-file; router.tenants); instead of api_key.
    api_keys: ApiKeys | None = field(default=None, repr=False)
    public_tls: TlsConfig | None = None  # TLS on the public gRPC and HTTP ports; with a CA, client certs too
    internal_host: str | None = "127.0.0.1"  # internal plane (RouterAdmin) bind; None: the node's IP
    internal_port: int = 0
    internal_advertise_host: str | None = None
    tls: TlsConfig | None = None  # mTLS on the internal plane: RouterAdmin and the channels to workers
    insecure_internal: bool = False  # allow RouterAdmin beyond loopback without tls (wire.internal_plane)
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    stats_interval_s: float = 0.2
    hang_timeout_s: float = 30.0  # a worker without engine progress this long is hung (router.liveness)
    # Largest gRPC request each server accepts (larger: RESOURCE_EXHAUSTED from the transport).
    # The public one stays above ``limits.requests.max_body_bytes``, so that up to there the
    # router's own check answers INVALID_ARGUMENT naming that limit.
    max_receive_bytes: int = 4 << 20
    # The public gRPC server sends each client connection GOAWAY at this age and goes on
    # serving (wire.grpc_util.aio_server), so a hand-over can move every client off before
    # it stops (router.handover); None: connections live as long as the clients keep them.
    connection_age_s: float | None = None
    limits: RouterLimits = field(default_factory=RouterLimits)
    otlp_traces_endpoint: str | None = None  # export request spans there (wire.tracing); None: off


def load_model_info(config: RouterConfig) -> ModelInfo:
    model_dir = materialize(config.engine.model, progress=False)
    cfg = read_model_config(model_dir)
    max_len = min(config.engine.max_model_len or cfg.max_model_len, cfg.max_model_len)
    tokenizer = Tokenizer(config.tokenizer or model_dir, chat_template=config.chat_template)
    first, *aliases = config.served_model_names
    parser = tool_parsers.choose(config.tool_call_parser, tokenizer.hf.chat_template)
    lora = config.engine.lora
    adapters = AdapterTable(enabled=lora is not None, modules=lora.modules if lora is not None else (),
                            runtime_updates=config.allow_runtime_lora_updating)
    return ModelInfo(first, cfg, max_len, config.engine.cache.block_size, tokenizer, tuple(aliases), parser, adapters)


@dataclass
class RunningRouter(RunningServer):
    http_runner: object = None  # the OpenAI front's aiohttp runner, stopped first in a hand-over


async def start(config: RouterConfig) -> RunningRouter:
    """Two servers: the public plane (``Generation``, health, reflection, the OpenAI API) and
    the internal plane (``RouterAdmin``, health), each on its own port and address."""
    sys.setswitchinterval(ROUTER_SWITCH_INTERVAL_S)  # the process is the router's (see above)
    tracing.configure(config.otlp_traces_endpoint, "router")
    internal_endpoint = resolve(config.internal_host, config.internal_advertise_host)
    check_bind(internal_endpoint.bind_host, config.tls, config.insecure_internal, ADMIN_SERVICE)  # before any work
    model = await asyncio.to_thread(load_model_info, config)
    metrics.register_model(model.name)
    metrics.register_role_changes()
    pool = WorkerPool(config.stats_interval_s, tls=config.tls, hang_timeout_s=config.hang_timeout_s,
                      required_roles=("decode",) if config.limits.local_prefill.colocated else POOLS)
    for address in config.prefill_addresses:
        pool.add("prefill", address)
    for address in config.decode_addresses:
        pool.add("decode", address)
    # The LoRA adapters' admin: the load/unload endpoints, and after each poll a worker is given
    # the adapters it lacks (one that joined after a load, or restarted).
    lora_admin = LoRAAdmin(model.adapters, model.names, pool)
    pool.on_stats = lora_admin.sync
    await pool.start()
    keys = config.api_keys or (ApiKeys.single(config.api_key) if config.api_key else None)
    service = GenerationService(model, pool, config.limits, keys=keys)
    public = resolve(config.host, config.advertise_host)
    server = aio_server([ApiKeyInterceptor(keys)] if keys is not None else (),
                        max_receive_bytes=max(config.max_receive_bytes, 2 * config.limits.requests.max_body_bytes),
                        connection_age_s=config.connection_age_s)
    address = bind(server, public, config.grpc_port, config.public_tls)
    service.add_to(server)  # raw-bytes deserializers: garbage is INVALID_ARGUMENT, not UNKNOWN
    health = add_health(server, [SERVICE])
    names = (pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name, "grpc.health.v1.Health",
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    internal = aio_server([RoleInterceptor()], max_receive_bytes=config.max_receive_bytes)
    internal_address = bind(internal, internal_endpoint, config.internal_port, config.tls)
    admin_pb2_grpc.add_RouterAdminServicer_to_server(RouterAdminService(pool), internal)
    internal_health = add_health(internal, [ADMIN_SERVICE])
    await internal.start()
    await set_serving(internal_health, [ADMIN_SERVICE], True)
    await server.start()
    running = RunningRouter(address, server, health, [lambda: internal.stop(1.0), pool.close], service,
                            internal_address=internal_address)
    if config.http_port is not None:
        runner, running.http_address = await http_api.start(service, public, config.http_port, tls=config.public_tls,
                                                             admin=lora_admin)
        running.on_stop.insert(0, runner.cleanup)
        running.http_runner = runner
    detach(_track_health(service, health))
    detach(loop_lag.probe())  # pdserve:router_loop_lag_seconds
    return running


async def _track_health(service: GenerationService, health) -> None:
    """SERVING while the pool is ready (``WorkerPool.ready``: every pool at start, a decode
    worker after) and the router is not draining."""
    pool = service.pool
    serving = None
    while True:
        ready = pool.ready() and not service.draining and not service.unready
        if ready != serving:
            await set_serving(health, [SERVICE], ready)
            serving = ready
        await asyncio.sleep(pool.interval_s)

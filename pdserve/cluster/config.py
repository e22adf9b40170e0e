"""What one pdserve cluster runs (``ClusterConfig``), and the configs of its processes derived
from it: each worker's (``worker_config``) and the router's (``router_config``).

Built once, by ``pdserve.cluster.serve_config.build`` from the settings or by hand in tests and
benchmarks, and read by ``pdserve.cluster.local.LocalCluster``, which places what it describes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from pdserve.cluster.autoscaling.budget import BudgetConfig
from pdserve.cluster.mode import COLOCATED, DISAGGREGATED, MODES
from pdserve.cluster.placement import PoolPlacement
from pdserve.cluster.settings import (LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS, SettingsError,
                                      check_lease_outlives_transfer)
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer import DEFAULT_BACKEND
from pdserve.kv_transfer.checksum import VERIFY_BY_DEFAULT
from pdserve.router.auth import ApiKeys
from pdserve.router.limits import RouterLimits
from pdserve.router.tool_parsers import DEFAULT_PARSER
from pdserve.wire.logs import LogConfig
from pdserve.wire.tls import TlsConfig

SECRET_SET = "<set>"  # ``ClusterConfig.without_secrets``: a secret is configured, its value withheld


@dataclass(frozen=True)
class ClusterConfig:
    # The router's engine config (it reads the model and its limits), and each pool's workers'
    # where that pool has none of its own below.
    engine: EngineConfig = field(default_factory=EngineConfig)
    # disaggregated: a prefill pool and a decode pool, KV moved between them. colocated: no
    # prefill pool; the decode pool's workers prefill their own requests, prompt chunks mixed
    # into their decode steps (the baseline the disaggregated mode is measured against).
    mode: str = DISAGGREGATED
    num_prefill: int = 1  # 0 in colocated mode
    num_decode: int = 1
    # Each pool's workers' engine config, built at that pool's tensor-parallel size
    # (``prefill_tp``, ``decode_tp`` below; ``pdserve.cluster.serve_config.build`` sets both);
    # None: ``engine``. Different sizes need the KV resharded on transfer.
    prefill_engine: EngineConfig | None = None
    decode_engine: EngineConfig | None = None
    # Every worker is elastic (pdserve.elastic_worker): it serves both roles' RPCs on one engine
    # and starts in its pool's role, which ``LocalCluster.set_role`` changes in place.
    elastic_roles: bool = False
    # With elastic roles: the budget policy (pdserve.cluster.autoscaling.budget) that moves workers
    # between the pools, their number fixed; None: roles change only when asked (pdserve set-role).
    role_budget: BudgetConfig | None = None
    host: str = "127.0.0.1"  # the public plane's bind address (router gRPC and HTTP), as `vllm serve --host`
    grpc_port: int = 50051  # the router's public gRPC port (`pdserve serve --grpc-port`)
    http_port: int | None = 8000  # the router's OpenAI-compatible HTTP port (`--port`); None: off
    advertise_host: str | None = None  # the public address to report; None: from host (wire.address)
    # The internal plane (RouterAdmin, every worker RPC, worker /metrics, the tcp block server)
    # binds this on every node. None: 127.0.0.1 when pdserve starts Ray itself (one machine:
    # nothing internal is reachable from the network), each node's Ray IP when it joins one.
    internal_host: str | None = None
    internal_advertise_host: str | None = None  # only for one node (NAT); None: the bound address
    api_key: str | None = field(default=None, repr=False)  # clients must send it (router.auth); None: open. Never printed
    # Many keys, each naming its tenant with its limits (--api-keys-file; router.tenants); instead of api_key.
    api_keys: ApiKeys | None = field(default=None, repr=False)
    tls: TlsConfig | None = None  # mTLS on the internal plane (wire.tls); None: plaintext
    # Each role's own identity on the internal plane (role -> its certificate, from
    # ``pdserve.cluster.certs``), so that each internal RPC accepts only the roles that need it
    # (wire.internal_plane); a role not named here uses ``tls``.
    role_tls: tuple[tuple[str, TlsConfig], ...] = ()
    insecure_internal: bool = False  # the internal plane may listen beyond loopback without mTLS
    public_tls: TlsConfig | None = None  # TLS on the public plane
    ray_token_auth: bool = True  # a Ray pdserve starts runs with token authentication
    kv_transfer_backend: str = DEFAULT_BACKEND
    lease_seconds: float = LEASE_SECONDS.default
    worker_max_requests: int = 1024  # requests one worker holds at once; past it RESOURCE_EXHAUSTED
    max_receive_bytes: int = 4 << 20  # largest gRPC request each server accepts (the router's public one: see RouterConfig)
    router_limits: RouterLimits = field(default_factory=RouterLimits)  # admission wait, timeouts, sizes
    transfer_timeout_s: float = TRANSFER_TIMEOUT_SECONDS.default
    verify_kv_transfers: bool = VERIFY_BY_DEFAULT  # checksum every KV block handed out, check every one read
    inject_transfer_delay_s: float = 0.0  # test hook: slow every KV read by this much
    threads_per_worker: int | None = None  # torch threads per worker; None: cores / workers
    borrow_idle_cores: bool = True  # pinned workers also borrow the other workers' cores while idle
    lend_tpot_s: float = 0.04  # a pinned decode worker's step period while a prefill borrows its core (shell.core_lending)
    step_trace_dir: str | None = None  # each worker's engine steps, one JSON line each (engine.step_trace)
    ray_address: str | None = None  # join this Ray cluster instead of starting one
    otlp_traces_endpoint: str | None = None  # every process exports its request spans there (wire.tracing)
    served_model_names: tuple[str, ...] = ("smollm2",)  # what the API answers to; the first is reported
    tokenizer: str | None = None  # the router's tokenizer directory; None: the model's
    chat_template: str | None = None  # a Jinja chat template; None: the tokenizer's
    tool_call_parser: str = DEFAULT_PARSER  # router.tool_parsers: reads tool_choice "auto" answers
    allow_runtime_lora_updating: bool = False  # the router's /v1/load_lora_adapter and unload may change adapters
    log: LogConfig = field(default_factory=LogConfig)  # every process's level and format
    router_poll_s: float = 0.2  # how often the router reads every worker's stats
    supervise_interval_s: float | None = 1.0  # how often dead workers are found and replaced; None: never
    # A worker whose engine makes no progress this long while it holds work, or that does not
    # answer this long, is hung: the router migrates its requests, the supervisor replaces it.
    hang_timeout_s: float = 30.0
    autoscaling: dict | None = None  # {"prefill": PoolPolicyConfig, "decode": ...}; None: fixed pool sizes
    autoscale_interval_s: float = 1.0
    autoscale_history: int = 3600  # samples and decisions the autoscaler keeps per pool (the last hour at 1 s)
    prefill_placement: PoolPlacement = field(default_factory=lambda: PoolPlacement(gpus=default_gpus()))
    decode_placement: PoolPlacement = field(default_factory=lambda: PoolPlacement(gpus=default_gpus()))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == COLOCATED and self.elastic_roles:
            raise ValueError("elastic_roles needs the disaggregated mode (a colocated cluster has no prefill pool)")
        if self.role_budget is not None and not self.elastic_roles:
            raise ValueError("role_budget needs elastic_roles: only an elastic worker changes its role in place")
        if self.mode == COLOCATED and self.num_prefill:
            raise ValueError(f"num_prefill must be 0 in colocated mode (no prefill pool), got {self.num_prefill}")
        check_lease_outlives_transfer(self.lease_seconds, self.transfer_timeout_s)
        self._check_tp()

    def _check_tp(self) -> None:
        """Where KV moves between the pools, one TP size divides the other (a decode rank reads
        its heads from the prefill ranks that hold them: pdserve/kv_transfer/sharding.py); elastic
        workers switch pools, so theirs match. (Each is at least 1: ``EngineConfig`` checks it.)"""
        if self.mode == COLOCATED or self.prefill_tp == self.decode_tp:
            return
        if self.elastic_roles:
            raise SettingsError(f"prefill_tp ({self.prefill_tp}) and decode_tp ({self.decode_tp}) differ: elastic "
                                "workers change pools in place, so both pools need one tensor-parallel size")
        small, large = sorted((self.prefill_tp, self.decode_tp))
        if large % small:
            raise SettingsError(f"prefill_tp ({self.prefill_tp}) and decode_tp ({self.decode_tp}) do not divide one "
                                "another: KV moves by head only between sizes where one divides the other")

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of ``role``'s pool (colocated: the decode pool's)."""
        own = self.prefill_engine if role == "prefill" else self.decode_engine
        return own if own is not None else self.engine

    @property
    def prefill_tp(self) -> int:
        """The prefill pool's tensor-parallel ranks per worker."""
        return self.engine_for("prefill").tensor_parallel_size

    @property
    def decode_tp(self) -> int:
        return self.engine_for("decode").tensor_parallel_size

    def tp(self, role: str) -> int:
        """The tensor-parallel size of ``role``'s pool (colocated: the decode pool's)."""
        return self.engine_for(role).tensor_parallel_size

    def without_secrets(self) -> "ClusterConfig":
        """This config for whoever may read it (``Controller.config``, any Ray client): the API
        key replaced by a marker that it is set, no digests of the keys file's keys, and no TLS
        private keys."""
        return dataclasses.replace(
            self, api_key=SECRET_SET if self.api_key is not None or self.api_keys is not None else None,
            api_keys=None,
            tls=dataclasses.replace(self.tls, key_pem=b"") if self.tls is not None else None,
            public_tls=dataclasses.replace(self.public_tls, key_pem=b"") if self.public_tls is not None else None)

    def pools(self) -> tuple[str, ...]:
        """The pools this cluster runs (colocated: the decode pool only)."""
        return ("decode",) if self.mode == COLOCATED else ("prefill", "decode")

    def budget_targets(self) -> dict:
        """The targets the budget policy weighs each pool's pressure against: its autoscaling
        policy's (the defaults where it has none), with the budget's own SLOs where set."""
        from pdserve.cluster.autoscaling import pool_config

        policies = {pool: (self.autoscaling or {}).get(pool) or pool_config(pool) for pool in ("prefill", "decode")}
        return self.role_budget.targets(policies) if self.role_budget is not None else policies

    def autoscaled_pools(self) -> dict:
        """The autoscaling policies of the pools this cluster runs (none without autoscaling)."""
        return {pool: policy for pool, policy in (self.autoscaling or {}).items() if pool in self.pools()}

    def router_limits_for_mode(self) -> RouterLimits:
        """The router's limits, told whether every request prefills on its decode worker."""
        if self.mode != COLOCATED:
            return self.router_limits
        local = dataclasses.replace(self.router_limits.local_prefill, colocated=True)
        return dataclasses.replace(self.router_limits, local_prefill=local)

    def internal_bind_host(self) -> str | None:
        """``internal_host`` as servers take it (None: each resolves its node's IP)."""
        if self.internal_host is None and self.ray_address is None:
            return "127.0.0.1"
        return self.internal_host

    def tls_for(self, role: str) -> TlsConfig | None:
        """The internal plane's TLS of component ``role`` (router, prefill, decode, controller,
        elastic: ``pdserve.cluster.certs.COMPONENT_ROLES``)."""
        return dict(self.role_tls).get(role, self.tls)

    def worker_threads(self) -> int:
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // (self.num_prefill + self.num_decode))

    def max_workers(self) -> int:
        """Workers the cluster may run at once (autoscaling included)."""
        workers = 0
        for pool, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            if pool not in self.pools():
                continue
            policy = (self.autoscaling or {}).get(pool)
            workers += max(count, getattr(policy, "max_replicas", count))
        return workers

    def worker_config(self, role: str, index: int):
        """The config of ``role``'s worker number ``index``."""
        from pdserve.decode_worker.worker import DecodeWorkerConfig
        from pdserve.prefill_worker.config import PrefillWorkerConfig

        common = dict(worker_id=f"{role}-{index}", model_name=self.served_model_names[0], engine=self.engine_for(role),
                      host=self.internal_bind_host(), tls=self.tls_for(role), advertise_host=self.internal_advertise_host,
                      insecure_internal=self.insecure_internal,
                      kv_transfer_backend=self.kv_transfer_backend, verify_kv=self.verify_kv_transfers,
                      max_requests=self.worker_max_requests,
                      max_receive_bytes=self.max_receive_bytes, step_trace_dir=self.step_trace_dir,
                      otlp_traces_endpoint=self.otlp_traces_endpoint)
        if self.elastic_roles:  # both roles' settings, one process, one identity that holds both roles
            from pdserve.elastic_worker.worker import ElasticWorkerConfig

            common["tls"] = self.tls_for("elastic")
            decode = DecodeWorkerConfig(transfer_timeout_s=self.transfer_timeout_s, lease_seconds=self.lease_seconds,
                                        inject_transfer_delay_s=self.inject_transfer_delay_s,
                                        decode_kv_reuse=self.router_limits.decode_kv_reuse, **common)
            return ElasticWorkerConfig(prefill=PrefillWorkerConfig(lease_seconds=self.lease_seconds, **common),
                                       decode=decode, role=role)
        prefill = PrefillWorkerConfig(lease_seconds=self.lease_seconds, reader_tp=self.decode_tp, **common)
        if role == "prefill":
            return prefill
        return DecodeWorkerConfig(transfer_timeout_s=self.transfer_timeout_s, lease_seconds=self.lease_seconds,
                                  inject_transfer_delay_s=self.inject_transfer_delay_s,
                                  decode_kv_reuse=self.router_limits.decode_kv_reuse, reader_tp=self.prefill_tp,
                                  **common)

    def router_config(self, prefill_addresses: tuple[str, ...], decode_addresses: tuple[str, ...]):
        """The router's config, pointed at these workers."""
        from pdserve.router.server import RouterConfig

        return RouterConfig(engine=self.engine, served_model_names=self.served_model_names,
                            tokenizer=self.tokenizer, chat_template=self.chat_template,
                            tool_call_parser=self.tool_call_parser, host=self.host,
                            allow_runtime_lora_updating=self.allow_runtime_lora_updating,
                            grpc_port=self.grpc_port, http_port=self.http_port, advertise_host=self.advertise_host,
                            api_key=self.api_key, api_keys=self.api_keys, public_tls=self.public_tls, internal_host=self.internal_bind_host(),
                            internal_advertise_host=self.internal_advertise_host, tls=self.tls_for("router"),
                            insecure_internal=self.insecure_internal,
                            stats_interval_s=self.router_poll_s, hang_timeout_s=self.hang_timeout_s,
                            max_receive_bytes=self.max_receive_bytes,
                            limits=self.router_limits_for_mode(),
                            prefill_addresses=prefill_addresses, decode_addresses=decode_addresses,
                            otlp_traces_endpoint=self.otlp_traces_endpoint)


def default_gpus() -> float:
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0

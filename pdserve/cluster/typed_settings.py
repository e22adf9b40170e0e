"""The settings of ``pdserve serve`` and ``pdserve worker`` as typed, frozen values: one
dataclass per concern, nested under ``ServeSettings`` and ``WorkerSettings``, built once at
process entry from the settings table's resolved values (``pdserve.cluster.settings.resolve``,
``pdserve.cluster.worker_cli.settings``) and passed down. Readers take attributes, never a
setting's name as a string.

Each field is named as its setting (``--kv-cache-gib`` is ``engine.kv_cache_gib``) and has no
default: defaults, bounds and error messages are written once, in the table. Where the table of
``pdserve worker`` leaves a setting out, its field holds ``pdserve serve``'s default.

The engine's config is built here, in one place (``EngineSettings.engine_config``), for
``pdserve serve``'s pools and for ``pdserve worker`` alike, each at its tensor-parallel size.
"""

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cluster.mode import COLOCATED, DISAGGREGATED
from pdserve.cluster.setting import ByteSize

if TYPE_CHECKING:
    from pdserve.engine.config import SpeculativeConfig

# ``pdserve worker`` has no layout settings: its workers are a disaggregated cluster's, and
# these stand in for ``layout_tpot_slo_s`` and ``layout_ttft_slo_s`` (the table's defaults).
DEFAULT_TPOT_OBJECTIVE_S = 0.1
DEFAULT_TTFT_OBJECTIVE_S = 2.0


class _Typed:
    """A frozen settings dataclass whose fields are checked against their annotations as it is
    built: a value of another type raises ``TypeError`` naming the class and the field."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, allowed = getattr(self, f.name), _classes(f.type)
            if allowed is None:
                continue
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise TypeError(f"{type(self).__name__}.{f.name}: expected {_spelled(f.type)}, got {value!r}")

    @classmethod
    def from_values(cls, values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None):
        """``cls`` from the resolved values of a settings table, by setting name; a field whose
        setting ``values`` lacks takes it from ``defaults``. A value that no field takes raises
        ``TypeError`` naming it (the table and these classes must name the same settings)."""
        taken: set[str] = set()
        built = cls._take(values, defaults or {}, taken)
        left = sorted(set(values) - taken)
        if left:
            raise TypeError(f"{cls.__name__} has no field for setting(s) {', '.join(left)}")
        return built

    @classmethod
    def _take(cls, values: Mapping[str, Any], defaults: Mapping[str, Any], taken: set[str]):
        kwargs = {}
        for f in dataclasses.fields(cls):
            if isinstance(f.type, type) and issubclass(f.type, _Typed):
                kwargs[f.name] = f.type._take(values, defaults, taken)
                continue
            if f.name not in values and f.name not in defaults:
                raise TypeError(f"{cls.__name__}.{f.name}: no value and no default for setting {f.name!r}")
            kwargs[f.name] = values[f.name] if f.name in values else defaults[f.name]
            taken.add(f.name)
        return cls(**kwargs)


def _deferred() -> dict[str, type]:
    """The classes a field names as a string: their module imports torch, which these settings
    must not (``pdserve generate`` reads none of them); by the time a value is checked, the
    settings table has imported it."""
    from pdserve.engine.config import SpeculativeConfig

    return {"SpeculativeConfig": SpeculativeConfig}


@functools.cache
def _classes(hint: Any) -> tuple[type, ...] | None:
    """The classes a value of annotation ``hint`` may be (a float field takes an int too); None
    for ``Any``. A string names ``_deferred`` classes or None, joined by ``|``."""
    if hint is Any:
        return None
    if isinstance(hint, str):
        return tuple(type(None) if name == "None" else _deferred()[name] for name in map(str.strip, hint.split("|")))
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    out: list[type] = []
    for arg in typing.get_args(hint) if union else (hint,):
        origin = typing.get_origin(arg) or arg
        out += [int, float] if origin is float else [origin]
    return tuple(out)


def _spelled(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


@dataclass(frozen=True)
class EngineSettings(_Typed):
    """What each worker's engine runs (``pdserve.engine.config.EngineConfig``)."""

    model: str
    dtype: str | None
    load_format: str
    seed: int
    cuda_graphs: bool
    block_size: int
    kv_cache_gib: float | None  # None: sized by kv_cache_memory, gpu_memory_utilization, or the default
    kv_cache_memory: int | None
    gpu_memory_utilization: float | None
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    mixed_prefill_tokens: int | None  # None: by layout (``mixed_prefill_tokens`` below)
    mixed_step_target_s: float | None  # None: by layout (``step_target_s`` below)
    max_model_len: int | None
    tensor_parallel_size: int
    speculative_config: "SpeculativeConfig | None"  # None: off; only workers that decode take it
    enable_lora: bool
    lora_modules: tuple[str, ...] | None  # each name=path or {"name", "path"} JSON (cluster.lora_settings)
    max_loras: int
    max_lora_rank: int
    kv_offload_bytes: ByteSize | None  # None: no KV tier (cluster.tier_settings)
    kv_offload_dir: str | None

    def cache_config(self):
        """The KV cache's ``CacheConfig``. Its size: ``--kv-cache-memory`` or ``--kv-cache-gib``
        exactly (both given: ``SettingsError``, even when they agree: one setting sizes it), which
        wins over ``--gpu-memory-utilization``; that alone, the rest of its share after the
        weights and a profiled step; none, ``DEFAULT_KV_CACHE_BYTES``."""
        from pdserve.cluster.setting import SettingsError
        from pdserve.engine.config import CacheConfig

        if self.kv_cache_memory is not None and self.kv_cache_gib is not None:
            raise SettingsError(f"kv_cache_memory ({self.kv_cache_memory} bytes, --kv-cache-memory) and kv_cache_gib "
                                f"({self.kv_cache_gib:g} GiB, --kv-cache-gib) both size the KV cache exactly: give one")
        exact = self.kv_cache_memory if self.kv_cache_gib is None else int(self.kv_cache_gib * (1 << 30))
        return CacheConfig(block_size=self.block_size, memory_budget_bytes=exact,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           enable_prefix_cache=self.enable_prefix_caching)

    def engine_config(self, *, tensor_parallel_size: int, mode: str, elastic_roles: bool, tpot_objective_s: float,
                      decodes: bool, device: str | None = None):
        """The ``EngineConfig`` of a worker that runs on ``tensor_parallel_size`` ranks in a
        cluster of ``mode`` (with ``elastic_roles`` or not) whose TPOT objective is
        ``tpot_objective_s``: what the defaults of the mixed step depend on. Only a worker that
        ``decodes`` (a decode or colocated worker, an elastic one in either pool) speculates
        (``--speculative-config``): a prefill worker computes one token per prompt. ``pdserve serve``
        passes its layout settings (the router's engine at ``tensor_parallel_size``, each pool's
        at its own); ``pdserve worker``, whose workers are a disaggregated cluster's, passes
        ``DISAGGREGATED``, no elastic roles and ``DEFAULT_TPOT_OBJECTIVE_S``, and its ``--device``
        (None: CUDA's current device where CUDA is, as Ray's placement leaves it, else the CPU)."""
        from pdserve.cluster.lora_settings import lora_config
        from pdserve.cluster.tier_settings import kv_tier_config
        from pdserve.engine.config import EngineConfig, SchedulerConfig

        cache = self.cache_config()
        lora = lora_config(self.enable_lora, self.lora_modules, self.max_loras, self.max_lora_rank)
        kv_tier = kv_tier_config(self.kv_offload_bytes, self.kv_offload_dir, tensor_parallel_size=tensor_parallel_size,
                                 prefix_cache=cache.enable_prefix_cache)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            mixed_prefill_tokens=mixed_prefill_tokens(self.mixed_prefill_tokens, mode, elastic_roles),
            mixed_step_target_s=step_target_s(self.mixed_step_target_s, mode, tpot_objective_s))
        return EngineConfig(model=self.model, dtype=self.dtype, load_format=self.load_format,
                            max_model_len=self.max_model_len, seed=self.seed,
                            cuda_graphs=self.cuda_graphs, tensor_parallel_size=tensor_parallel_size,
                            cache=cache, scheduler=scheduler, device=device, lora=lora, kv_tier=kv_tier,
                            speculative=self.speculative_config if decodes else None)


def mixed_prefill_tokens(setting: int | None, mode: str, elastic_roles: bool) -> int:
    """The setting, or by layout: capped for a disaggregated cluster's decode workers, whose
    prompts are short suffixes; none where a worker prefills every prompt it serves."""
    from pdserve.engine.config import DISAGGREGATED_MIXED_PREFILL_TOKENS

    if setting is not None:
        return setting
    return DISAGGREGATED_MIXED_PREFILL_TOKENS if mode == DISAGGREGATED and not elastic_roles else 0


def step_target_s(setting: float | None, mode: str | None, tpot_objective_s: float) -> float:
    """The setting, else for a disaggregated cluster's decode workers half the TPOT objective:
    a step with a prompt chunk as long as half the objective leaves each stream's mean gap
    within it, and its longest gaps well inside. Colocated workers prefill every prompt they
    serve: steps that short cut their prefill to a third (BENCHMARKS.md, issue 45), so they
    keep the whole token budget unless the setting asks."""
    if setting is not None:
        return setting
    if mode == COLOCATED:
        return 0.0
    return tpot_objective_s / 2


def overflow_ttft_s(setting: float | None, ttft_objective_s: float) -> float:
    """The setting, else half the TTFT objective: a prompt that would wait longer than that on
    the prefill pool leaves too little of the objective for bursts behind it."""
    return setting if setting is not None else ttft_objective_s / 2


@dataclass(frozen=True)
class LayoutSettings(_Typed):
    """The cluster's shape: its mode and pools, and the objectives ``--layout auto`` weighs."""

    layout: str
    layout_ttft_slo_s: float
    layout_tpot_slo_s: float
    layout_prompt_tokens: int
    layout_output_tokens: int
    mode: str
    prefill: int
    decode: int
    elastic_roles: bool
    role_budget: bool
    prefill_tp: int | None  # None: engine.tensor_parallel_size
    decode_tp: int | None


@dataclass(frozen=True)
class RoleBudgetSettings(_Typed):
    """The role budget's policy (``pdserve.cluster.autoscaling.budget.BudgetConfig``)."""

    role_budget_dwell_s: float
    role_budget_window_s: float
    role_budget_grace_s: float
    role_budget_ttft_slo_s: float | None
    role_budget_itl_slo_s: float | None
    role_budget_mixed: bool


@dataclass(frozen=True)
class RouterSettings(_Typed):
    """The router's limits and choices (``pdserve.router.limits.RouterLimits``)."""

    local_prefill_max_tokens: int
    local_prefill_max_load: float
    local_prefill_interference_weight: float
    kv_move_weight: float
    remote_overhead_tokens: float
    prefill_overflow_s: float | None  # None: half the TTFT objective (``overflow_ttft_s``)
    prefill_overflow_slowdown: float
    decode_kv_reuse: bool
    stream_kv_min_tokens: int
    admission_wait_seconds: float
    request_timeout_seconds: float
    prefill_call_min_seconds: float
    max_waiting_requests: int
    decode_idle_timeout_seconds: float
    routing_policy: str
    routing_prefill_weight: float
    routing_tier_weight: float
    routing_load_weight: float
    routing_temperature: float
    routing_balance_abs_tokens: int
    routing_balance_rel: float
    max_body_bytes: int
    max_prompt_chars: int


@dataclass(frozen=True)
class ApiSettings(_Typed):
    """The public plane: addresses, names, keys, TLS, and the router's tokenizer."""

    served_model_name: tuple[str, ...] | None
    host: str
    port: int
    grpc_port: int
    advertise_host: str | None
    api_key: str | None = dataclasses.field(repr=False)
    api_key_file: str | None
    api_keys_file: str | None
    public_tls_cert: str | None
    public_tls_key: str | None
    public_tls_ca: str | None
    tokenizer: str | None
    chat_template: str | None
    tool_call_parser: str
    allow_runtime_lora_updating: bool  # the router's run-time adapter endpoints (cluster.lora_settings)


@dataclass(frozen=True)
class InternalSettings(_Typed):
    """The internal plane: where it binds, and its mTLS."""

    internal_host: str | None
    internal_advertise_host: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_dir: str | None
    insecure_internal: bool


@dataclass(frozen=True)
class KvTransferSettings(_Typed):
    """How KV moves from prefill to decode workers."""

    kv_transfer_backend: str
    lease_seconds: float
    transfer_timeout_seconds: float
    verify_kv_transfers: bool


@dataclass(frozen=True)
class ProcessSettings(_Typed):
    """How each process runs, logs, traces and stops."""

    drain_grace_seconds: float
    hang_timeout_seconds: float
    threads_per_worker: int | None
    borrow_idle_cores: bool
    lend_tpot_ms: float
    step_trace_dir: str | None
    otlp_traces_endpoint: str | None
    log_level: str
    log_format: str


@dataclass(frozen=True)
class RaySettings(_Typed):
    """The Ray cluster the workers are placed on, and what each reserves there."""

    address: str | None
    cluster_name: str
    cpus_per_worker: float
    gpus_per_worker: float | None  # None: 1 where CUDA is, else 0
    prefill_resource: str | None
    decode_resource: str | None

    def resource(self, pool: str) -> str | None:
        """The custom Ray resource naming ``pool``'s node group."""
        return self.prefill_resource if pool == "prefill" else self.decode_resource


@dataclass(frozen=True)
class ServeSettings(_Typed):
    """Every setting of ``pdserve serve``."""

    engine: EngineSettings
    layout: LayoutSettings
    budget: RoleBudgetSettings
    router: RouterSettings
    api: ApiSettings
    internal: InternalSettings
    kv: KvTransferSettings
    process: ProcessSettings
    ray: RaySettings
    autoscaling: Any  # the file's ``autoscaling:`` section as written (None: off); read by autoscaling.from_mapping


@dataclass(frozen=True)
class PlainWorkerSettings(_Typed):
    """``pdserve worker``'s own settings: its ports and name, and its membership of the router."""

    internal_port: int
    metrics_port: int
    health_port: int | None
    worker_id: str | None
    router_admin: str | None
    join_interval_seconds: float
    member_timeout_seconds: float
    max_connection_age_seconds: float  # the router's public gRPC connections (router.handover)
    device: str | None  # None: CUDA's current device where CUDA is (CUDA_VISIBLE_DEVICES's first), else the CPU
    reader_tp: int  # the other pool's tensor-parallel size: KV checksums by head groups for its ranks


@dataclass(frozen=True)
class WorkerSettings(_Typed):
    """Every setting of ``pdserve worker``: ``pdserve serve``'s concerns that one process
    needs (a setting its table leaves out keeps serve's default), and its own."""

    role: str
    engine: EngineSettings
    router: RouterSettings
    api: ApiSettings
    internal: InternalSettings
    kv: KvTransferSettings
    process: ProcessSettings
    plain: PlainWorkerSettings
    autoscaling: Any  # the router role's observe-only controller, as in ServeSettings


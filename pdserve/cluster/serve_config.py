"""The frozen configs ``pdserve serve`` runs with, built once from its typed settings
(``pdserve.cluster.settings.resolve``): engine, router limits, placement, logging, the cluster.

Everything that can be checked before Ray starts is checked here, and a failure raises
``SettingsError`` naming the setting: a typo costs a second, not a cluster start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pdserve.cluster.settings import SettingsError
from pdserve.cluster.typed_settings import (DEFAULT_TPOT_OBJECTIVE_S, DEFAULT_TTFT_OBJECTIVE_S, ApiSettings,
                                            InternalSettings, RaySettings, RoleBudgetSettings, RouterSettings,
                                            ServeSettings, overflow_ttft_s, step_target_s)

DEFAULT_SERVED_NAME = "smollm2"  # the name of the default model (SmolLM2-135M-Instruct)


def served_names(model: str, served_model_name: tuple[str, ...] | None) -> tuple[str, ...]:
    """``--served-model-name``, else the model as given, as vLLM does; the default model is
    served as ``smollm2``."""
    if served_model_name:
        return tuple(served_model_name)
    return (DEFAULT_SERVED_NAME,) if model == "default" else (model,)


def build(s: ServeSettings):
    """The ``ClusterConfig`` for settings ``s``; raises ``SettingsError`` (and the autoscaling,
    API key and TLS loaders their own typed errors) for a bad value. Each pool's engine is
    built at its tensor-parallel size; the router's (it reads the model's config and
    tokenizer, never its weights) at ``--tensor-parallel-size``, as ``pdserve worker``'s."""
    from pdserve.cluster.autoscaling import from_mapping
    from pdserve.cluster.config import ClusterConfig, default_gpus
    from pdserve.cluster.mode import COLOCATED
    from pdserve.router.auth import read_keys
    from pdserve.wire import tls
    from pdserve.wire.logs import LogConfig

    api, internal, layout, process, kv = s.api, s.internal, s.layout, s.process, s.kv
    _check_paths(api)
    prefill_tp = layout.prefill_tp or s.engine.tensor_parallel_size
    decode_tp = layout.decode_tp or s.engine.tensor_parallel_size
    _check_split(s.engine.model, {"prefill_tp": prefill_tp, "decode_tp": decode_tp})

    def engine(tensor_parallel_size: int, decodes: bool):
        return s.engine.engine_config(tensor_parallel_size=tensor_parallel_size, mode=layout.mode,
                                      elastic_roles=layout.elastic_roles, tpot_objective_s=layout.layout_tpot_slo_s,
                                      decodes=decodes)

    api_key, api_keys = read_keys(api.api_key, api.api_key_file, api.api_keys_file)
    return ClusterConfig(  # an elastic worker of the prefill pool may decode tomorrow: it speculates too
        engine=engine(s.engine.tensor_parallel_size, False), prefill_engine=engine(prefill_tp, layout.elastic_roles),
        decode_engine=engine(decode_tp, True),
        router_limits=router_limits(s.router, layout.layout_ttft_slo_s), mode=layout.mode,
        num_prefill=0 if layout.mode == COLOCATED else layout.prefill, num_decode=layout.decode,
        elastic_roles=layout.elastic_roles, role_budget=_role_budget(layout.role_budget, s.budget),
        host=api.host, grpc_port=api.grpc_port, http_port=None if api.port < 0 else api.port,
        advertise_host=api.advertise_host, internal_host=internal.internal_host,
        internal_advertise_host=internal.internal_advertise_host,
        api_key=api_key, api_keys=api_keys,
        tls=tls.load(internal.tls_cert, internal.tls_key, internal.tls_ca, prefix="tls"),
        role_tls=_role_tls(internal, layout.elastic_roles), insecure_internal=internal.insecure_internal,
        public_tls=tls.load(api.public_tls_cert, api.public_tls_key, api.public_tls_ca, prefix="public_tls",
                            require_ca=False),
        kv_transfer_backend=kv.kv_transfer_backend, lease_seconds=kv.lease_seconds,
        transfer_timeout_s=kv.transfer_timeout_seconds, verify_kv_transfers=kv.verify_kv_transfers,
        hang_timeout_s=process.hang_timeout_seconds,
        threads_per_worker=process.threads_per_worker, borrow_idle_cores=process.borrow_idle_cores,
        lend_tpot_s=process.lend_tpot_ms / 1000,
        step_trace_dir=_absolute(process.step_trace_dir), ray_address=s.ray.address,
        otlp_traces_endpoint=process.otlp_traces_endpoint,
        served_model_names=served_names(s.engine.model, api.served_model_name), tokenizer=api.tokenizer,
        chat_template=api.chat_template, tool_call_parser=api.tool_call_parser,
        allow_runtime_lora_updating=api.allow_runtime_lora_updating,
        log=LogConfig(process.log_level, process.log_format),
        prefill_placement=_placement(s.ray, "prefill", default_gpus),
        decode_placement=_placement(s.ray, "decode", default_gpus),
        autoscaling=from_mapping(s.autoscaling) if s.autoscaling is not None else None)


def _role_budget(on: bool, b: RoleBudgetSettings):
    """The budget policy's config where ``--role-budget`` asks for one, else None."""
    from pdserve.cluster.autoscaling.budget import BudgetConfig

    if not on:
        return None
    return BudgetConfig(dwell_s=b.role_budget_dwell_s, window_s=b.role_budget_window_s,
                        ttft_slo_s=b.role_budget_ttft_slo_s, itl_slo_s=b.role_budget_itl_slo_s,
                        mixed=b.role_budget_mixed, grace_s=b.role_budget_grace_s)


def _role_tls(internal: InternalSettings, elastic_roles: bool) -> tuple:
    """Each component's certificate from ``tls_dir`` (``pdserve.cluster.certs``'s layout, the
    elastic workers' only with ``elastic_roles``), each checked to name its roles; () without one."""
    from pdserve.cluster.certs import COMPONENT_ROLES
    from pdserve.wire import tls

    if not internal.tls_dir:
        return ()
    if internal.tls_cert or internal.tls_key or internal.tls_ca:
        raise tls.TlsConfigError("tls_dir and tls_cert/tls_key/tls_ca are both set; give one")
    d = Path(internal.tls_dir)
    out = []
    for component, roles in COMPONENT_ROLES.items():
        if component == "elastic" and not elastic_roles:
            continue
        config = tls.load(str(d / f"{component}.pem"), str(d / f"{component}.key"), str(d / "ca.pem"), prefix="tls")
        for role in roles:
            tls.check_role(config, role, f"tls_dir {d / component}.pem")
        out.append((component, config))
    return tuple(out)


def _check_split(model: str, sizes: dict[str, int]) -> None:
    """Each tensor-parallel size divides the model's heads, KV heads and intermediate size
    (read from its config; a GGUF is converted once, as the cluster's start would)."""
    if all(size == 1 for size in sizes.values()):
        return
    from pdserve.engine.loader import materialize, read_model_config
    from pdserve.engine.models.registry import check_split
    from pdserve.engine.parallel import ShardError

    cfg = read_model_config(materialize(model, progress=False))
    for name, size in sizes.items():
        try:
            check_split(cfg, size)
        except ShardError as exc:
            raise SettingsError(f"{name}: {exc}") from None


def _absolute(path: str | None) -> str | None:
    """``path`` made absolute here: workers start in directories of Ray's choosing."""
    return None if path is None else str(Path(path).resolve())


def _check_paths(api: ApiSettings) -> None:
    from pdserve.engine.tokenizer import read_chat_template

    if api.tokenizer is not None and not Path(api.tokenizer).is_dir():
        raise SettingsError(f"tokenizer: {api.tokenizer!r} is not a directory")
    if api.chat_template is not None:
        try:
            read_chat_template(api.chat_template)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None


def mixed_step_target_s(v: Mapping[str, Any]) -> float:
    """``step_target_s`` for the planner's simulated clusters (``pdserve.planner.auto_layout``),
    which spell a candidate's settings by name; the cluster's code reads the typed settings."""
    return step_target_s(v["mixed_step_target_s"], v.get("mode"), v.get("layout_tpot_slo_s", DEFAULT_TPOT_OBJECTIVE_S))


def overflow_s(v: Mapping[str, Any]) -> float:
    """``overflow_ttft_s`` for the planner's simulated clusters, as ``mixed_step_target_s``."""
    return overflow_ttft_s(v["prefill_overflow_s"], v.get("layout_ttft_slo_s", DEFAULT_TTFT_OBJECTIVE_S))


def router_limits(r: RouterSettings, ttft_objective_s: float):
    """The router's limits from its settings; ``ttft_objective_s`` sets the prefill overflow's
    default (``overflow_ttft_s``): ``pdserve serve``'s ``layout_ttft_slo_s``, or for ``pdserve
    worker --role router``, which has no layout, ``DEFAULT_TTFT_OBJECTIVE_S``."""
    from pdserve.router.kv_policy import RoutingConfig
    from pdserve.router.local_prefill import LocalPrefillConfig
    from pdserve.router.limits import RouterLimits
    from pdserve.router.validation import BODY_BYTES_PER_CHAR, RequestLimits

    if r.max_body_bytes < BODY_BYTES_PER_CHAR * r.max_prompt_chars:
        raise SettingsError(f"max_body_bytes={r.max_body_bytes} cannot hold a prompt of max_prompt_chars="
                            f"{r.max_prompt_chars} written as JSON escapes: raise it to at least "
                            f"{BODY_BYTES_PER_CHAR} x max_prompt_chars = {BODY_BYTES_PER_CHAR * r.max_prompt_chars}, "
                            f"or lower max_prompt_chars")
    if r.local_prefill_max_load > 1:
        raise SettingsError(f"local_prefill_max_load must be at most 1 (a share of KV blocks), "
                            f"got {r.local_prefill_max_load!r}")
    local = LocalPrefillConfig(max_tokens=r.local_prefill_max_tokens, max_load=r.local_prefill_max_load,
                               interference_weight=r.local_prefill_interference_weight,
                               kv_move_weight=r.kv_move_weight, remote_overhead_tokens=r.remote_overhead_tokens,
                               overflow_ttft_s=overflow_ttft_s(r.prefill_overflow_s, ttft_objective_s),
                               overflow_slowdown=r.prefill_overflow_slowdown)
    routing = RoutingConfig(policy=r.routing_policy, prefill_weight=r.routing_prefill_weight,
                            tier_weight=r.routing_tier_weight,
                            load_weight=r.routing_load_weight, temperature=r.routing_temperature,
                            balance_abs_tokens=r.routing_balance_abs_tokens, balance_rel=r.routing_balance_rel)
    return RouterLimits(local_prefill=local, routing=routing, admission_wait_s=r.admission_wait_seconds,
                        request_timeout_s=r.request_timeout_seconds, prefill_call_min_s=r.prefill_call_min_seconds,
                        max_waiting_requests=r.max_waiting_requests,
                        decode_idle_timeout_s=r.decode_idle_timeout_seconds,
                        stream_kv_min_tokens=r.stream_kv_min_tokens, decode_kv_reuse=r.decode_kv_reuse,
                        requests=RequestLimits(max_body_bytes=r.max_body_bytes, max_prompt_chars=r.max_prompt_chars))


def _placement(ray: RaySettings, pool: str, default_gpus):
    from pdserve.cluster.placement import PoolPlacement

    gpus = ray.gpus_per_worker if ray.gpus_per_worker is not None else default_gpus()
    try:
        return PoolPlacement(cpus=ray.cpus_per_worker, gpus=gpus, resource=ray.resource(pool))
    except ValueError as exc:
        raise SettingsError(str(exc)) from None

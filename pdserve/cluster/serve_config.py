"""The frozen configs ``pdserve serve`` runs with, built once from the settings table's values
(``pdserve.cluster.settings.resolve``): engine, router limits, placement, logging, the cluster.

Everything that can be checked before Ray starts is checked here, and a failure raises
``SettingsError`` naming the setting: a typo costs a second, not a cluster start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.cluster.settings import SettingsError

DEFAULT_SERVED_NAME = "smollm2"  # the name of the default model (SmolLM2-135M-Instruct)
DEFAULT_TPOT_OBJECTIVE_S = 0.1  # layout_tpot_slo_s's default, for `pdserve worker`, which has none
DEFAULT_TTFT_OBJECTIVE_S = 2.0  # layout_ttft_slo_s's, likewise


def served_names(v: dict[str, Any]) -> tuple[str, ...]:
    """``--served-model-name``, else the model as given, as vLLM does; the default model is
    served as ``smollm2``."""
    if v["served_model_name"]:
        return tuple(v["served_model_name"])
    return (DEFAULT_SERVED_NAME,) if v["model"] == "default" else (v["model"],)


def build(v: dict[str, Any]):
    """The ``ClusterConfig`` for resolved settings ``v``; raises ``SettingsError`` (and the
    autoscaling, API key and TLS loaders their own typed errors) for a bad value."""
    from pdserve.cluster.autoscaling import from_mapping
    from pdserve.cluster.config import ClusterConfig, default_gpus
    from pdserve.cluster.mode import COLOCATED
    from pdserve.router.auth import read_keys
    from pdserve.wire import tls
    from pdserve.wire.logs import LogConfig

    _check_paths(v)
    prefill_tp, decode_tp = (v[f"{pool}_tp"] or v["tensor_parallel_size"] for pool in ("prefill", "decode"))
    _check_split(v["model"], {"prefill_tp": prefill_tp, "decode_tp": decode_tp})
    api_key, api_keys = read_keys(v["api_key"], v["api_key_file"], v["api_keys_file"])
    return ClusterConfig(
        engine=_engine(v), router_limits=_router_limits(v), mode=v["mode"],
        num_prefill=0 if v["mode"] == COLOCATED else v["prefill"], num_decode=v["decode"],
        prefill_tp=prefill_tp, decode_tp=decode_tp,
        elastic_roles=v["elastic_roles"], role_budget=_role_budget(v),
        host=v["host"], grpc_port=v["grpc_port"], http_port=None if v["port"] < 0 else v["port"],
        advertise_host=v["advertise_host"], internal_host=v["internal_host"],
        internal_advertise_host=v["internal_advertise_host"],
        api_key=api_key, api_keys=api_keys,
        tls=tls.load(v["tls_cert"], v["tls_key"], v["tls_ca"], prefix="tls"),
        role_tls=_role_tls(v), insecure_internal=v["insecure_internal"],
        public_tls=tls.load(v["public_tls_cert"], v["public_tls_key"], v["public_tls_ca"], prefix="public_tls",
                            require_ca=False),
        kv_transfer_backend=v["kv_transfer_backend"], lease_seconds=v["lease_seconds"],
        transfer_timeout_s=v["transfer_timeout_seconds"], verify_kv_transfers=v["verify_kv_transfers"],
        hang_timeout_s=v["hang_timeout_seconds"],
        threads_per_worker=v["threads_per_worker"], borrow_idle_cores=v["borrow_idle_cores"], step_trace_dir=_absolute(v["step_trace_dir"]), ray_address=v["address"],
        otlp_traces_endpoint=v["otlp_traces_endpoint"],
        served_model_names=served_names(v), tokenizer=v["tokenizer"], chat_template=v["chat_template"],
        tool_call_parser=v["tool_call_parser"],
        log=LogConfig(v["log_level"], v["log_format"]),
        prefill_placement=_placement(v, "prefill", default_gpus), decode_placement=_placement(v, "decode", default_gpus),
        autoscaling=from_mapping(v["autoscaling"]) if v["autoscaling"] is not None else None)


def _role_budget(v: dict[str, Any]):
    """The budget policy's config where ``--role-budget`` asks for one, else None."""
    from pdserve.cluster.autoscaling.budget import BudgetConfig

    if not v["role_budget"]:
        return None
    return BudgetConfig(dwell_s=v["role_budget_dwell_s"], window_s=v["role_budget_window_s"],
                        ttft_slo_s=v["role_budget_ttft_slo_s"], itl_slo_s=v["role_budget_itl_slo_s"],
                        mixed=v["role_budget_mixed"], grace_s=v["role_budget_grace_s"])


def _role_tls(v: dict[str, Any]) -> tuple:
    """Each component's certificate from ``tls_dir`` (``pdserve.cluster.certs``'s layout, the
    elastic workers' only with ``elastic_roles``), each checked to name its roles; () without one."""
    from pdserve.cluster.certs import COMPONENT_ROLES
    from pdserve.wire import tls

    if not v["tls_dir"]:
        return ()
    if v["tls_cert"] or v["tls_key"] or v["tls_ca"]:
        raise tls.TlsConfigError("tls_dir and tls_cert/tls_key/tls_ca are both set; give one")
    d = Path(v["tls_dir"])
    out = []
    for component, roles in COMPONENT_ROLES.items():
        if component == "elastic" and not v["elastic_roles"]:
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


def _check_paths(v: dict[str, Any]) -> None:
    from pdserve.engine.tokenizer import read_chat_template

    if v["tokenizer"] is not None and not Path(v["tokenizer"]).is_dir():
        raise SettingsError(f"tokenizer: {v['tokenizer']!r} is not a directory")
    if v["chat_template"] is not None:
        try:
            read_chat_template(v["chat_template"])
        except ValueError as exc:
            raise SettingsError(str(exc)) from None


def _engine(v: dict[str, Any]):
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    cache = CacheConfig(block_size=v["block_size"], memory_budget_bytes=int(v["kv_cache_gib"] * (1 << 30)),
                        enable_prefix_cache=v["enable_prefix_caching"])
    scheduler = SchedulerConfig(max_num_seqs=v["max_num_seqs"], max_num_batched_tokens=v["max_num_batched_tokens"],
                                mixed_prefill_tokens=_mixed_prefill_tokens(v),
                                mixed_step_target_s=mixed_step_target_s(v))
    return EngineConfig(model=v["model"], dtype=v["dtype"], max_model_len=v["max_model_len"], seed=v["seed"],
                        cuda_graphs=v["cuda_graphs"], cache=cache, scheduler=scheduler)


def _mixed_prefill_tokens(v: dict[str, Any]) -> int:
    """The setting, or by layout: capped for a disaggregated cluster's decode workers, whose
    prompts are short suffixes; none where a worker prefills every prompt it serves."""
    from pdserve.cluster.mode import DISAGGREGATED
    from pdserve.engine.config import DISAGGREGATED_MIXED_PREFILL_TOKENS

    if v["mixed_prefill_tokens"] is not None:
        return v["mixed_prefill_tokens"]
    return DISAGGREGATED_MIXED_PREFILL_TOKENS if v["mode"] == DISAGGREGATED and not v["elastic_roles"] else 0


def mixed_step_target_s(v: dict[str, Any]) -> float:
    """The setting, else for a disaggregated cluster's decode workers half the TPOT objective:
    a step with a prompt chunk as long as half the objective leaves each stream's mean gap
    within it, and its longest gaps well inside. Colocated workers prefill every prompt they
    serve: steps that short cut their prefill to a third (BENCHMARKS.md, issue 45), so they
    keep the whole token budget unless the setting asks."""
    from pdserve.cluster.mode import COLOCATED

    if v["mixed_step_target_s"] is not None:
        return v["mixed_step_target_s"]
    if v.get("mode") == COLOCATED:
        return 0.0
    return v.get("layout_tpot_slo_s", DEFAULT_TPOT_OBJECTIVE_S) / 2


def overflow_s(v: dict[str, Any]) -> float:
    """The setting, else half the TTFT objective: a prompt that would wait longer than that on
    the prefill pool leaves too little of the objective for bursts behind it."""
    if v["prefill_overflow_s"] is not None:
        return v["prefill_overflow_s"]
    return v.get("layout_ttft_slo_s", DEFAULT_TTFT_OBJECTIVE_S) / 2


def _router_limits(v: dict[str, Any]):
    from pdserve.router.kv_policy import RoutingConfig
    from pdserve.router.local_prefill import LocalPrefillConfig
    from pdserve.router.limits import RouterLimits
    from pdserve.router.validation import BODY_BYTES_PER_CHAR, RequestLimits

    if v["max_body_bytes"] < BODY_BYTES_PER_CHAR * v["max_prompt_chars"]:
        raise SettingsError(f"max_body_bytes={v['max_body_bytes']} cannot hold a prompt of max_prompt_chars="
                            f"{v['max_prompt_chars']} written as JSON escapes: raise it to at least "
                            f"{BODY_BYTES_PER_CHAR} x max_prompt_chars = {BODY_BYTES_PER_CHAR * v['max_prompt_chars']}, "
                            f"or lower max_prompt_chars")
    if v["local_prefill_max_load"] > 1:
        raise SettingsError(f"local_prefill_max_load must be at most 1 (a share of KV blocks), "
                            f"got {v['local_prefill_max_load']!r}")
    local = LocalPrefillConfig(max_tokens=v["local_prefill_max_tokens"], max_load=v["local_prefill_max_load"],
                               interference_weight=v["local_prefill_interference_weight"],
                               kv_move_weight=v["kv_move_weight"], remote_overhead_tokens=v["remote_overhead_tokens"],
                               overflow_ttft_s=overflow_s(v), overflow_slowdown=v["prefill_overflow_slowdown"])
    routing = RoutingConfig(policy=v["routing_policy"], prefill_weight=v["routing_prefill_weight"],
                            load_weight=v["routing_load_weight"], temperature=v["routing_temperature"],
                            balance_abs_tokens=v["routing_balance_abs_tokens"], balance_rel=v["routing_balance_rel"])
    return RouterLimits(local_prefill=local, routing=routing, admission_wait_s=v["admission_wait_seconds"],
                        request_timeout_s=v["request_timeout_seconds"],
                        max_waiting_requests=v["max_waiting_requests"],
                        decode_idle_timeout_s=v["decode_idle_timeout_seconds"],
                        stream_kv_min_tokens=v["stream_kv_min_tokens"], decode_kv_reuse=v["decode_kv_reuse"],
                        requests=RequestLimits(max_body_bytes=v["max_body_bytes"],
                                               max_prompt_chars=v["max_prompt_chars"]))


def _placement(v: dict[str, Any], pool: str, default_gpus):
    from pdserve.cluster.placement import PoolPlacement

    gpus = v["gpus_per_worker"] if v["gpus_per_worker"] is not None else default_gpus()
    try:
        return PoolPlacement(cpus=v["cpus_per_worker"], gpus=gpus, resource=v[f"{pool}_resource"])
    except ValueError as exc:
        raise SettingsError(str(exc)) from None

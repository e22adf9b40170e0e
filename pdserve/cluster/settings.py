"""``pdserve serve`` settings: one table, read from defaults, a YAML file, ``PDSERVE_*``
environment variables and command-line flags, in rising order of precedence, into the typed
settings the process passes down (``pdserve.cluster.typed_settings``).

    pdserve serve --config serve.yaml --decode 2      # the flag beats the file
    PDSERVE_KV_CACHE_GIB=4 pdserve serve              # the variable beats the file, not a flag
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from pdserve.cluster.setting import Setting, SettingsError, convert
from pdserve.cluster.typed_settings import DEFAULT_TPOT_OBJECTIVE_S, DEFAULT_TTFT_OBJECTIVE_S, ServeSettings

# Settings that the workers' configs and the plain worker processes also take: declared here
# once, and passed down as plain values (a worker config has no default of its own for them).
# A decode worker claims held KV within milliseconds normally; the lease's slack covers a router
# that waits for room in a full decode pool.
LEASE_SECONDS = Setting("lease_seconds", float, 30.0, "how long held KV waits to be pulled before it is freed "
                        "(a reader renews its claim while it reads); must exceed the KV read timeout", above=0)
# A decode worker gives up on a KV read this long after posting it (the router re-prefills).
TRANSFER_TIMEOUT_SECONDS = Setting("transfer_timeout_seconds", float, 10.0,
                                   "a KV read not done this long after it started fails, and the request "
                                   "re-prefills elsewhere; must be shorter than the lease on held KV", above=0)
DRAIN_GRACE_SECONDS = Setting("drain_grace_seconds", float, 30.0,
                              "on a stop (SIGTERM, SIGINT, pdserve stop): how long in-flight requests may take to "
                              "finish", minimum=0)


@functools.cache
def serve_settings() -> tuple[Setting, ...]:
    """The settings of ``pdserve serve``. A default that a config dataclass also uses is read
    from that dataclass (or the constant its module owns), so every default is written once.
    Built on first use: the owners import torch, which ``pdserve generate`` never needs."""
    from pdserve.engine.config import (DEFAULT_KV_CACHE_BYTES, LOAD_FORMATS, CacheConfig, EngineConfig, SchedulerConfig,
                                      SpeculativeConfig)
    from pdserve.kv_transfer import BACKENDS, DEFAULT_BACKEND
    from pdserve.kv_transfer.checksum import VERIFY_BY_DEFAULT
    from pdserve.router import tool_parsers
    from pdserve.router.kv_policy import POLICIES
    from pdserve.cluster.mode import AUTO, DISAGGREGATED, LAYOUTS, MODES
    from pdserve.cluster.autoscaling.budget import BudgetConfig
    from pdserve.cluster.lora_settings import lora_settings
    from pdserve.cluster.tier_settings import tier_settings
    from pdserve.router.local_prefill import LocalPrefillConfig
    from pdserve.router.limits import RouterLimits
    from pdserve.router.validation import RequestLimits
    from pdserve.wire.logs import FORMATS, LEVELS, LogConfig

    limits, requests, log, local = RouterLimits(), RequestLimits(), LogConfig(), LocalPrefillConfig()
    budget = BudgetConfig()
    routing = limits.routing
    return (
        Setting("model", str, EngineConfig.model, "HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)"),
        Setting("served_model_name", list, None,
                "model name(s) the API answers to; /v1/models lists them all (default: 'smollm2' for the "
                "default model, else MODEL as given)"),
        Setting("layout", str, AUTO,
                "auto: at start the planner simulates each layout this machine's cores can run on its stored CPU "
                "profile and picks the highest predicted goodput for the layout_* objectives (docs/planning.md#"
                "layout-auto); any of --mode, --prefill, --decode, --elastic-roles, --role-budget given wins over "
                "it. disaggregated, colocated: that --mode; elastic: disaggregated with --elastic-roles "
                "--role-budget", LAYOUTS),
        Setting("layout_ttft_slo_s", float, DEFAULT_TTFT_OBJECTIVE_S, "--layout auto: the TTFT objective it predicts "
                "goodput for", above=0),
        Setting("layout_tpot_slo_s", float, DEFAULT_TPOT_OBJECTIVE_S, "--layout auto: the TPOT objective it predicts "
                "goodput for", above=0),
        Setting("layout_prompt_tokens", int, 256, "--layout auto: the prompt length of the workload it simulates",
                minimum=1),
        Setting("layout_output_tokens", int, 64, "--layout auto: the output length of the workload it simulates",
                minimum=1),
        Setting("mode", str, DISAGGREGATED,
                "disaggregated: prefill and decode pools, KV moved between them; colocated: no prefill pool, "
                "each of the --decode workers prefills its own requests, mixed into its decode steps", MODES),
        Setting("prefill", int, 1, "prefill workers (none in colocated mode)", minimum=1),
        Setting("decode", int, 1, "decode workers (colocated mode: the workers)", minimum=1),
        Setting("elastic_roles", bool, False,
                "every worker serves both roles on one engine and starts in its pool's; `pdserve set-role` "
                "moves one between the pools in place, without a model load (docs/elastic-roles.md)"),
        Setting("role_budget", bool, False,
                "with --elastic-roles: the controller moves workers between the pools from each pool's own "
                "pressure, the worker count fixed (docs/elastic-roles.md#the-budget-policy)"),
        Setting("role_budget_dwell_s", float, budget.dwell_s, "the role budget's least time between two switches",
                above=0),
        Setting("role_budget_window_s", float, budget.window_s, "the role budget's window of samples", above=0),
        Setting("role_budget_grace_s", float, budget.grace_s, "how long a worker the role budget moves may finish "
                "what its old role runs; past it, its decode streams move with their KV to the rest of its pool",
                minimum=0),
        Setting("role_budget_ttft_slo_s", float, None, "the TTFT p90 SLO the role budget weighs the prefill pool "
                "against (default: the prefill autoscaling policy's, 2 s)", above=0),
        Setting("role_budget_itl_slo_s", float, None, "the ITL p90 SLO the role budget weighs the decode pool "
                "against (default: the decode autoscaling policy's, 0.2 s)", above=0),
        Setting("role_budget_mixed", bool, budget.mixed, "the role budget may make a decode worker mixed (it "
                "prefills the streams it takes) where no whole worker can move (docs/elastic-roles.md#the-budget-policy)"),
        Setting("local_prefill_max_tokens", int, local.max_tokens,
                "conditional disaggregation: a prompt with fewer uncached tokens than this is prefilled by its "
                "decode worker, not the prefill pool (0: off)", minimum=0),
        Setting("local_prefill_max_load", float, local.max_load,
                "... and only on a decode worker with less than this share of its KV blocks in use", above=0),
        Setting("local_prefill_interference_weight", float, local.interference_weight,
                "decode KV reuse: cost per suffix token and unit of the decode worker's KV load of a local prefill "
                "(the stall it causes that worker's streams)", minimum=0),
        Setting("kv_move_weight", float, local.kv_move_weight,
                "decode KV reuse: cost of moving one token's KV, as a share of computing it", minimum=0),
        Setting("remote_overhead_tokens", float, local.remote_overhead_tokens,
                "decode KV reuse: fixed cost of a remote prefill (calls and a KV read set up), in prompt tokens",
                minimum=0),
        Setting("prefill_overflow_s", float, None,
                "prefill that keeps up: a prompt the prefill pool would start later than this many seconds (its "
                "queue times a prompt token's cost there, as the router has seen it) is prefilled by its decode "
                "worker when that is sooner (docs/routing.md#prefill-that-keeps-up); 0: off (default: half of "
                "layout_ttft_slo_s, the TTFT objective)", minimum=0),
        Setting("prefill_overflow_slowdown", float, local.overflow_slowdown,
                "prefill that keeps up: a prompt token on a decode worker costs this many times a prefill worker's "
                "(its steps carry its streams too) until that worker reports its measured cost", minimum=1),
        Setting("decode_kv_reuse", bool, limits.decode_kv_reuse,
                "conversations keep their KV: decode workers publish their finished blocks (prompt and answer) and "
                "the router prefills each follow-up where most of it is cached (docs/routing.md#conversations-keep-"
                "their-kv; --no-decode-kv-reuse: as before)"),
        Setting("stream_kv_min_tokens", int, limits.stream_kv_min_tokens,
                "prompts at least this long stream their KV to the decode worker chunk by chunk while they "
                "compute (pays when a prompt spans several --max-num-batched-tokens chunks; 0: off)", minimum=0),
        Setting("host", str, "127.0.0.1", "public API bind address (router OpenAI HTTP and gRPC)"),
        Setting("port", int, 8000, "OpenAI-compatible HTTP port, as `vllm serve --port` (0: any free; -1: off)",
                minimum=-1),
        Setting("grpc_port", int, 50051, "router gRPC port (pdserve.v1.Generation; 0: any free)", minimum=0),
        Setting("advertise_host", str, None, "public address to report (default: --host, or the node IP for 0.0.0.0)"),
        Setting("internal_host", str, None,
                "internal plane bind address on every node: RouterAdmin, worker RPCs, worker /metrics, KV "
                "transfer (default: each node's Ray IP; 127.0.0.1 for a Ray pdserve starts)"),
        Setting("internal_advertise_host", str, None, "internal address peers dial, if not the bound one (one node only)"),
        Setting("api_key", str, None, "clients must send 'Authorization: Bearer KEY' (prefer the variable or a file)"),
        Setting("api_key_file", str, None, "file holding the API key"),
        Setting("api_keys_file", str, None,
                "YAML or JSON file of API keys, each naming its tenant, with optional per-tenant limits "
                "(docs/security.md#tenants); instead of --api-key"),
        Setting("tls_ca", str, None, "internal mTLS: CA that signs every component's certificate"),
        Setting("tls_cert", str, None, "internal mTLS: this cluster's component certificate (PEM)"),
        Setting("tls_key", str, None, "internal mTLS: its private key (PEM)"),
        Setting("tls_dir", str, None,
                "internal mTLS with one identity per role: a directory as python -m pdserve.cluster.certs writes it "
                "(ca.pem, router/prefill/decode/controller .pem + .key); instead of tls_ca/tls_cert/tls_key"),
        Setting("insecure_internal", bool, False,
                "let the internal plane listen beyond loopback without mTLS (anyone who reaches it can drain "
                "workers and rewrite routing)"),
        Setting("public_tls_cert", str, None, "public API TLS: server certificate (PEM)"),
        Setting("public_tls_key", str, None, "public API TLS: its private key (PEM)"),
        Setting("public_tls_ca", str, None, "public API TLS: require client certificates signed by this CA"),
        Setting("tokenizer", str, None, "HF directory of the tokenizer to use (default: the model's)"),
        Setting("chat_template", str, None, "Jinja chat template, a file or the template itself (default: the tokenizer's)"),
        Setting("tool_call_parser", str, tool_parsers.DEFAULT_PARSER,
                "reads tool calls in answers to tool_choice auto (auto: by the chat template; none: refuse auto)",
                tool_parsers.CHOICES),
        Setting("dtype", str, EngineConfig.dtype,
                "weights and KV dtype (default: bfloat16; float32 equals transformers token for token)",
                ("float32", "bfloat16", "float16")),
        Setting("load_format", str, EngineConfig.load_format,
                "auto: the model directory's weights; dummy: random weights from its config.json alone (benchmarks)",
                LOAD_FORMATS),
        Setting("seed", int, EngineConfig.seed, "seed of the workers' sampling generators", minimum=0),
        Setting("cuda_graphs", bool, EngineConfig.cuda_graphs,
                "decode steps replay CUDA graphs captured at start, one per batch size 1, 2, 4, 8, 16, 24 ... 256 (CUDA and "
                "the triton attention backend; elsewhere it changes nothing)"),
        Setting("block_size", int, CacheConfig.block_size, "tokens per KV block", minimum=1),
        Setting("kv_cache_gib", float, None, "KV cache per worker, GiB, exactly (default: "
                f"{DEFAULT_KV_CACHE_BYTES / (1 << 30):g} GiB where neither this, --kv-cache-memory nor "
                "--gpu-memory-utilization is given; one of this and --kv-cache-memory only)", above=0),
        Setting("kv_cache_memory", int, None, "KV cache per worker, bytes, exactly, as vLLM's "
                "kv_cache_memory_bytes; wins over --gpu-memory-utilization", minimum=1),
        Setting("gpu_memory_utilization", float, None,
                "the share of the device's total memory (host RAM on a CPU worker) each worker may use for its "
                "weights, activations and KV cache, as `vllm serve --gpu-memory-utilization`: after the weights "
                "load, a profile step of --max-num-batched-tokens measures the peak, and the KV cache gets the "
                "rest (docs/configuration.md#the-kv-caches-size)", above=0, maximum=1),
        Setting("enable_prefix_caching", bool, CacheConfig.enable_prefix_cache, "reuse KV of shared prompt prefixes"),
        Setting("max_num_seqs", int, SchedulerConfig.max_num_seqs, "sequences one worker batches at once", minimum=1),
        Setting("max_num_batched_tokens", int, SchedulerConfig.max_num_batched_tokens,
                "tokens one engine step may compute (the prefill chunk)", minimum=1),
        Setting("mixed_prefill_tokens", int, None,
                "prompt tokens a decode worker computes in a step that also decodes its running streams (its "
                "local prefill of a conversation's next turn): smaller keeps the streams' gaps short, larger "
                "gives the prompt its first token sooner; 0: only max_num_batched_tokens (default: 32 in a "
                "disaggregated cluster without elastic roles, else 0); with mixed_step_target_s above 0 (decode "
                "workers' default) only the chunk until the worker has timed its steps", minimum=0),
        Setting("mixed_step_target_s", float, None,
                "the time a worker's step that decodes streams and prefills a prompt beside them should take: the "
                "prompt's chunk is sized to it from the worker's measured step costs (Sarathi-Serve's chunk, "
                "docs/routing.md#time-sized-chunks); 0: the fixed mixed_prefill_tokens (default: half of "
                "layout_tpot_slo_s, the TPOT objective)", minimum=0),
        *lora_settings(),
        *tier_settings(),
        Setting("max_model_len", int, EngineConfig.max_model_len, "cap on prompt + output tokens (default: the model's)",
                minimum=1),
        Setting("tensor_parallel_size", int, EngineConfig.tensor_parallel_size,
                "processes (ranks) each worker runs the model on, each with 1/N of every layer's heads and MLP rows, "
                "as `vllm serve --tensor-parallel-size`; N must divide the model's attention heads, KV heads and "
                "intermediate size (docs/architecture.md#tensor-parallelism)", minimum=1),
        Setting("speculative_config", SpeculativeConfig, None,
                "speculative decoding on the workers that decode (decode, colocated and elastic workers; prefill "
                "workers never), as `vllm serve --speculative-config`: a JSON object of method (ngram or "
                "draft_model), num_speculative_tokens (1-16), prompt_lookup_min, prompt_lookup_max (ngram), model "
                "(draft_model: a HF directory of the target's vocabulary) and disable_by_batch_size, e.g. "
                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' (docs/speculative.md; default: off)"),
        Setting("prefill_tp", int, None, "--tensor-parallel-size of the prefill pool's workers (default: "
                "--tensor-parallel-size)", minimum=1),
        Setting("decode_tp", int, None, "--tensor-parallel-size of the decode pool's workers (default: "
                "--tensor-parallel-size)", minimum=1),
        Setting("kv_transfer_backend", str, DEFAULT_BACKEND, "how KV moves from prefill to decode workers", BACKENDS),
        LEASE_SECONDS,
        TRANSFER_TIMEOUT_SECONDS,
        Setting("verify_kv_transfers", bool, VERIFY_BY_DEFAULT,
                "the prefill side checksums every KV block it hands out and the decode side checks each block it "
                "reads (a mismatch fails the transfer: the request re-prefills elsewhere); --no-verify-kv-transfers "
                "only to measure what it costs"),
        Setting("admission_wait_seconds", float, limits.admission_wait_s,
                "how long a request waits for room in a full pool before RESOURCE_EXHAUSTED / HTTP 429", minimum=0),
        Setting("request_timeout_seconds", float, limits.request_timeout_s,
                "a request's whole deadline; clients may ask for less (gRPC deadline, the OpenAI body's timeout, "
                "HTTP X-Request-Timeout)", above=0),
        Setting("prefill_call_min_seconds", float, limits.prefill_call_min_s,
                "the least a prefill call waits for its worker's answer (more for long prompts and queues, never "
                "past the request's deadline); past it the prompt goes to another prefill worker, or a decode "
                "worker prefills it", above=0),
        Setting("max_waiting_requests", int, limits.max_waiting_requests,
                "requests without a first token yet; past it RESOURCE_EXHAUSTED / HTTP 429 at once", minimum=1),
        Setting("decode_idle_timeout_seconds", float, limits.decode_idle_timeout_s,
                "a decode stream silent this long migrates the request", above=0),
        Setting("hang_timeout_seconds", float, 30.0,
                "a worker whose engine makes no progress this long while it holds work (or that does not answer) "
                "is hung: its requests migrate and it is replaced", above=0),
        Setting("routing_policy", str, routing.policy,
                "how the router picks a prefill worker: kv (prefix cache and load), load (fewest queued "
                "prompt tokens), round_robin", POLICIES),
        Setting("routing_prefill_weight", float, routing.prefill_weight,
                "kv routing cost per prompt token the worker has not cached", minimum=0),
        Setting("routing_tier_weight", float, routing.tier_weight, "kv routing cost per prompt token the worker "
                "loads from its KV tier (--kv-offload-bytes) instead of computing (docs/routing.md#the-kv-tier)", minimum=0),
        Setting("routing_load_weight", float, routing.load_weight,
                "kv routing cost per prompt token already queued on the worker", minimum=0),
        Setting("routing_temperature", float, routing.temperature,
                "kv routing: 0 picks the cheapest worker; above 0 samples by softmax of the costs", minimum=0),
        Setting("routing_balance_abs_tokens", int, routing.balance_abs_tokens,
                "kv routing falls back to the shortest queue when queues differ by more than this many "
                "tokens ...", minimum=0),
        Setting("routing_balance_rel", float, routing.balance_rel,
                "... and the longest is more than this many times the shortest", minimum=1),
        Setting("max_body_bytes", int, requests.max_body_bytes, "largest HTTP body or gRPC GenerateRequest", minimum=1),
        Setting("max_prompt_chars", int, requests.max_prompt_chars, "largest text prompt, or all chat contents together",
                minimum=1),
        DRAIN_GRACE_SECONDS,
        Setting("threads_per_worker", int, None, "torch threads per worker (default: cores / workers)", minimum=1),
        Setting("borrow_idle_cores", bool, True, "where workers are pinned to cores of their own, each also runs "
                "idle-priority helpers on the other workers' cores, used only while those are idle "
                "(docs/cpu_kernels.md; --no-borrow-idle-cores: each worker on its own cores only)"),
        Setting("lend_tpot_ms", float, 40.0, "while a prefill worker borrows a pinned decode worker's core, the "
                "decode worker starts a step at most this often, so the prefill gets the gaps (its streams' time "
                "per output token meanwhile; at least six of its fastest one-sequence decode steps; keep it well "
                "under the TPOT objective; 0: lend idle time only; docs/cpu_kernels.md)", minimum=0),
        Setting("step_trace_dir", str, None, "each worker appends one JSON line per engine step (its start, "
                "length and batch) to DIR/<worker>.steps.jsonl, on its own host (default: off)"),
        Setting("otlp_traces_endpoint", str, None, "export one OpenTelemetry trace per request (router, prefill, KV "
                "transfer, decode spans) over OTLP/gRPC to this collector, e.g. localhost:4317, as `vllm serve "
                "--otlp-traces-endpoint` (default: off)"),
        Setting("address", str, None, "join this Ray cluster instead of starting one; the controller then runs "
                "detached, and the cluster outlives this command (pdserve stop ends it)"),
        Setting("cluster_name", str, "pdserve", "with --address: the Ray namespace the cluster's named actors live in"),
        Setting("cpus_per_worker", float, 0.01, "logical CPUs each worker's placement group reserves", above=0),
        Setting("gpus_per_worker", float, None, "GPUs per worker (default: 1 where CUDA is, else 0); a fraction shares "
                "one GPU, e.g. 0.5 runs 1 prefill + 1 decode worker on one GPU", minimum=0),
        Setting("prefill_resource", str, None, "custom Ray resource naming the prefill node group"),
        Setting("decode_resource", str, None, "custom Ray resource naming the decode node group"),
        Setting("log_level", str, log.level, "log level of every process", LEVELS),
        Setting("log_format", str, log.format, "log lines as text or one JSON object per line", FORMATS),
    )


# Autoscaling has per-pool settings, so it comes only from the file, as an ``autoscaling:``
# section (see pdserve/cluster/autoscaling); its presence turns autoscaling on.


def check_lease_outlives_transfer(lease_seconds: float, transfer_timeout_s: float) -> None:
    """Raise ``SettingsError`` naming both settings unless ``lease_seconds`` exceeds the
    transfer timeout. A claim renews the lease for ``lease_seconds`` while a read may take the
    transfer timeout: a lease no longer than that could expire between two of its reader's
    renewals, and its blocks be handed to another request while the reader still reads them.
    Every entry point that takes both (``pdserve serve``, ``pdserve worker``) checks it."""
    if lease_seconds <= transfer_timeout_s:
        raise SettingsError(f"lease_seconds ({lease_seconds:g} s, {LEASE_SECONDS.flag}) must exceed "
                            f"transfer_timeout_seconds ({transfer_timeout_s:g} s, {TRANSFER_TIMEOUT_SECONDS.flag}, "
                            "the KV read timeout), or a lease could expire while a decode worker reads its blocks")


def add_arguments(parser: argparse.ArgumentParser, settings: tuple[Setting, ...] | None = None) -> None:
    """Flags default to None so that only flags actually given override the file and env."""
    settings = settings or serve_settings()
    parser.add_argument("--config", type=Path, default=None, help="YAML file of settings (keys as below, snake_case)")
    for s in settings:
        default = f" (default {s.default})" if s.default is not None else ""
        env = f"; env {s.env}"
        if s.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=f"{s.help}{env}")
        elif s.type is bool:
            parser.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{s.help}{default}{env}")
        elif s.type is list:
            parser.add_argument(s.flag, nargs="+", default=None, metavar="NAME", help=f"{s.help}{env} (comma-separated)")
        else:
            metavar = None if s.choices else getattr(s.type, "metavar", None) or {
                int: "N", float: "X", str: "TEXT"}.get(s.type, "JSON")
            parser.add_argument(s.flag, type=str, choices=s.choices, default=None, metavar=metavar,
                                help=f"{s.help}{default}{env}")


def flag_type(s: Setting, flag: str | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` for a parser that takes ``s`` as one flag of its own (``pdserve
    stop``, the plain worker process): the value converted and checked against ``s``'s type,
    choices and bounds, as ``resolve`` checks it."""
    def checked(raw: str) -> Any:
        try:
            return convert(s, raw, flag or s.flag)
        except SettingsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return checked


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeSettings:
    """``pdserve serve``'s settings, typed (``resolve_values``, the rules)."""
    return ServeSettings.from_values(resolve_values(args, environ))


def resolve_values(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
                   settings: tuple[Setting, ...] | None = None) -> dict[str, Any]:
    """By setting name: defaults < YAML file < environment < flags. Every value is converted
    and checked against its setting's type, choices and bounds; a bad one raises
    ``SettingsError`` naming the key and where it came from (the flag, the variable, or the
    file and key). Only the typed settings' constructors read what this returns."""
    settings = settings or serve_settings()
    values = {s.name: s.default for s in settings}
    values["autoscaling"] = None  # only from the file: per-pool settings do not fit in flags
    if getattr(args, "config", None):
        values.update(_from_file(args.config, settings))
    for s in settings:
        if s.env in environ:
            values[s.name] = convert(s, environ[s.env], s.env)
    for s in settings:
        given = getattr(args, s.name, None)
        if given is not None:
            values[s.name] = convert(s, given, "argument" if s.name == "model" else s.flag)
    return values


def given(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
          settings: tuple[Setting, ...] | None = None) -> frozenset[str]:
    """The names of the settings set anywhere but their defaults (the file, a variable or a
    flag): what a user asked for, which a choice made at start (``--layout auto``) must not
    override."""
    settings = settings or serve_settings()
    names = set(_from_file(args.config, settings)) if getattr(args, "config", None) else set()
    names.update(s.name for s in settings if s.env in environ or getattr(args, s.name, None) is not None)
    return frozenset(names)


def _from_file(path: Path, settings) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"--config {path}: cannot read ({exc})") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping of setting names to values")
    by_name = {s.name: s for s in settings}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "autoscaling":  # a nested section, read by cluster.autoscaling.from_mapping
            out[name] = value if value is not None else {}
            continue
        if name not in by_name:
            raise SettingsError(f"--config {path}: unknown setting {key!r}; known: {', '.join(sorted(by_name))}")
        if value is None and by_name[name].default is not None:  # None is no value of its type
            raise SettingsError(f"{path}:{key}: null is not a valid {by_name[name].type.__name__} for {name}")
        out[name] = None if value is None else convert(by_name[name], value, f"{path}:{key}")
    return out

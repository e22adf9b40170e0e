"""``pdserve serve`` settings: one table, read from defaults, a YAML file, ``PDSERVE_*``
environment variables and command-line flags, in rising order of precedence.

    pdserve serve --config serve.yaml --decode 2      # the flag beats the file
    PDSERVE_KV_CACHE_GIB=4 pdserve serve              # the variable beats the file, not a flag
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True)
class Setting:
    name: str  # snake_case; the flag is --kebab-case, the variable PDSERVE_UPPER_CASE
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


SERVE = (
    Setting("model", str, "default", "HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)"),
    Setting("prefill", int, 1, "prefill workers"),
    Setting("decode", int, 1, "decode workers"),
    Setting("host", str, "127.0.0.1", "public API bind address (router gRPC and OpenAI HTTP)"),
    Setting("port", int, 50051, "router gRPC port"),
    Setting("http_port", int, 8000, "OpenAI-compatible HTTP port (-1: off)"),
    Setting("advertise_host", str, None, "public address to report (default: --host, or the node IP for 0.0.0.0)"),
    Setting("internal_host", str, None,
            "internal plane bind address on every node: RouterAdmin, worker RPCs, worker /metrics, KV "
            "transfer (default: each node's Ray IP; 127.0.0.1 for a Ray pdserve starts)"),
    Setting("internal_advertise_host", str, None, "internal address peers dial, if not the bound one (one node only)"),
    Setting("api_key", str, None, "clients must send 'Authorization: Bearer KEY' (prefer the variable or a file)"),
    Setting("api_key_file", str, None, "file holding the API key"),
    Setting("tls_ca", str, None, "internal mTLS: CA that signs every component's certificate"),
    Setting("tls_cert", str, None, "internal mTLS: this cluster's component certificate (PEM)"),
    Setting("tls_key", str, None, "internal mTLS: its private key (PEM)"),
    Setting("public_tls_cert", str, None, "public API TLS: server certificate (PEM)"),
    Setting("public_tls_key", str, None, "public API TLS: its private key (PEM)"),
    Setting("public_tls_ca", str, None, "public API TLS: require client certificates signed by this CA"),
    Setting("dtype", str, None, "weights and KV dtype (default: bfloat16; float32 equals transformers token for token)",
            ("float32", "bfloat16", "float16")),
    Setting("block_size", int, 16, "tokens per KV block"),
    Setting("kv_cache_gib", float, 1.0, "KV cache per worker, GiB"),
    Setting("max_model_len", int, None, "cap on prompt + output tokens (default: the model's)"),
    Setting("kv_transfer_backend", str, "nixl", "how KV moves from prefill to decode workers", ("nixl", "tcp")),
    Setting("lease_seconds", float, 30.0, "how long held KV waits to be pulled before it is freed"),
    Setting("admission_wait_seconds", float, 30.0,
            "how long a request waits for room in a full pool before RESOURCE_EXHAUSTED / HTTP 429"),
    Setting("request_timeout_seconds", float, 600.0,
            "a request's whole deadline; clients may ask for less (gRPC deadline, HTTP X-Request-Timeout)"),
    Setting("max_waiting_requests", int, 256,
            "requests without a first token yet; past it RESOURCE_EXHAUSTED / HTTP 429 at once"),
    Setting("decode_idle_timeout_seconds", float, 60.0, "a decode stream silent this long migrates the request"),
    Setting("hang_timeout_seconds", float, 30.0,
            "a worker whose engine makes no progress this long while it holds work (or that does not answer) "
            "is hung: its requests migrate and it is replaced"),
    Setting("max_body_bytes", int, 4 << 20, "largest HTTP body or gRPC GenerateRequest"),
    Setting("max_prompt_chars", int, 262_144, "largest text prompt, or all chat contents together"),
    Setting("drain_grace_seconds", float, 30.0,
            "on SIGTERM/SIGINT: how long in-flight requests may take to finish before the cluster stops"),
    Setting("threads_per_worker", int, None, "torch threads per worker (default: cores / workers)"),
    Setting("address", str, None, "join this Ray cluster instead of starting one"),
    Setting("cpus_per_worker", float, 0.01, "logical CPUs each worker's placement group reserves"),
    Setting("gpus_per_worker", float, None, "GPUs per worker (default: 1 where CUDA is, else 0)"),
    Setting("prefill_resource", str, None, "custom Ray resource naming the prefill node group"),
    Setting("decode_resource", str, None, "custom Ray resource naming the decode node group"),
)
# Autoscaling has per-pool settings, so it comes only from the file, as an ``autoscaling:``
# section (see cluster/autoscaling); its presence turns autoscaling on.


class SettingsError(ValueError):
    """A setting could not be read; the message names where it came from."""


def add_arguments(parser: argparse.ArgumentParser, settings=SERVE) -> None:
    """Flags default to None so that only flags actually given override the file and env."""
    parser.add_argument("--config", type=Path, default=None, help="YAML file of settings (keys as below, snake_case)")
    for s in settings:
        if s.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=f"{s.help}; env {s.env}")
            continue
        default = f" (default {s.default})" if s.default is not None else ""
        metavar = None if s.choices else {int: "N", float: "X", str: "TEXT"}[s.type]
        parser.add_argument(s.flag, type=s.type, choices=s.choices, default=None, metavar=metavar,
                            help=f"{s.help}{default}; env {s.env}")


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ, settings=SERVE) -> dict[str, Any]:
    """defaults < YAML file < environment < flags."""
    values = {s.name: s.default for s in settings}
    values["autoscaling"] = None  # only from the file: per-pool settings do not fit in flags
    if getattr(args, "config", None):
        values.update(_from_file(args.config, settings))
    for s in settings:
        if s.env in environ:
            values[s.name] = _convert(s, environ[s.env], s.env)
    for s in settings:
        given = getattr(args, s.name, None)
        if given is not None:
            values[s.name] = given
    return values


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
        out[name] = None if value is None else _convert(by_name[name], value, f"{path}:{key}")
    return out


def _convert(s: Setting, raw: Any, where: str) -> Any:
    try:
        value = s.type(raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {raw!r} is not a valid {s.type.__name__} for {s.name}") from exc
    if s.choices and value not in s.choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(s.choices)}")
    return value

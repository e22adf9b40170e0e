"""The LoRA settings of ``pdserve serve`` and ``pdserve worker``, as vLLM spells them
(``--enable-lora``, ``--lora-modules``, ``--max-loras``, ``--max-lora-rank``), and how they
become the engine's ``LoRAConfig`` (``lora_config``), checked before anything starts; and the
router's ``--allow-runtime-lora-updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), without
which the run-time load and unload endpoints refuse (docs/lora.md#serving).

``--lora-modules`` takes one or more adapters, each ``name=path`` or vLLM's JSON form
``{"name": ..., "path": ...}`` (a YAML file may also give mappings); every worker of both pools
loads them at start (the prefill worker computes the adapter's KV, the decode worker decodes
with it), and the router serves each under its name (docs/lora.md#serving).
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.cluster.setting import Setting, SettingsError


def lora_settings() -> tuple[Setting, ...]:
    """The five settings, with ``LoRAConfig``'s defaults and bounds."""
    from pdserve.engine.config import LoRAConfig

    return (
        Setting("enable_lora", bool, False, "serve LoRA adapters: a request names one as its model "
                "(docs/lora.md#serving); adapters come from --lora-modules and POST /v1/load_lora_adapter"),
        Setting("lora_modules", list, None, "adapters every worker loads at start, each name=path (a PEFT "
                "directory) or vLLM's JSON form {\"name\": ..., \"path\": ...}; needs --enable-lora"),
        Setting("max_loras", int, LoRAConfig.max_loras, "adapters one engine step may run at once (each holds a "
                "slot of stacked weights on the device; more stay loaded on the host)", minimum=1),
        Setting("max_lora_rank", int, LoRAConfig.max_lora_rank, "the largest adapter rank a worker takes (a larger "
                "one is refused at load, naming lora_path)", minimum=1, maximum=512),
        Setting("allow_runtime_lora_updating", bool, False, "the router's POST /v1/load_lora_adapter and "
                "/v1/unload_lora_adapter may change the served adapters (each loads a directory on every worker's "
                "host; with API keys, admin callers only); off, they answer 403 naming this flag"),
    )


def parse_module(item: object) -> tuple[str, str]:
    """One ``--lora-modules`` entry as (name, path): ``name=path``, a JSON object with ``name``
    and ``path``, or such a mapping; ``SettingsError`` naming the flag and the entry otherwise."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except ValueError as exc:
            raise SettingsError(f"--lora-modules: {item!r} is not valid JSON ({exc})") from None
    if isinstance(item, dict):
        name, path = item.get("name"), item.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise SettingsError(f"--lora-modules: {json.dumps(item)} needs a non-empty \"name\" and \"path\"")
        return name, path
    if not isinstance(item, str) or "=" not in item:
        raise SettingsError(f"--lora-modules: {item!r} is not name=path nor {{\"name\": ..., \"path\": ...}}")
    name, path = (part.strip() for part in item.split("=", 1))
    if not name or not path:
        raise SettingsError(f"--lora-modules: {item!r} needs a name before '=' and a path after it")
    return name, path


def lora_config(enable_lora: bool, lora_modules: tuple[str, ...] | None, max_loras: int, max_lora_rank: int):
    """The engine's ``LoRAConfig`` (None without ``--enable-lora``). ``SettingsError`` naming the
    flag for modules without ``--enable-lora``, a malformed entry, a name given twice, or a path
    that is not a directory (each path made absolute: workers start where Ray puts them)."""
    from pdserve.engine.config import LoRAConfig

    if not enable_lora:
        if lora_modules:
            raise SettingsError("--lora-modules needs --enable-lora (or PDSERVE_ENABLE_LORA=1)")
        return None
    modules = [parse_module(item) for item in lora_modules or ()]
    names = [name for name, _ in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SettingsError(f"--lora-modules: name(s) {', '.join(map(repr, twice))} given more than once")
    for name, path in modules:
        if not Path(path).is_dir():
            raise SettingsError(f"--lora-modules: {name}={path}: {path!r} is not a directory (a PEFT adapter's, "
                                "with adapter_config.json)")
    return LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                      modules=tuple((name, str(Path(path).resolve())) for name, path in modules))

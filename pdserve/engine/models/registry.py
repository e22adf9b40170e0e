"""The list of model families: every module (or package) in pdserve/engine/models that
declares ``FAMILY``. Nothing else lists families: the engine, the planner and the docs ask here,
so a new family is one new file.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any, Hashable, Mapping

from pdserve.engine import models
from pdserve.engine.config import ModelConfig, config_getter
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.family import Family
from pdserve.engine.parallel import SINGLE, TensorParallel


@functools.cache
def families() -> dict[str, Family]:
    """Every family, by each ``model_type`` it reads."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{models.__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            for model_type in family.model_types:
                if model_type in found:
                    raise RuntimeError(f"model_type {model_type!r} is claimed by two families ({info.name})")
                found[model_type] = family
    return found


def supported_architectures() -> list[str]:
    """Every ``architectures`` name a checkpoint may declare, sorted."""
    return sorted({arch for family in families().values() for arch in family.architectures})


def model_config_from_hf(hf: Any, source: str) -> ModelConfig:
    """Read a ``transformers`` config (object or dict) with its family's reader. ``source`` is
    the path it came from; it names the model in errors."""
    get = config_getter(hf)
    family = families().get(get("model_type"))
    if family is None:
        raise ModelLoadError(source, f"unsupported architecture {get('architectures') or get('model_type')!r}; "
                                     f"supported: {supported_architectures()}")
    return family.read_config(get, source)


def published_configs() -> dict[str, Mapping[str, Any]]:
    """Every family's well-known checkpoints (``Family.published``): name -> config.json."""
    found: dict[str, Mapping[str, Any]] = {}
    for family in {id(f): f for f in families().values()}.values():
        for name, config in family.published.items():
            if name in found:
                raise RuntimeError(f"checkpoint name {name!r} is published by two families")
            found[name] = config
    return found


def build_model(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> CausalLM:
    """An unfilled model of ``cfg``'s family holding ``tp``'s share (build it on the meta
    device, then load a checkpoint into it)."""
    return families()[cfg.model_type].model(cfg, tp)


def check_split(cfg: ModelConfig, size: int) -> None:
    """Raise ``ShardError`` (naming the field and ``size``) unless ``size`` tensor-parallel
    ranks split this model evenly: the layers themselves say so, built on the meta device.

    Layers of one kind (``CausalLM.layer_kind``) split alike, so one of each is built, with
    everything around them: DeepSeek-V3's 61 layers (58 of 256 experts each) are two, which
    takes about 0.1 s where the whole model took 8.6."""
    import torch

    model = families()[cfg.model_type].model
    kinds: dict[Hashable, int] = {}
    for index in range(cfg.num_layers):
        kinds.setdefault(model.layer_kind(cfg, index), index)
    with torch.device("meta"):
        model(cfg, TensorParallel(0, size), layer_indices=tuple(kinds.values()))

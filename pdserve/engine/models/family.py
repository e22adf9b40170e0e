"""What a model family declares, once, in its own module: ``FAMILY = Family(...)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pdserve.engine.config import Get, ModelConfig

if TYPE_CHECKING:
    from pdserve.engine.models.decoder import CausalLM


@dataclass(frozen=True)
class Family:
    """One model family: the checkpoints it reads and the model it builds from them."""

    architectures: tuple[str, ...]  # config.json "architectures" it serves...
    model_types: tuple[str, ...]  # ...and their "model_type"s, which pick the family
    model: type["CausalLM"]  # built at a tensor-parallel rank's sizes: model(cfg, tp[, layer_indices])
    # config.json -> ModelConfig: get(key, default) reads a field; ``source`` names the model in
    # a ModelLoadError, which names the field and what it may be.
    read_config: Callable[[Get, str], ModelConfig]
    # Well-known checkpoints of the family by name, each its published config.json (the fields
    # that shape the model): what the planner plans for by name (`pdserve plan --model NAME`).
    published: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

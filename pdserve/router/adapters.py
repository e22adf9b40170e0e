"""The LoRA adapters the router serves, by name: the cluster's table of them.

A request names its adapter as its ``model`` (OpenAI's body, or ``GenerateRequest.model``):
the base model's served names run the base model (``SamplingParams.lora_name`` ""), an
adapter's name runs that adapter, any other name is refused as vLLM refuses it (HTTP 404,
"The model `x` does not exist.", the field ``model``).

The table starts with ``--lora-modules`` and changes with ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``pdserve.router.lora_admin``, which also gives every worker the
adapters it lacks). It is the cluster's word on which adapters exist: a worker's own list only
says where one is loaded now (``WorkerStats.lora_names``, read by the routing preference,
``pdserve.router.policy.prefer_holders``). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str  # the PEFT directory, as every worker reads it (``/v1/models`` shows it as ``root``)


def unknown_model(model: str, served) -> str:
    """vLLM's refusal of a model name not served, followed by the names that are."""
    return f"The model `{model}` does not exist. Served: {', '.join(map(repr, served))}."


class UnknownModel(InvalidRequestError):
    """A request named a model or adapter this router does not serve (HTTP 404, gRPC NOT_FOUND,
    as vLLM and OpenAI answer it: not found, rather than bad input); ``field``: where it named
    it (``model``, or gRPC's ``sampling.lora_name``)."""

    def __init__(self, model: str, served: tuple[str, ...] = (), field: str = "model"):
        super().__init__(field, unknown_model(model, served))


class AdapterTable:
    """The adapters served now, in the order they were loaded. ``enabled``: the cluster runs
    with ``--enable-lora`` (without it, no adapter can be loaded); ``runtime_updates``: clients
    may load and unload adapters (``--allow-runtime-lora-updating``; without it the table is
    ``--lora-modules``' for the router's life)."""

    def __init__(self, enabled: bool = False, modules: tuple[tuple[str, str], ...] = (), runtime_updates: bool = False):
        self.enabled, self.runtime_updates = enabled, runtime_updates
        self._adapters: dict[str, Adapter] = {name: Adapter(name, path) for name, path in modules}

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def adapters(self) -> tuple[Adapter, ...]:
        return tuple(self._adapters.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def add(self, adapter: Adapter) -> None:
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> Adapter | None:
        return self._adapters.pop(name, None)

    def lora_name(self, model: str, base_names: tuple[str, ...]) -> str:
        """The ``SamplingParams.lora_name`` a request for ``model`` runs with: "" for no model
        or one of ``base_names``, the adapter's name for an adapter; ``UnknownModel`` else."""
        if not model or model in base_names:
            return ""
        if model in self._adapters:
            return model
        raise UnknownModel(model, (*base_names, *self._adapters))

"""The adapters an engine holds, and which of them sit in the device's slots.

Adapters are read once (``add``) and kept on the host, any number of them. At most
``max_loras`` are in device slots at once (every ``LoRALinear`` has slots 1..max_loras; slot 0
is the base model's zeros). Before each step the model runner names the step's adapters
(``begin_step``): those already in a slot stay there, the others take a free slot or the one
used least recently by a step (LRU). The scheduler never puts more than ``max_loras`` distinct
adapters in one step (``Scheduler``'s ``max_adapters``), so a step's adapters always fit.

An adapter is removed only while no request uses it: the engine refuses to remove one in use
(``LLMEngine.remove_lora``), rather than change a running stream's weights under it.

In a tensor-parallel worker this is rank 0's (``ranks``, its ``RankGroup``): each adapter gets
an id, every load and unload is handed on to the other ranks once it succeeds here, and each
step hands them its slot table and token slots (``step_lora``); their ``LoRAMirror``s
(lora/mirror.py) keep the same slots over their shares of the weights.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence

import torch

from pdserve.engine.config import LoRAConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.lora.kernels import select_kernel
from pdserve.engine.lora.layers import attach, target_shapes
from pdserve.engine.lora.mirror import StepLoRA
from pdserve.engine.lora.peft import LoRAAdapter, read_adapter


def fingerprint_of(manager: "LoRAManager | None", params) -> str:
    """The fingerprint of the adapter ``params`` (a ``SamplingParams``) names, as ``manager``
    holds it now: what its KV is keyed by (``kv_salt``). "" for the base model, and for an
    adapter not loaded here (such a request is refused before it is hashed)."""
    if not params.lora_name or manager is None or params.lora_name not in manager.adapters:
        return ""
    return manager.adapters[params.lora_name].fingerprint


def users_of(name: str, states) -> int:
    """How many of the request ``states`` (``RequestState``s) run adapter ``name``."""
    return sum(1 for state in states if state.seq.params.lora_name == name)


class LoRAManager:
    """The LoRA side of one engine's model (module docstring). Build it once, after loading:
    it wraps the model's linears (``layers.attach``)."""

    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device: torch.device, ranks=None):
        """``ranks``: the other ranks of a tensor-parallel worker (a ``RankGroup``; None at size 1)."""
        self.config, self.device, self._ranks = config, device, ranks
        self._checkpoint_target = model.checkpoint_target
        self._shapes = {name: shape for name, (shape, _) in target_shapes(model).items()}
        if not self._shapes:
            raise ValueError(f"{type(model).__name__}: no linear LoRA can adapt (pdserve adapts Llama-shaped "
                             "q|k|v, o, gate|up and down projections)")
        self.kernel = select_kernel(device, model.linear_backend)
        self.state, self.layers = attach(model, config.max_loras + 1, config.max_lora_rank, self.kernel, dtype,
                                         device)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapters in device slots, least recently used first
        self.ids: dict[str, int] = {}  # each adapter's id, as the other ranks know it
        self._next_id = 1
        for name, path in config.modules:
            self.add(name, path)

    @staticmethod
    def of(manager: "LoRAManager | None") -> "LoRAManager":
        """``manager``, or the refusal of an engine built without a LoRAConfig."""
        if manager is None:
            raise InvalidRequestError("lora_name", "this engine has no LoRAConfig: LoRA adapters are off")
        return manager

    # ---- adapters on the host ------------------------------------------------------
    def add(self, name: str, path: str) -> None:
        """Read the adapter at ``path`` under ``name``; ``InvalidRequestError`` naming
        ``lora_name`` (empty, or in use) or ``lora_path`` (peft.py's refusals)."""
        if not name:
            raise InvalidRequestError("lora_name", "must not be empty (the empty name is the base model)")
        if name in self.adapters:
            raise InvalidRequestError("lora_name", f"{name!r} is already loaded; remove it first")
        adapter = read_adapter(name, path, self.config.max_lora_rank, self._shapes, self._checkpoint_target)
        self.adapters[name], self.ids[name] = adapter, self._next_id
        self._next_id += 1
        if self._ranks is not None:  # the other ranks read it where this one did
            self._ranks.lora_load(self.ids[name], os.path.abspath(adapter.path))

    def remove(self, name: str, users: int = 0) -> bool:
        """Forget ``name`` and free its slot; False if it is not loaded. ``users``: the requests
        that use it now; any, and the removal is refused (``InvalidRequestError`` naming
        ``lora_name``): their streams keep the weights they started with."""
        if users and name in self.adapters:
            raise InvalidRequestError("lora_name", f"{name!r} is in use by {users} requests")
        if self.adapters.pop(name, None) is None:
            return False
        adapter_id = self.ids.pop(name)
        slot = self.slots.pop(name, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear(slot)
        if self._ranks is not None:
            self._ranks.lora_unload(adapter_id)
        return True

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def fingerprints(self) -> dict[str, str]:
        """Each loaded adapter's fingerprint (its content identity, peft.py), by name."""
        return {name: adapter.fingerprint for name, adapter in self.adapters.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    # ---- the step's slots ----------------------------------------------------------
    def begin_step(self, names: Sequence[str], counts: Sequence[int]) -> None:
        """Set the step's token slots: ``names[i]`` ("" for the base model) for ``counts[i]``
        tokens, in the step's token order. No adapter: the layers run as without LoRA."""
        if not any(names):
            self.state.set(None)
            return
        slot_of = self._place({n for n in names if n})
        slots = [slot_of.get(n, 0) for n in names]
        self.state.set(torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), torch.tensor(counts))
                       .to(self.device, non_blocking=True))

    def end_step(self) -> None:
        self.state.set(None)

    def step_lora(self) -> StepLoRA | None:
        """The step's adapters as the other ranks take them: the id in each slot 1..max_loras
        (0: empty) and each token's slot; None when no token of the step uses an adapter."""
        if not self.state.active:
            return None
        table = [0] * self.config.max_loras
        for name, slot in self.slots.items():
            table[slot - 1] = self.ids[name]
        return StepLoRA(torch.tensor(table, dtype=torch.long), self.state.slots)

    def _place(self, wanted: set[str]) -> dict[str, int]:
        """Slots for every adapter of ``wanted`` (at most max_loras), loading those not in one."""
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step uses {len(wanted)} adapters; max_loras is {self.config.max_loras}")
        for name in wanted & self.slots.keys():
            self.slots.move_to_end(name)
        for name in sorted(wanted - self.slots.keys()):
            taken = set(self.slots.values())
            free = [s for s in range(1, self.config.max_loras + 1) if s not in taken]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter that this step does not use
                victim = next(n for n in self.slots if n not in wanted)
                slot = self.slots.pop(victim)
            for module, layer in self.layers.items():
                layer.fill(slot, self.adapters[name], module)
            self.slots[name] = slot
        return {name: self.slots[name] for name in wanted}

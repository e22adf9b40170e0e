"""The LoRA side of a tensor-parallel rank other than 0: rank 0's adapters and slots, mirrored.

Rank 0's ``LoRAManager`` decides everything: which adapters are loaded (each under an id it
gives), which sits in which device slot, each token's slot. A follower rank
(pdserve/engine/distributed/follower.py) learns it from rank 0's messages
(pdserve/engine/distributed/step.py) and keeps the same state over its own share of the model:

- an adapter loaded: read from the same directory (the ranks share a host), kept whole on the
  host as rank 0 keeps it; a slot filled with it takes this rank's share (lora/layers.py);
- an adapter unloaded: forgotten, and its slot cleared;
- a step with adapters: its slot table says which adapter each slot holds on rank 0; a slot
  holding another here is filled (or cleared) first, then the tokens' slots are set.

A step's table is rank 0's whole word on the slots, so the ranks agree whatever order rank 0
filled them in. An adapter that rank 0 read but this rank cannot (the directory changed in
between) raises: the ranks would compute different models, so the rank ends, and with it the
worker (pdserve/engine/distributed/group.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.lora.kernels import select_kernel
from pdserve.engine.lora.layers import attach, target_shapes
from pdserve.engine.lora.peft import LoRAAdapter, read_adapter


@dataclass(frozen=True)
class StepLoRA:
    """What rank 0 hands the other ranks with a step whose tokens use adapters: ``table`` (L,)
    the adapter id in each of slots 1..L (0: empty), ``slots`` (T,) each token's slot (0: the
    base model), both int64."""

    table: torch.Tensor
    slots: torch.Tensor


class LoRAMirror:
    """A follower rank's adapters and slots (module docstring); built once, after loading, with
    rank 0's ``max_loras`` and ``max_lora_rank``: it wraps this rank's linears as rank 0's."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_lora_rank = max_lora_rank
        self._checkpoint_target = model.checkpoint_target
        self._shapes = {name: shape for name, (shape, _) in target_shapes(model).items()}
        self.state, self.layers = attach(model, max_loras + 1, max_lora_rank, select_kernel(device, model.linear_backend),
                                         dtype, device)
        self.adapters: dict[int, LoRAAdapter] = {}  # by rank 0's id
        self.held = [0] * (max_loras + 1)  # the adapter id in each slot (0: empty; slot 0 is the base model's)

    def load(self, adapter_id: int, path: str) -> None:
        self.adapters[adapter_id] = read_adapter(str(adapter_id), path, self.max_lora_rank, self._shapes,
                                                 self._checkpoint_target)

    def unload(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        for slot, held in enumerate(self.held):
            if held == adapter_id:
                self._put(slot, 0)

    def begin_step(self, step: StepLoRA | None) -> None:
        """Take rank 0's slots for the step (None: no token uses an adapter)."""
        if step is None:
            self.state.set(None)
            return
        for slot, adapter_id in enumerate(step.table.tolist(), start=1):
            if self.held[slot] != adapter_id:
                self._put(slot, adapter_id)
        self.state.set(step.slots)

    def _put(self, slot: int, adapter_id: int) -> None:
        for module, layer in self.layers.items():
            if adapter_id:
                layer.fill(slot, self.adapters[adapter_id], module)
            else:
                layer.clear(slot)
        self.held[slot] = adapter_id

"""Copying a ``transformers``-named checkpoint into a model whose projections are fused and
split over tensor-parallel ranks.

A family says, per checkpoint tensor, where it goes (a ``Target``); ``load_weights`` cuts the
tensor to the rank's share and copies it there. The model is built at the rank's sizes, so
a shape that still disagrees is a checkpoint that does not fit the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from pdserve.engine.parallel import TensorParallel


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes."""

    name: str  # our parameter
    offset: int | None = None  # first row inside a fused parameter (q|k|v, gate|up), at this rank's sizes
    shard_dim: int | None = None  # the tensor's dimension split over the ranks (0: column-, 1: row-parallel)


@torch.no_grad()
def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor],
                 target_of: Callable[[str], Target | None], tp: TensorParallel) -> list[str]:
    """Copy ``weights`` into ``model``'s parameters; returns the names of parameters that
    received nothing (empty when complete). A tensor ``target_of`` maps to None, or to a
    parameter the model does not have, is skipped; a shape mismatch raises ValueError naming
    the tensor."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for hf_name, tensor in weights.items():
        target = target_of(hf_name)
        if target is None or target.name not in params:
            continue
        if target.shard_dim is not None:
            tensor = tp.narrow(tensor, target.shard_dim, hf_name)
        param = params[target.name].data
        dst = param if target.offset is None else param[target.offset:target.offset + tensor.shape[0]]
        if dst.shape != tensor.shape:
            raise ValueError(f"tensor {hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        filled.add(target.name)
    return [n for n in params if n not in filled]

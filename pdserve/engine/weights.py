"""Filling a model from a checkpoint: one loop over the checkpoint's tensors.

The model says where each checkpoint name goes (``checkpoint_target``: a parameter, and which
part of it when the parameter fuses several checkpoint tensors); the module that owns the
parameter reads its own share (``load_weight``, pdserve/engine/layers/linear.py). A module
without ``load_weight`` (a norm, a replicated linear, the embedding) takes the whole tensor.
The model is built at the rank's sizes, so a shape that still disagrees is a checkpoint that
does not fit the config.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from pdserve.engine.checkpoint import CheckpointTensor, Fp8Tensor, copy_checked
from pdserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear


@torch.no_grad()
def load_checkpoint(model: nn.Module, tensors: Iterable[CheckpointTensor],
                    progress: Callable[[int], None] | None = None) -> list[str]:
    """Copy ``tensors`` into ``model`` (which has ``checkpoint_target``); returns the names of
    parameters that received nothing (empty when complete). Raises ValueError on a shape
    mismatch or on a checkpoint tensor the model has no place for, naming the tensor: a tensor
    dropped without a word (a quantization scale, say) would serve wrong tokens.
    ``progress(bytes)`` is called after each tensor."""
    params = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if b is not None)
    filled: set[str] = set()
    for tensor in tensors:
        target = model.checkpoint_target(tensor.name)
        if target is not None:
            name, shard = target
            if name not in params:
                raise ValueError(f"tensor {tensor.name}: the model has no parameter {name} for it")
            owner, _, local = name.rpartition(".")
            module = model.get_submodule(owner)
            loader = getattr(module, "load_weight", None)
            if loader is not None:
                loader(local, tensor, shard)
            elif shard is not None:
                raise ValueError(f"tensor {tensor.name}: {owner} takes no part {shard!r} of a fused parameter")
            else:
                copy_checked(params[name].data, tensor.read(), tensor.name)
            filled.add(name)
        if progress is not None:
            progress(tensor.nbytes)
    return [n for n, _ in model.named_parameters() if n not in filled]


def keep_fp8(model: nn.Module, tensors: Iterable[CheckpointTensor], fits: Callable[[nn.Linear], bool]) -> list[str]:
    """Before the model is allocated (on the meta device): make float8 (e4m3) the weight of each
    tensor-parallel linear whose every checkpoint weight is float8 with a per-tensor or per-row
    scale (``Fp8Tensor.keepable``; q, k and v all, for a fused q|k|v) and that ``fits`` (the
    backend's FP8 matmul takes its shape), with a float32 ``weight_scale`` per output row beside
    it; the linear then loads the float8 values as they are (``layers.linear.fill``). Returns
    the names of the linears made so. Every other weight is dequantized as it loads: block-wise
    scales, e5m2, and float8 tensors outside those linears (an MoE's experts)."""
    keepable: dict[str, bool] = {}
    for tensor in tensors:
        target = model.checkpoint_target(tensor.name)
        if target is None or not target[0].endswith(".weight"):
            continue
        owner = target[0].rpartition(".")[0]
        ok = isinstance(tensor, Fp8Tensor) and tensor.keepable
        keepable[owner] = keepable.get(owner, True) and ok
    kept = []
    for owner, ok in keepable.items():
        module = model.get_submodule(owner)
        if not ok or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or not fits(module):
            continue
        weight = module.weight
        module.weight = nn.Parameter(torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device),
                                     requires_grad=False)
        module.register_buffer("weight_scale", torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device))
        kept.append(owner)
    return kept

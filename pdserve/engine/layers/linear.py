"""Linears split over tensor-parallel ranks, each loading its own share of a checkpoint tensor.

Megatron's split, and the only place in pdserve that does the arithmetic:
- ``ColumnParallelLinear``: output rows split; each rank computes its slice of the output.
- ``MergedColumnParallelLinear``: several column-parallel outputs stacked in one matmul
  (gate|up); checkpoints hold them apart (``shard`` 0, 1, ...) or already fused.
- ``QKVParallelLinear``: q|k|v in one matmul, split by head so every rank keeps the model's
  GQA ratio; checkpoints hold q, k, v apart (``shard`` "q", "k", "v") or fused (Phi-3).
- ``RowParallelLinear``: input columns split; each rank's output is a partial sum that the
  caller completes with ``TensorParallel.all_reduce``.

Each is an ``nn.Linear`` at this rank's sizes, so it computes as one and a linear backend
(pdserve/engine/linear.py) swaps it like any other. ``load_weight(param_name, tensor, shard)``
reads only this rank's rows or columns from a ``CheckpointTensor`` (pdserve/engine/checkpoint.py):
a rank never holds another rank's share, on the host or on the device.

A linear whose weight was made float8 before loading (``weights.keep_fp8``: the backend
computes with FP8 matmuls) takes the checkpoint's float8 values as they are and each output
row's scale into its ``weight_scale`` (N,) buffer, instead of dequantized values.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pdserve.engine.checkpoint import CheckpointTensor, Fp8Tensor, copy_checked
from pdserve.engine.parallel import SINGLE, TensorParallel


def fill(layer: nn.Linear, dst: torch.Tensor, tensor: CheckpointTensor, dim: int, start: int, length: int,
         rows: slice) -> None:
    """Copy ``length`` entries of ``tensor`` from ``start`` along ``dim`` into ``dst``, the
    weight's output rows ``rows``; into a float8 weight, the float8 values and those rows'
    scales (module docstring)."""
    if dst.dtype != torch.float8_e4m3fn:
        copy_checked(dst, tensor.read(dim, start, length), tensor.name)
        return
    if not isinstance(tensor, Fp8Tensor) or not tensor.keepable:
        raise ValueError(f"tensor {tensor.name}: {layer.__class__.__name__} keeps float8 weights, and this one is "
                         "not an e4m3 weight with a per-tensor or per-row scale")
    copy_checked(dst, tensor.read_e4m3(dim, start, length), tensor.name)
    scales = tensor.row_scales(start, length) if dim == 0 else tensor.row_scales()
    copy_checked(layer.weight_scale[rows], scales, tensor.name + "_scale")


class ColumnParallelLinear(nn.Linear):
    """``out_features`` rows split evenly over the ranks; ``what`` names them in a ``ShardError``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 what: str = "out_features"):
        super().__init__(in_features, tp.share(out_features, what), bias=bias)
        self.tp = tp

    def load_weight(self, name: str, tensor: CheckpointTensor, shard=None) -> None:
        """This rank's rows of the checkpoint's whole weight (or bias)."""
        dst = getattr(self, name).data
        rows = dst.shape[0]
        fill(self, dst, tensor, 0, self.tp.rank * rows, rows, slice(0, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Outputs of ``output_sizes`` (whole-model sizes) stacked: [part 0 | part 1 | ...], each
    split over the ranks on its own, so a rank holds its slice of every part."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TensorParallel = SINGLE,
                 what: str = "intermediate_size"):
        self.local_sizes = [tp.share(n, what) for n in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp, what)
        self.output_sizes = list(output_sizes)

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: int | None = None) -> None:
        """Part ``shard`` from its own checkpoint tensor, or every part from a fused one."""
        parts = range(len(self.local_sizes)) if shard is None else (shard,)
        for part in parts:
            base = sum(self.output_sizes[:part]) if shard is None else 0  # where the part starts in ``tensor``
            self._load_part(getattr(self, name).data, tensor, part, base)

    def _load_part(self, dst: torch.Tensor, tensor: CheckpointTensor, part: int, base: int) -> None:
        rows = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        fill(self, dst[offset:offset + rows], tensor, 0, base + self.tp.rank * rows, rows, slice(offset, offset + rows))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q|k|v of ``num_heads`` query and ``num_kv_heads`` key/value heads of ``head_dim``, split
    by head: this rank's q heads, then its KV heads' k, then their v."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel = SINGLE):
        self.num_heads = tp.share(num_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads = tp.share(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias, tp)

    def load_weight(self, name: str, tensor: CheckpointTensor, shard: str | None = None) -> None:
        super().load_weight(name, tensor, None if shard is None else self.SHARDS[shard])


class RowParallelLinear(nn.Linear):
    """``in_features`` columns split over the ranks; the output is this rank's partial sum.

    ``f32_partials``: where the caller all-reduces the output straight away (o_proj, a dense
    down_proj), a linear backend may hand the partial sums on in float32 at TP > 1, so that the
    sum is rounded once (pdserve/engine/linear.py). An expert's, summed with others first, stays
    in the model dtype. A bias is added once: rank 0 holds it, the other ranks hold zeros.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 what: str = "in_features", f32_partials: bool = True):
        super().__init__(tp.share(in_features, what), out_features, bias=bias)
        self.tp, self.f32_partials = tp, f32_partials

    def load_weight(self, name: str, tensor: CheckpointTensor, shard=None) -> None:
        dst = getattr(self, name).data
        if name == "bias":
            src = tensor.read() if self.tp.rank == 0 else torch.zeros(tuple(tensor.shape), dtype=dst.dtype)
            copy_checked(dst, src, tensor.name)
            return
        cols = dst.shape[1]
        fill(self, dst, tensor, 1, self.tp.rank * cols, cols, slice(None))

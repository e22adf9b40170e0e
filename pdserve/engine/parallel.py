"""Tensor parallelism inside one worker: which share of each layer this process holds.

A worker with ``--tensor-parallel-size N`` runs N processes (ranks). Each rank holds 1/N of
every attention layer's heads and of every MLP's intermediate width (Megatron's split: the
q|k|v and gate|up projections are split by output rows, o_proj and down_proj by input
columns), and one all-reduce after o_proj and after down_proj sums the ranks' partial
outputs. The embedding and the LM head are split by vocabulary rows (layers/vocab.py): the
embedding's lookups are completed by one all-reduce, and the head's slices of the logits are
gathered to rank 0 (``gather``), which alone samples. Every model family is written against
``TensorParallel``: at size 1 every method is the identity, so a single-process engine pays
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class ShardError(ValueError):
    """A dimension that does not split evenly over the tensor-parallel ranks."""

    def __init__(self, what: str, n: int, size: int):
        super().__init__(f"{what} ({n}) is not divisible by tensor_parallel_size ({size})")
        self.what, self.n, self.size = what, n, size


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its worker's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup, when size > 1

    def share(self, n: int, what: str) -> int:
        """This rank's part of ``n`` (heads, rows, experts); ``what`` names it in the error."""
        if n % self.size:
            raise ShardError(what, n, self.size)
        return n // self.size

    def narrow(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim`` (a view)."""
        part = self.share(tensor.shape[dim], what)
        return tensor.narrow(dim, self.rank * part, part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; the identity at size 1. Every element is added
        in one fixed order whatever the tensor's length, so a row's sum does not depend on the
        batch: at two ranks any algorithm does that (a + b == b + a); beyond, a ring's order
        depends on where an element falls in the buffer, so the partial sums are gathered and
        added in rank order."""
        if self.size == 2:
            torch.distributed.all_reduce(x, group=self.group)
        elif self.size > 2:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.allgather([parts], [x]).wait()
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (each rank's of the same shape and dtype), in rank order, on rank
        0; None on the other ranks, which must call it too. ``[x]`` at size 1."""
        if self.size == 1:
            return [x]
        if x.is_cuda and isinstance(self.group, torch.distributed.ProcessGroupGloo):
            # Ranks sharing one GPU talk gloo, whose gather takes host tensors only; its
            # allgather takes CUDA ones (every rank receives every part; the others drop them).
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.allgather([parts], [x.contiguous()]).wait()
            return parts if self.rank == 0 else None
        opts = torch.distributed.GatherOptions()
        opts.rootRank = 0
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.group.gather(parts, [x.contiguous()], opts).wait()
        return parts[0] if self.rank == 0 else None


SINGLE = TensorParallel()

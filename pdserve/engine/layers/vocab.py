"""The token embedding and the LM head, split over tensor-parallel ranks by vocabulary rows.

Each rank holds one contiguous range of rows (``VocabShard``): the vocabulary is padded up to
a multiple of the ranks, so every rank holds the same number, and rank r holds rows
[r * rows, (r + 1) * rows). A vocabulary the ranks do not divide costs at most size - 1 rows
of zeros at the end, never a refusal. Megatron and vLLM split both layers this way.

- ``VocabParallelEmbedding``: each rank looks up the ids that fall in its range and writes
  zero rows for the others; one all-reduce (``TensorParallel.all_reduce``) adds the ranks'
  rows. Exact: each element is one rank's value plus zeros.
- ``ParallelLMHead``: each rank computes the logits of its range (``forward``); ``gather``
  brings the slices to rank 0 in rank order, the padding dropped: (N, vocab) there, None on
  the other ranks. Every rank calls both on the same rows (the follower ranks mirror rank 0's
  calls, pdserve/engine/distributed/). Tied to the embedding, the head computes over the
  embedding's shard: a rank holds its rows once.

Both read only their rows of the checkpoint tensor (``load_weight``). A linear backend
(pdserve/engine/linear.py) may hand the head a kernel over its rows (``use_kernel``). At size 1
the range is the whole vocabulary, the lookup ``F.embedding``, the logits ``F.linear`` (or
the kernel's) and the gather the identity: the unsplit model's computation, op for op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from pdserve.engine.checkpoint import CheckpointTensor, copy_checked
from pdserve.engine.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class VocabShard:
    """One rank's range of a ``vocab_size`` vocabulary split ``size`` ways: ``rows`` rows (the
    same on every rank, padding included) from row ``start``."""

    vocab_size: int
    size: int
    rank: int

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")

    @classmethod
    def of(cls, vocab_size: int, tp: TensorParallel) -> "VocabShard":
        return cls(vocab_size, tp.size, tp.rank)

    @property
    def rows(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def start(self) -> int:
        return self.rank * self.rows

    def real_rows(self, rank: int) -> int:
        """Rows of ``rank``'s range inside the vocabulary (the others are padding)."""
        return max(0, min(self.rows, self.vocab_size - rank * self.rows))


def load_rows(dst: torch.Tensor, tensor: CheckpointTensor, shard: VocabShard) -> None:
    """This rank's rows of a whole (vocab, hidden) checkpoint tensor into ``dst`` (rows, hidden),
    its padding rows zeroed; reads nothing of the other ranks' rows."""
    whole = (shard.vocab_size, dst.shape[1])
    if tuple(tensor.shape) != whole:
        raise ValueError(f"tensor {tensor.name}: shape {tuple(tensor.shape)}, expected {whole}")
    real = shard.real_rows(shard.rank)
    dst[real:].zero_()
    if real:
        copy_checked(dst[:real], tensor.read(0, shard.start, real), tensor.name)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the (vocab, hidden) embedding; ``forward`` is the whole lookup on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp, self.shard = tp, VocabShard.of(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))

    def load_weight(self, name: str, tensor: CheckpointTensor, shard=None) -> None:
        load_rows(self.weight.data, tensor, self.shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden), summed over the ranks."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.rows)  # another rank's ids
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)

    def extra_repr(self) -> str:
        s = self.shard
        return f"vocab={s.vocab_size}, rows=[{s.start}, {s.start + s.rows}), hidden={self.weight.shape[1]}"


class ParallelLMHead(nn.Module):
    """This rank's rows of the (vocab, hidden) LM head, or, ``tied``, the embedding's.

    The tied embedding is referenced, not registered as a submodule: its weight is loaded,
    counted and moved once, as the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.tied = tp, tied is not None
        if tied is None:
            self.shard = VocabShard.of(vocab_size, tp)
            self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))
        else:
            self.shard = tied.shard
            self.register_parameter("weight", None)
            object.__setattr__(self, "_embedding", tied)
        self.kernel: nn.Module | None = None

    def matrix(self) -> torch.Tensor:
        """The (rows, hidden) weight the logits are computed from (before ``use_kernel``)."""
        return self._embedding.weight if self.tied else self.weight

    def use_kernel(self, kernel: nn.Module) -> None:
        """Compute the logits with ``kernel`` (hidden (N, H) -> (N, rows)) from now on. An
        untied head's own weight is freed (the kernel holds its copy); a tied head's is the
        embedding's, which the lookups still need."""
        self.kernel = kernel
        if not self.tied:
            self.weight = None

    def load_weight(self, name: str, tensor: CheckpointTensor, shard=None) -> None:
        load_rows(self.weight.data, tensor, self.shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, H) -> this rank's logits (N, rows), in the weight's dtype (a kernel's own)."""
        if self.kernel is not None:
            return self.kernel(hidden)
        return F.linear(hidden, self.matrix())

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (N, rows) slice -> (N, vocab) on rank 0, the padding dropped; None on
        the other ranks. Every rank must call it, with the same N."""
        if self.tp.size == 1:
            return logits
        parts = self.tp.gather(logits)
        if parts is None:
            return None
        return torch.cat([p[:, :self.shard.real_rows(r)] for r, p in enumerate(parts)], dim=-1)

    def extra_repr(self) -> str:
        s = self.shard
        return f"vocab={s.vocab_size}, rows=[{s.start}, {s.start + s.rows}), tied={self.tied}"

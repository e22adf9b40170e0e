"""Mixture of experts: a gate picks k experts for each token, and the experts run grouped by expert.

The parts, for every family whose MoE is routed SiLU-gated experts (a family may bring its own
gate and add shared experts):

- a *gate* is any module ``x (T, hidden) -> (topk_weights (T, k) float32, topk_ids (T, k)
  int64)``. ``SoftmaxTopKGate`` is the common one (Mixtral's): a softmax over the experts'
  logits, the k largest, renormalized to sum to one when the checkpoint says
  ``norm_topk_prob``. Its linear is replicated on every rank: every rank routes every token.
- ``RoutedExperts(num_experts, hidden, intermediate, tp)`` holds the experts (``GatedMLP``s,
  named ``experts.<id>.*`` as checkpoints name them) and returns *this rank's partial sum*,
  before any all-reduce, so that a family with shared experts adds their partial output (a
  ``GatedMLP(..., reduce=False)``) and reduces once.
- ``SparseMoe(gate, experts, tp)``: gate, experts, and the one all-reduce.

How the experts compute: the (token, slot) pairs are sorted by expert id (stably), each
expert with tokens runs one matmul over exactly its tokens, and its weighted output is added
into those tokens' rows, experts in ascending id order, in float32. A token's output is then
the same sum of the same terms in the same order whatever else shares its batch: each linear
is row-invariant (on the CPU, pdserve's packed kernels, which ``linear.apply_backend`` swaps in
for the experts' ``nn.Linear`` like any other) and nothing reduces across rows. Batch
invariance in bfloat16 holds through the MoE as it does through a dense MLP.

Tensor parallelism splits each expert's intermediate width (Megatron's MLP split, per
expert): every rank holds every expert, 1/N of its gate|up rows and of its down columns, and
the one all-reduce after the MoE sums the ranks' partial outputs, as after a dense MLP.
Expert parallelism (whole experts per rank) would go in ``RoutedExperts``: a rank would hold
experts ``[r E/N, (r+1) E/N)`` at full width and run only the pairs routed to them; with every
rank seeing every token (as here) the same all-reduce still sums the result, and across nodes
an all-to-all would send each token only to the ranks of its experts instead.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.parallel import SINGLE, TensorParallel


class SoftmaxTopKGate(nn.Module):
    """Softmax routing: the k most probable experts of each token and their weights.

    As transformers computes it: logits in the model's dtype, softmax in float32, top k,
    optionally renormalized. The weights stay float32 (transformers rounds them to the model
    dtype, which in bfloat16 only adds error).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.proj = nn.Linear(hidden, num_experts, bias=False)  # checkpoints: mlp.gate.weight
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> weights (T, k) float32, expert ids (T, k) int64."""
        probs = torch.softmax(self.proj(x).float(), dim=-1)  # (T, E)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class RoutedExperts(nn.ModuleList):
    """The routed experts, each a ``GatedMLP`` sharded in width; indexed by expert id."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel = SINGLE):
        super().__init__(GatedMLP(hidden, intermediate, tp, reduce=False, what="moe_intermediate_size")
                         for _ in range(num_experts))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), weights/ids (T, k) -> (T, hidden) in x's dtype: this rank's part of
        sum_j weights[t, j] * expert[ids[t, j]](x[t]), not yet all-reduced."""
        k = ids.shape[1]
        flat = ids.flatten()  # (T k,) pair p is token p // k, slot p % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        tokens = order // k
        pair_weights = weights.flatten()[order].unsqueeze(1)  # (T k, 1) float32
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self, counts):
            if n:  # one matmul over exactly this expert's tokens; each token once per expert
                rows = tokens[start:start + n]
                out.index_add_(0, rows, expert(x[rows]).float() * pair_weights[start:start + n])
            start += n
        return out.to(x.dtype)


class SparseMoe(nn.Module):
    """A MoE block: the gate routes, the experts compute, one all-reduce sums the ranks."""

    def __init__(self, gate: nn.Module, experts: RoutedExperts, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate, self.experts, self.tp = gate, experts, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden)."""
        weights, ids = self.gate(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))

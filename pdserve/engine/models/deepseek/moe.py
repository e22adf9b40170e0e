"""DeepSeek's mixture of experts: its gates (V2's softmax, V3's sigmoid with a correction
bias), routed experts from layers/moe.py and the shared experts added before the one all-reduce.

Both gates are group-limited when the config says so: the experts are split into
``num_groups`` groups, a token keeps only its ``topk_groups`` best groups, and picks its
``top_k`` experts from those. Computed as ``transformers`` computes them, in float32:
- V2 (``softmax``): scores = softmax(logits); a group's score is its best expert's; experts
  outside the kept groups score 0; the weights are the chosen scores.
- V3 (``sigmoid``, DeepSeek's ``noaux_tc``): scores = sigmoid(logits); the *choice* uses
  scores + ``e_score_correction_bias`` (a per-expert bias trained to balance the load), a
  group's score being the sum of its two best; the weights are the chosen experts' plain
  scores, renormalised to sum to one when ``norm_topk_prob``.
Either way the weights are multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.moe import RoutedExperts
from pdserve.engine.models.deepseek.config import MoEConfig
from pdserve.engine.parallel import SINGLE, TensorParallel


class DeepseekGate(nn.Module):
    """x (T, hidden) -> (weights (T, k) float32, expert ids (T, k) int64), layers/moe.py's gate contract.

    Replicated on every rank (every rank routes every token). The logits are computed in
    float32 from the weight as loaded, as transformers does; the correction bias stays float32
    in a bfloat16 model (transformers keeps it so: ``_keep_in_fp32_modules_strict``).
    """

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))  # checkpoints: mlp.gate.weight
        bias = torch.zeros(moe.num_experts) if moe.scoring == "sigmoid" else None
        self.register_buffer("e_score_correction_bias", bias)

    def _apply(self, fn, recurse: bool = True):
        """Casting the model (``.to(bfloat16)``) casts the buffer too; put it back to float32
        (it is cast before the weights load, so nothing is rounded)."""
        super()._apply(fn, recurse)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        if self.moe.scoring == "softmax":
            weights, ids = self._softmax(logits)
        else:
            weights, ids = self._sigmoid(logits)
        return weights * self.moe.routed_scaling_factor, ids

    def _softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.moe.num_groups > 1:
            kept = self._kept_groups(scores.view(scores.shape[0], self.moe.num_groups, -1).max(dim=-1).values)
            scores = scores.masked_fill(~kept, 0.0)
        return torch.topk(scores, k=self.moe.top_k, dim=-1, sorted=False)

    def _sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(choice.shape[0], self.moe.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._kept_groups(groups), float("-inf"))
        ids = torch.topk(choice, k=self.moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids

    def _kept_groups(self, group_scores: torch.Tensor) -> torch.Tensor:
        """(T, G) group scores -> (T, E) bool: the experts in each token's ``topk_groups`` best groups."""
        best = torch.topk(group_scores, k=self.moe.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()  # (T, G)
        per_group = self.moe.num_experts // self.moe.num_groups
        return mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(group_scores.shape[0], -1)


class DeepseekMoe(nn.Module):
    """Routed experts plus shared experts; every part split in width across the ranks, and
    one all-reduce sums the ranks' partial outputs of both."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate = DeepseekGate(hidden, moe)
        self.experts = RoutedExperts(moe.num_experts, hidden, moe.intermediate_size, tp)
        self.shared_experts = None
        if moe.shared_intermediate_size:
            self.shared_experts = GatedMLP(hidden, moe.shared_intermediate_size, tp, reduce=False,
                                           what="moe_intermediate_size * n_shared_experts")
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden): transformers' ``experts(x) + shared_experts(x)``."""
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)

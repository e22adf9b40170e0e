"""The gated MLP every family here uses: ``down(act(gate(x)) * up(x))``, dense or as one expert."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.layers.activation import SiluAndMul
from pdserve.engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.engine.parallel import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` on this rank's share of the intermediate width.

    gate|up are fused (one matmul) and column-split, down is row-split; with ``reduce`` the
    ranks' partial outputs are all-reduced here (a dense MLP), without it the caller reduces
    (an expert, a shared expert). ``what`` names the width in a ``ShardError``; ``act`` is the
    gated activation (SiLU unless a family says otherwise).
    """

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE, reduce: bool = True,
                 what: str = "intermediate_size", act: nn.Module | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=False, tp=tp,
                                                       what=what)
        # Reduced here, its partial sums go to the all-reduce in float32 where a backend gives
        # them so (pdserve/engine/linear.py); an expert's stay in the model dtype.
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, tp=tp, what=what, f32_partials=reduce)
        self.act = SiluAndMul() if act is None else act
        self.tp = tp if reduce else SINGLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden): the whole output, or this rank's part without ``reduce``."""
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x)))).to(x.dtype)

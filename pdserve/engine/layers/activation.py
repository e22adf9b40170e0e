"""Gated activations: (T, 2I) gate|up in, (T, I) out."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class SiluAndMul(nn.Module):
    """(T, 2I) gate|up -> (T, I) silu(gate) * up, as transformers computes it; a linear
    backend may swap it for a fused kernel (pdserve/engine/linear.py)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

"""RMSNorm as ``transformers`` computes it for Llama-family models: in float32, rounded to the
input's dtype before the weight multiplies it. A linear backend may swap it for a fused kernel
(pdserve/engine/linear.py); a family whose norm rounds elsewhere brings its own class."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, first ``x = x + residual`` (the layer's skip
        connection) and returns ``(norm(x), x)``, so a backend can fuse the add in."""
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

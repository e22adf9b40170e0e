"""Rotary position embeddings, computed exactly as ``transformers`` does for Llama.

The cos/sin table is built once in float32 (like HF's per-call computation, elementwise the
same products) and cast to the activation dtype at lookup, so results match bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with llama3 long-context scaling if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = int(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low_ff
    high_wavelen = old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`; short ones kept; the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds the RoPE tables; ``tables`` looks up the rows for a step's positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Mapping[str, Any] | None = None):
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        self.cos: torch.Tensor | None = None  # built on first use, on the device of the positions
        self.sin: torch.Tensor | None = None

    def refresh(self, device: torch.device) -> None:
        """(Re)build the float32 tables on ``device``. They are plain attributes, not buffers,
        so casting the model to bfloat16 never rounds them."""
        head_dim, max_positions, theta, scaling = self._spec
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # (P, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position, (T, 1, hd) in ``dtype``: looked up once per forward."""
        if self.cos is None or self.cos.device != positions.device:
            self.refresh(positions.device)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q (T, nh, hd), k (T, nkv, hd), cos/sin (T, 1, hd) -> rotated q, k."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

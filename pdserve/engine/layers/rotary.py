"""Rotary position embeddings, computed exactly as ``transformers`` does for Llama and DeepSeek.

The cos/sin table is built once in float32 (like HF's per-call computation, elementwise the
same products) and cast to the activation dtype at lookup, so results match bit for bit.
Scalings: ``llama3`` (Llama 3.1+), ``yarn`` (DeepSeek-V2/V3, whose real configs extend a
4k pretraining context 40 times; yarn also scales cos/sin by an attention factor) and
``linear`` (every frequency divided by ``factor``: Gemma 3's global layers, 8 in the 4B-27B). DeepSeek
rotates interleaved pairs (x0, x1), (x2, x3), ... instead of Llama's two halves:
``apply_rotary_interleaved`` (V3's layout) and ``apply_rotary_complex`` (V2's).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with llama3, yarn or linear long-context scaling
    if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if _rope_type(scaling) == "linear":  # transformers' inv_freq /= factor, in float32
        return inv_freq / float(scaling["factor"])
    if _rope_type(scaling) == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, theta ** exponents, scaling)
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


def _rope_type(scaling: Mapping[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def _yarn_inverse_frequencies(dim: int, base: float, pos_freqs: torch.Tensor,
                              scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): high frequencies kept, low ones divided by ``factor``, a linear
    ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
    original context."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of each dimension's original frequency
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times longer (1 when not longer)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What cos and sin are multiplied by: yarn's ``attention_factor``, or the ratio of its two
    mscales (DeepSeek), or its own mscale; 1 for every other rope."""
    if scaling is None or _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


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
        cos, sin = emb.cos(), emb.sin()
        factor = attention_factor(scaling)
        if factor != 1.0:  # yarn: transformers scales the float32 tables before the cast
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(device)
        self.sin = sin.to(device)

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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's rotation of interleaved pairs: x (..., rd) with pairs (x0, x1), (x2, x3), ...,
    cos/sin (..., rd) as ``tables`` gives them -> (..., rd) with the pairs' first members
    rotated into the first half and their second into the second half (transformers'
    ``apply_rotary_pos_emb_interleave``; q and k get the same permutation, so q.k is unchanged)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rotary_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotation: each interleaved pair is a complex number multiplied by
    e^(i * angle) in float32, and stays in place (transformers' ``apply_rotary_emb``). x
    (..., rd); cos/sin (..., rd) float32 tables."""
    half = cos.shape[-1] // 2
    freqs = torch.complex(cos[..., :half].float(), sin[..., :half].float())
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)

"""Which attention backend a model runs on: ``select_backend`` turns the configured name
(``auto``, ``paged``, ``triton``, ``sdpa``, ``flash``, ``flash_invariant``) and the device into
one of base.py's, paged.py's, triton.py's or flash.py's
backends.

It is a module of its own because it imports every backend, and each backend imports the
interface in attention.py: kept there, the choice made a loop of the three files.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from pdserve.engine.attention.base import SdpaAttention
from pdserve.engine.attention.mla import select_latent_backend
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import TensorParallel

log = logging.getLogger(__name__)

BACKENDS = ("auto", "paged", "triton", "sdpa", "flash", "flash_invariant")

# flash-attn's kernels take only these (its ``q.dtype`` check); float32 on CUDA runs SDPA.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def triton_available(device: torch.device) -> bool:
    """Triton's kernels can run here: a CUDA device and the package (a dependency of torch's
    CUDA builds), found without importing it; ``_triton`` imports it, and says so if it fails."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def select_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, *, dtype: torch.dtype | None = None, scale: float | None = None):
    """``auto``: on CUDA the ``triton`` kernel when triton imports (every dtype; it reads the
    paged cache in place at any block size), else flash-attn when the package imports and
    ``dtype`` (the cache's and the activations') is float16 or bfloat16, SDPA otherwise; on
    CPU the ``paged`` kernel where the CPU has AVX2 + FMA, SDPA otherwise. ``flash`` stays
    there to be named (its prefill kernel, for long prompts). ``flash_invariant`` is
    flash-attn in its batch-invariant mode (flash.py). ``dtype`` None (a caller
    that does not say) never gets flash from ``auto``: a float32 model on flash fails at its
    first step. ``triton`` on the CPU runs in Triton's interpreter (tests only). ``scale``: the
    softmax scale, None for ``head_dim ** -0.5``."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "sdpa":
        return SdpaAttention(num_heads, num_kv_heads, head_dim, scale)
    if name == "paged" or (name == "auto" and device.type == "cpu"):
        return _paged_or_sdpa(name, device, num_heads, num_kv_heads, head_dim, scale)
    if name == "triton" or (name == "auto" and triton_available(device)):
        return _triton(device, num_heads, num_kv_heads, head_dim, scale)
    from pdserve.engine.attention.flash import FlashAttention, flash_available

    if name in ("flash", "flash_invariant") and dtype not in FLASH_DTYPES:
        raise ValueError(f"attention_backend={name} needs dtype float16 or bfloat16 (flash-attn's kernels), "
                         f"got {dtype}; use auto or sdpa for it")
    if flash_available(device) and dtype in FLASH_DTYPES:
        return FlashAttention(num_heads, num_kv_heads, head_dim, block_size, batch_invariant=name == "flash_invariant",
                              scale=scale)
    if name in ("flash", "flash_invariant"):
        raise ValueError(f"attention_backend={name} needs CUDA and the flash-attn package (pip install '.[gpu]')")
    return SdpaAttention(num_heads, num_kv_heads, head_dim, scale)


def _paged_or_sdpa(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                   scale: float | None):
    from pdserve.engine.attention.paged import PagedAttention, paged_available

    if paged_available(device) and head_dim % 8 == 0:
        try:
            return PagedAttention(num_heads, num_kv_heads, head_dim, scale)
        except Exception as exc:  # no compiler on this host: auto still serves, on SDPA
            if name == "paged":
                raise
            log.warning("paged attention kernel unavailable (%s); using SDPA", exc)
    if name == "paged":
        raise ValueError("attention_backend=paged needs an x86-64 CPU with AVX2 and FMA, the device cpu "
                         f"and head_dim a multiple of 8 (got device {device}, head_dim {head_dim})")
    return SdpaAttention(num_heads, num_kv_heads, head_dim, scale)


def _triton(device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None):
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention_backend=triton needs CUDA (or, for tests, the CPU under Triton's "
                         f"interpreter), got device {device}")
    try:
        from pdserve.engine.attention.triton import TritonAttention, interpreted
    except ImportError as exc:
        raise ValueError(f"attention_backend=triton needs the triton package ({exc})") from None
    if device.type == "cpu" and not interpreted():
        raise ValueError("attention_backend=triton on the CPU runs only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")
    return TritonAttention(num_heads, num_kv_heads, head_dim, scale)


def select_attention(name: str, cfg: ModelConfig, tp: TensorParallel, device: torch.device, block_size: int,
                     dtype: torch.dtype):
    """The attention backend of ``cfg``'s model on rank ``tp`` (its share of the heads): the
    latent one for MLA, else ``select_backend``'s at the model's softmax scale
    (``cfg.attention_scale``). Rank 0's runner and every follower rank
    (pdserve/engine/distributed/follower.py) pick theirs here."""
    if cfg.mla is not None:
        return select_latent_backend(name, cfg.mla)
    return select_backend(name, device, tp.share(cfg.num_heads, "num_attention_heads"),
                          tp.share(cfg.num_kv_heads, "num_key_value_heads"), cfg.head_dim, block_size, dtype=dtype,
                          scale=cfg.attention_scale)

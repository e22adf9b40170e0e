"""The worker's KV cache: one preallocated tensor, block-first and token-major inside a block.

Layout ``(num_blocks, block_size, num_layers, 2, num_kv_heads, head_dim)``:
- block-first: all of a block's KV (every layer, K and V) is one contiguous region, so
  moving a block between workers is one descriptor (NIXL), not one per layer and K/V;
- token-major inside the block: the first n tokens of a block are its first
  n * bytes_per_token bytes, so a prompt's partly filled last block moves only the tokens it
  holds, and a transfer is exactly prompt_tokens * bytes_per_token bytes.
Attention sees each layer through a strided view ``(num_blocks, block_size, num_kv_heads,
head_dim)``.

A model with multi-head latent attention (DeepSeek, ``ModelConfig.mla``) caches no per-head
K/V: ``LatentCacheSpec`` lays out ``(num_blocks, block_size, num_layers, kv_lora_rank +
qk_rope_head_dim)``, one latent and one RoPE key per token and layer, the same block-first,
token-major way, so the transfer layer moves its blocks unchanged (576 values a token and
layer in DeepSeek-V3, against 2 x 128 heads x 128 for per-head K/V). The latent has no head
axis: under tensor parallelism every rank holds the whole of it.

On CPU the cache lives on transparent huge pages where Linux offers them (``host_zeros``).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig

HUGE_PAGE_BYTES = 2 << 20


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.block_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        shape = (num_blocks, self.block_size, self.num_layers, 2, self.num_kv_heads, self.head_dim)
        return _zeros(shape, self.dtype, device)

    def layer_caches(self, cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views, what the model binds to its attention layers."""
        return [layer_views(cache, i) for i in range(self.num_layers)]


@dataclass(frozen=True)
class LatentCacheSpec:
    """The cache of a latent-attention model: ``latent_dim`` values a token and layer."""

    num_layers: int
    block_size: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.latent_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.block_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return _zeros((num_blocks, self.block_size, self.num_layers, self.latent_dim), self.dtype, device)

    def layer_caches(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's (num_blocks, block_size, latent_dim) view."""
        return [cache[:, :, i] for i in range(self.num_layers)]


CacheSpec = KVCacheSpec | LatentCacheSpec


def cache_spec_of(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> CacheSpec:
    """The cache layout ``cfg``'s attention needs: per-head K/V, or the latent for MLA."""
    if cfg.mla is not None:
        return LatentCacheSpec(cfg.num_layers, block_size, cfg.mla.latent_dim, dtype)
    return KVCacheSpec.of(cfg, block_size, dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor on transparent huge pages (2 MiB) where Linux has them.

    A peer reads a KV cache block by block through the kernel (UCX cross-memory attach, one
    ``process_vm_readv`` per block), which walks the pages it copies: on huge pages there are
    512 times fewer. Measured on this project's machine, NIXL reads ran about twice as fast
    (BENCHMARKS.md). Where the advice is missing (not Linux) or refused, or THP is off, the
    pages are ordinary 4 KiB ones and nothing else changes. The tensor keeps its mapping
    alive; the mapping is unmapped when the last view of it is gone.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Private anonymous memory: THP for shared memory is a separate, usually disabled, knob.
    # One huge page extra, so the tensor can start on a huge-page boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)  # before the first touch, so the faults take whole huge pages
    except OSError:
        pass  # a kernel without THP: ordinary pages
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    out = raw[start:start + nbytes].view(dtype).view(shape)
    out.zero_()  # fault every page in now, as torch.zeros would, not during the first requests
    return out


def layer_views(cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, each (num_blocks, block_size, num_kv_heads, head_dim)."""
    return cache[:, :, layer, 0], cache[:, :, layer, 1]

"""The worker's KV cache: one preallocated tensor, block-first and layer-major inside a block.

Layout ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``:
- block-first: all of a block's KV (every layer, K and V) is one contiguous region, so
  moving a block between workers is one descriptor (NIXL), not one per layer and K/V;
- layer-major inside the block: one layer's K (or V) for the block's ``block_size`` tokens is
  one contiguous run (6 KiB for the default model), so decode attention reads a sequence's
  keys in runs the hardware prefetcher follows. Token-major (a token's every layer together)
  put one layer's keys a whole token's KV (23 KiB) apart, and a decode step at batch 32 spent
  half its time in attention reading them (BENCHMARKS.md, "The KV block laid out layer by
  layer"). What that costs: a partly filled last block is no longer a prefix of the block's
  bytes, so a read moves it whole (``tail_bytes``), at most ``block_size - 1`` tokens more.
Attention sees each layer through a strided view ``(num_blocks, block_size, num_kv_heads,
head_dim)`` whose tokens are contiguous.

A model with multi-head latent attention (DeepSeek, ``ModelConfig.mla``) caches no per-head
K/V: ``LatentCacheSpec`` lays out ``(num_blocks, num_layers, block_size, kv_lora_rank +
qk_rope_head_dim)``, one latent and one RoPE key per token and layer, the same block-first,
layer-major way, so the transfer layer moves its blocks unchanged (576 values a token and
layer in DeepSeek-V3, against 2 x 128 heads x 128 for per-head K/V). The latent has no head
axis: under tensor parallelism every rank holds the whole of it.

On CPU the cache lives on transparent huge pages where Linux offers them (``host_zeros``).

In a tensor-parallel worker each rank's cache holds its share of the KV heads, in the same
layout (``KVCacheSpec.of`` with ``tp_size``), and a block id names the same block on every
rank. On CPU every rank's cache is a part of one shared-memory file (``shared_caches``), so
that rank 0, which alone speaks to peers, reaches every rank's blocks for a KV transfer.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.huge_pages import HUGE_PAGE_BYTES


class _BlockLayout:
    """What follows from a layout's ``block_shape`` and ``dtype``: sizes, budget, allocation."""

    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.block_shape) // self.block_size * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def tail_bytes(self, tokens: int) -> int:
        """Bytes of a block that a read moves for its first ``tokens`` tokens (a prompt's
        partly filled last block): all of them. Inside a layer-major block each layer's tokens
        are a run of their own, so the first tokens are not a prefix of the block; the bytes
        past them are whatever the holder's block held, and the reader's steps overwrite them
        before attention reads them. Holder and reader both call this, so the checksum covers
        exactly the bytes that move."""
        if not 0 < tokens <= self.block_size:
            raise ValueError(f"a block holds 1..{self.block_size} tokens, got {tokens}")
        return self.block_bytes

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.block_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return _zeros((num_blocks, *self.block_shape), self.dtype, device)


@dataclass(frozen=True)
class KVCacheSpec(_BlockLayout):
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> "KVCacheSpec":
        """One rank's cache when the worker has ``tp_size`` ranks (its share of the KV heads)."""
        return cls(cfg.num_layers, block_size, cfg.num_kv_heads // tp_size, cfg.head_dim, dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_caches(self, cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views, what the model binds to its attention layers."""
        return [layer_views(cache, i) for i in range(self.num_layers)]


@dataclass(frozen=True)
class LatentCacheSpec(_BlockLayout):
    """The cache of a latent-attention model: ``latent_dim`` values a token and layer."""

    num_layers: int
    block_size: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.block_size, self.latent_dim)

    def layer_caches(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's (num_blocks, block_size, latent_dim) view."""
        return [cache[:, i] for i in range(self.num_layers)]


CacheSpec = KVCacheSpec | LatentCacheSpec


def cache_spec_of(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> CacheSpec:
    """The cache layout ``cfg``'s attention needs on one of ``tp_size`` ranks: its share of the
    per-head K/V, or the whole latent for MLA (it has no head axis: every rank holds all of it)."""
    if cfg.mla is not None:
        return LatentCacheSpec(cfg.num_layers, block_size, cfg.mla.latent_dim, dtype)
    return KVCacheSpec.of(cfg, block_size, dtype, tp_size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def num_cache_blocks(config: EngineConfig, spec: CacheSpec) -> int:
    """Blocks in each rank's cache (``spec`` is one rank's): ``num_blocks``, or as many as the
    worker's exact memory budget holds, shared evenly by its ranks. A cache sized by
    ``gpu_memory_utilization`` is measured once the model is loaded (runner/memory_profile.py;
    at tensor_parallel_size > 1, distributed/memory_share.py): not known here."""
    if config.cache.num_blocks:
        return config.cache.num_blocks
    budget = config.cache.exact_budget_bytes()
    if budget is None:
        raise KVMemoryError("gpu_memory_utilization", "the KV cache's size is measured once the model is loaded: "
                            "it is not known before")
    return spec.blocks_for_budget(budget // config.tensor_parallel_size)


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


def shared_caches(spec: CacheSpec, num_blocks: int, ranks: int) -> tuple[torch.Tensor | None, int]:
    """The caches of a tensor-parallel worker's ``ranks`` ranks, one after another in one
    shared-memory file: ((ranks, num_blocks, *block_shape) tensor, the file's descriptor,
    which the other ranks map with ``map_caches``; ``num_blocks`` 0: an empty file and no tensor,
    sized once the ranks measured their use). Rank r's cache is ``[r]``, contiguous and
    laid out as a one-rank cache is; rank-major, so ``view(ranks * num_blocks, ...)`` is one
    block-first tensor whose row ``r * num_blocks + b`` is block b of rank r (what a transfer
    agent registers). The file's pages are zero; each rank touches its own first (``prefault``).

    Transparent huge pages for shared memory are a separate kernel knob (``shmem_enabled``),
    often off: then these are 4 KiB pages, where a private cache (``host_zeros``) gets 2 MiB."""
    fd = os.memfd_create("pdserve-kv-cache", os.MFD_CLOEXEC)
    if not num_blocks:  # sized later, once the ranks have measured their use (distributed/memory_share.py)
        return None, fd
    os.ftruncate(fd, ranks * num_blocks * spec.block_bytes)
    return map_caches(fd, spec, num_blocks, ranks), fd


def map_caches(fd: int, spec: CacheSpec, num_blocks: int, ranks: int) -> torch.Tensor:
    """Map the file ``shared_caches`` made: (ranks, num_blocks, *block_shape), shared."""
    region = mmap.mmap(fd, ranks * num_blocks * spec.block_bytes, flags=mmap.MAP_SHARED)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)  # huge pages where shmem_enabled allows them
        except OSError:
            pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    return raw.view(spec.dtype).view(ranks, num_blocks, *spec.block_shape)


def prefault(cache: torch.Tensor) -> None:
    """Touch every page of ``cache`` now (zeroing it), from the process that will use it: its
    first touch places the pages on that process's NUMA node, and the first requests take no
    page faults."""
    cache.zero_()


def layer_views(cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, each (num_blocks, block_size, num_kv_heads, head_dim)."""
    return cache[:, layer, 0], cache[:, layer, 1]

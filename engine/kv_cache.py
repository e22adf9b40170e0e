"""The worker's KV cache: one preallocated tensor, block-first and token-major inside a block.

Layout ``(num_blocks, block_size, num_layers, 2, num_kv_heads, head_dim)``:
- block-first: all of a block's KV (every layer, K and V) is one contiguous region, so
  moving a block between workers is one descriptor (NIXL), not one per layer and K/V;
- token-major inside the block: the first n tokens of a block are its first
  n * bytes_per_token bytes, so a prompt's partly filled last block moves only the tokens it
  holds, and a transfer is exactly prompt_tokens * bytes_per_token bytes.
Attention sees each layer through a strided view ``(num_blocks, block_size, num_kv_heads,
head_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


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
        return torch.zeros(shape, dtype=self.dtype, device=device)


def layer_views(cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, each (num_blocks, block_size, num_kv_heads, head_dim)."""
    return cache[:, :, layer, 0], cache[:, :, layer, 1]

"""The engine's KV blocks read token by token, for tests that compare what two caches hold, and
the bytes a read of a prompt moves."""

from __future__ import annotations

import torch


def by_token(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of a per-head K/V cache, ``(n, layers, 2, block_size, heads, head_dim)`` (layer-major,
    ``pdserve.engine.attention.kv_cache``), as ``(n * block_size, layers, 2, heads, head_dim)``: token
    by token, in the blocks' order."""
    return blocks.permute(0, 3, 1, 2, 4, 5).flatten(0, 1)


def moved_bytes(prompt_tokens: int, reused_tokens: int, bytes_per_token: int, block_size: int = 16) -> int:
    """What a decode worker reads for a prompt whose first ``reused_tokens`` (whole blocks) its own
    prefix cache held: every other block whole, the partly filled last one too
    (``CacheSpec.tail_bytes``)."""
    assert reused_tokens % block_size == 0, "the prefix cache reuses whole blocks"
    return (-(-prompt_tokens // block_size) * block_size - reused_tokens) * bytes_per_token

"""Byte layout of a block-first KV cache, as the transfer layer sees it.

The engine owns the cache tensor; all the transfer layer needs is where block ``i`` lives:
bytes ``[base + i * block_bytes, base + (i + 1) * block_bytes)``. Dtype and the shape beyond
dim 0 (layers, K/V, tokens, heads, head dim) do not matter here; a read by head moves whole
blocks and puts rows' slices in place (``pdserve.kv_transfer.staged``), whose shape
``pdserve.kv_transfer.sharding`` describes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.protos import kv_transfer_pb2

DRAM = kv_transfer_pb2.AgentMetadata.MEMORY_TYPE_DRAM
VRAM = kv_transfer_pb2.AgentMetadata.MEMORY_TYPE_VRAM


@dataclass(frozen=True)
class CacheLayout:
    """Where a cache's blocks are in memory; built once from the tensor with ``of``."""

    base_address: int
    block_bytes: int
    num_blocks: int
    memory_type: int  # AgentMetadata.MemoryType value (DRAM or VRAM)
    device_id: int  # CUDA ordinal for VRAM, 0 for DRAM (NIXL's convention)

    @classmethod
    def of(cls, cache: torch.Tensor) -> CacheLayout:
        """Describe ``cache``; raises InvalidTransferRequest (field ``cache``) if unusable."""
        if not isinstance(cache, torch.Tensor):
            raise InvalidTransferRequest(
                f"cache must be a torch.Tensor, got {type(cache).__name__}", field="cache")
        if cache.dim() < 1 or cache.shape[0] < 1 or cache.numel() == 0:
            raise InvalidTransferRequest(
                f"cache must have at least one non-empty block, got shape {tuple(cache.shape)}",
                field="cache", limit=1)
        if not cache.is_contiguous():
            # Block i must be one contiguous byte range for one descriptor per block.
            raise InvalidTransferRequest("cache must be contiguous (block-first layout)",
                                         field="cache")
        if cache.device.type not in ("cpu", "cuda"):
            raise InvalidTransferRequest(
                f"cache device must be cpu or cuda, got {cache.device}", field="cache")
        is_cuda = cache.device.type == "cuda"
        device_id = (cache.device.index or 0) if is_cuda else 0
        return cls(
            base_address=cache.data_ptr(),
            block_bytes=cache[0].numel() * cache.element_size(),
            num_blocks=cache.shape[0],
            memory_type=VRAM if is_cuda else DRAM,
            device_id=device_id,
        )

    @property
    def nixl_mem_type(self) -> str:
        """NIXL's name for this memory segment."""
        return "VRAM" if self.memory_type == VRAM else "DRAM"

    def block_table(self) -> np.ndarray:
        """One NIXL descriptor per block: (num_blocks, 3) uint64 rows (address, length, dev)."""
        table = np.empty((self.num_blocks, 3), dtype=np.uint64)
        table[:, 0] = self.base_address + np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(
            self.block_bytes)
        table[:, 1] = self.block_bytes
        table[:, 2] = self.device_id
        return table


    def block_descs(self, block_ids: Sequence[int], last_bytes: int) -> np.ndarray:
        """NIXL descriptors of ``block_ids``, in order, the last one its first ``last_bytes``
        bytes only: (blocks, 3) uint64 (address, length, dev)."""
        table = np.empty((len(block_ids), 3), dtype=np.uint64)
        table[:, 0] = self.base_address + np.asarray(block_ids, dtype=np.uint64) * np.uint64(self.block_bytes)
        table[:, 1] = self.block_bytes
        table[-1, 1] = last_bytes
        table[:, 2] = self.device_id
        return table


def layout_of_metadata(meta: kv_transfer_pb2.AgentMetadata) -> CacheLayout:
    """The peer's cache layout as announced in its metadata."""
    return CacheLayout(base_address=meta.base_address, block_bytes=meta.block_bytes,
                       num_blocks=meta.num_blocks, memory_type=meta.memory_type,
                       device_id=meta.device_id)


def block_bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """A (num_blocks, block_bytes) uint8 view sharing the cache's storage."""
    return cache.view(torch.uint8).reshape(cache.shape[0], -1)

"""Building an engine's ``KVTier`` from ``EngineConfig.kv_tier``: where its directory is, which
namespace inside it, and what the tier refuses.

Two engines may load each other's blocks only when a block's bytes mean the same to both: the
same model (its config and its weights), dtype, block size, cache block shape, and tensor-parallel
size and rank. The namespace subdirectory is a fingerprint of all of them. The weights are
fingerprinted by every parameter's name, shape, dtype and first bytes: two checkpoints of one
``config.json`` (a base model and its fine-tune) must never share KV, and reading every weight
would cost seconds on a large model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.kv_tier.store import HEADER
from pdserve.engine.kv_tier.tier import KVTier

DIR_NAME = "pdserve-kv-tier"
WEIGHT_SAMPLE_BYTES = 4096  # per parameter, into the fingerprint


def default_dir(device: torch.device) -> str:
    """Host memory next to a GPU (/dev/shm), the system's temporary directory on a CPU host."""
    if device.type == "cuda" and os.path.isdir("/dev/shm"):
        return os.path.join("/dev/shm", DIR_NAME)
    return os.path.join(tempfile.gettempdir(), DIR_NAME)


def namespace_of(model_cfg: ModelConfig, model: torch.nn.Module, dtype: torch.dtype, block_size: int,
                 block_shape: tuple[int, ...], tp_size: int = 1, rank: int = 0) -> str:
    """The fingerprint naming the directory of blocks this layout can read (module docstring)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((model_cfg, str(dtype), block_size, tuple(block_shape), tp_size, rank)).encode())
    for name, param in sorted(model.named_parameters()):
        flat = param.detach().reshape(-1)
        sample = flat[:max(1, WEIGHT_SAMPLE_BYTES // flat.element_size())].cpu()
        h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_kv_tier(config: EngineConfig, model: torch.nn.Module, model_cfg: ModelConfig, cache: torch.Tensor,
                  blocks: BlockManager) -> KVTier | None:
    """The tier of an engine of ``config`` (None without ``config.kv_tier``) over ``cache``
    ((num_blocks, *block_shape), rank 0's), attached to its block manager ``blocks``. Refused
    with a ``ValueError`` naming ``kv_offload_bytes`` where it cannot work yet: several
    tensor-parallel ranks (each holds a share of every block), no prefix cache (nothing would
    look a block up), or a bound smaller than one block's file."""
    tier_config = config.kv_tier
    if tier_config is None:
        return None
    tp_size = config.tensor_parallel_size
    if tp_size > 1:
        raise ValueError(f"kv_offload_bytes: the KV tier needs tensor_parallel_size 1, got {tp_size}")
    if not config.cache.enable_prefix_cache:
        raise ValueError("kv_offload_bytes: the KV tier needs the prefix cache (enable_prefix_cache is off)")
    block_bytes = cache[0].numel() * cache.element_size()
    smallest = HEADER.size + 16 + 8 * config.cache.block_size + block_bytes
    if tier_config.offload_bytes < smallest:
        raise ValueError(f"kv_offload_bytes must hold at least one block ({smallest} bytes), "
                         f"got {tier_config.offload_bytes}")
    root = tier_config.offload_dir or default_dir(cache.device)
    name = namespace_of(model_cfg, model, cache.dtype, config.cache.block_size, tuple(cache.shape[1:]), tp_size)
    tier = KVTier(cache, os.path.join(root, name), tier_config.offload_bytes)
    blocks.attach_tier(tier)
    return tier

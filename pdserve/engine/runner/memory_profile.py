"""The KV cache's size at start: ``num_blocks`` where a test sets it, the exact budget, or what
a worker's share of its device (``gpu_memory_utilization``, pdserve/engine/memory.py) leaves
after its weights and the profile step (pdserve/engine/profile_step.py: one forward as large as
the scheduler ever runs, run once the weights load and before the KV cache exists). A
tensor-parallel worker's ranks measure together as they load (distributed/memory_share.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from pdserve.engine.attention.kv_cache import CacheSpec, num_cache_blocks
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.device_turn import device_turn, turn_keys
from pdserve.engine.distributed.memory_share import measured_by_share
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.memory import (SETTING, CacheSize, MemoryProbe, check_free_at_start, kv_budget_for_share,
                                   probe_for, readable)
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.profile_step import ProfileStep, profile_use


def size_cache(model: CausalLM, cfg: ModelConfig, spec: CacheSpec, config: EngineConfig, max_model_len: int,
               probe: MemoryProbe | None, ranks=None) -> CacheSize:
    """The worker's KV cache: ``num_blocks`` where a test sets it, else the exact budget, else
    what ``gpu_memory_utilization`` leaves after the profile step on ``probe``'s device (None:
    read the model's device). ``ranks``: a tensor-parallel worker's ``RankGroup``, whose ranks
    measured their share together as they loaded (``cache_size``; distributed/memory_share.py)."""
    if ranks is not None and ranks.cache_size is not None:
        return ranks.cache_size
    cache, ranks = config.cache, config.tensor_parallel_size
    size = functools.partial(CacheSize, block_size=spec.block_size, block_bytes=spec.block_bytes, ranks=ranks,
                             max_model_len=max_model_len)
    if cache.num_blocks:
        return size(cache.num_blocks, source="num_blocks")
    exact = cache.exact_budget_bytes()
    if exact is not None:
        given = "exact size" if cache.memory_budget_bytes is not None else "the default size"
        return size(num_cache_blocks(config, spec), source=f"{given}, {readable(exact)}")
    probe = probe or probe_for(next(model.parameters()).device)
    share, total = cache.gpu_memory_utilization, probe.total_bytes()
    used = profile_use(model, cfg, spec, ProfileStep.of(config, max_model_len), probe)
    budget = kv_budget_for_share(share, total, used, probe.name)
    blocks = spec.blocks_for_budget(budget)
    if blocks < 1:
        raise KVMemoryError(SETTING, f"the {readable(budget)} left of {share:g} x {probe.name}'s "
                                     f"{readable(total)} holds no {spec.block_bytes}-byte KV block")
    return size(blocks, source=f"{SETTING} {share:g} of {probe.name}'s {readable(total)}, {readable(used)} used by "
                               f"weights and a {config.scheduler.max_num_batched_tokens}-token step")


@contextlib.contextmanager
def start_memory(config: EngineConfig, probe: MemoryProbe | None = None) -> Iterator[MemoryProbe | None]:
    """For the ``with`` block in which a worker loads and builds its engine: make its device the
    current one (``--device cuda:1``), take the device's turn to start (pdserve/engine/device_turn.py:
    another worker starting on it waits), and where ``gpu_memory_utilization`` sizes its cache,
    refuse a share the device cannot give now (``check_free_at_start``). Yields the probe the
    sizing reads (None: an exact cache). The other ranks of a tensor-parallel worker check their
    own devices as they start (distributed/memory_share.py)."""
    device = config.torch_device()
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # what code that asks for "cuda" (kernels, NIXL) then gets
    share = config.cache.gpu_memory_utilization
    measured = measured_by_share(config)
    with device_turn(turn_keys(device, config.tensor_parallel_size, measured)):
        if measured:
            probe = probe or probe_for(device)  # rank 0's, at tensor_parallel_size > 1
            check_free_at_start(share, probe.total_bytes(), probe.free_bytes(), probe.name)
        yield probe if measured else None

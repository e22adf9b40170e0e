"""A tensor-parallel worker's KV cache sized by a share of its memory (``gpu_memory_utilization``).

A worker of one rank measures its use in a profile step once its weights are loaded
(pdserve/engine/profile_step.py). At N ranks every rank loads its share of the model first, then
all of them run that profile step together (the same prompt tokens on each, so the collectives
inside the forward pair up), each reading the peak of its own process on its own device. One
all-gather hands every rank what each measured, (its peak use, its device's total), and every
rank computes the same block count from them (``agree_blocks``):

- Ranks on devices of their own (CUDA, a GPU per rank, NCCL between them): F is each rank's
  share of its own device. A rank's cache may take F x its device's total less that rank's own
  use; the worker's block count is the least of the ranks' (a block id names the same block on
  every rank, so every rank's cache has the same blocks), and the rank with the least room left
  decides. Each rank checked before it loaded that its device has F x total free.
- Ranks that share one memory (a CPU host, where they share its RAM; or CUDA ranks sharing one
  GPU over gloo, a test of the path on one device): F is the worker's share of that memory, for
  all its ranks together, as at one rank. The cache gets F x total less the sum of the ranks'
  peaks, split evenly: each rank's cache holds an N-th of it. (Ranks sharing a GPU each read the
  others' allocations during their start as theirs too, so the sum counts some memory twice:
  a smaller cache, never a larger one.)

Only then does any rank allocate its cache: on CUDA each its own; on CPU rank 0 gives the shared
file its size (``kv_cache.shared_caches`` made it empty, before the ranks started) and maps it,
then a barrier lets the others map their parts. The start-up log line says what the ranks
measured (``CacheSize.source``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pdserve.engine.attention.kv_cache import CacheSpec, cache_spec_of, map_caches, prefault
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.memory import SETTING, CacheSize, MemoryProbe, check_free_at_start, kv_budget_for_share, \
    probe_for, readable
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.profile_step import ProfileStep, profile_use


@dataclass(frozen=True)
class RankUse:
    """What one rank measured: its peak use over the profile step and its device's total (bytes)."""

    used: int
    total: int


def measured_by_share(config: EngineConfig) -> bool:
    """Whether ``config``'s cache is sized by a share, measured after the model loads."""
    return not config.cache.num_blocks and config.cache.exact_budget_bytes() is None


def shares_memory(device: torch.device, size: int) -> bool:
    """Whether ``size`` ranks on ``device`` share one memory: host RAM, or fewer GPUs than ranks
    (``group.rank_device`` then puts several ranks on one)."""
    return device.type != "cuda" or torch.cuda.device_count() < size


def agree_blocks(uses: list[RankUse], share: float, shared: bool, block_bytes: int, name: str) -> tuple[int, str]:
    """Every rank's block count from every rank's ``uses`` (``[r]`` rank r's), and what the
    log line says of it (module docstring). Refuses, naming the setting and the numbers, when a
    rank's share (or the shared memory's) is full before any block, or holds no block."""
    size = len(uses)
    if shared:
        used = sum(u.used for u in uses)
        budget = kv_budget_for_share(share, uses[0].total, used, f"{name} shared by {size} ranks") // size
        source = (f"{SETTING} {share:g} of {name}'s {readable(uses[0].total)} for {size} ranks together, "
                  f"{readable(used)} used by their weights and the profile step")
    else:
        budgets = [kv_budget_for_share(share, u.total, u.used, f"rank {r}'s {name}") for r, u in enumerate(uses)]
        budget = min(budgets)
        least = budgets.index(budget)
        source = (f"{SETTING} {share:g} of each rank's {name}, the least left on rank {least}: "
                  f"{readable(uses[least].total)}, {readable(uses[least].used)} used by its weights and the profile step")
    blocks = budget // block_bytes
    if blocks < 1:
        raise KVMemoryError(SETTING, f"the {readable(budget)} each rank's cache may take holds no {block_bytes}-byte "
                                     "KV block; raise --gpu-memory-utilization or size it with --kv-cache-memory")
    return blocks, source


def rank_probe(share: float, device: torch.device, size: int) -> MemoryProbe:
    """A rank's probe, made before its weights load. On a device of its own it checks that the
    device has its share free now (rank 0's was checked by ``start_memory``); on shared memory
    rank 0's check covered the worker's."""
    probe = probe_for(device)
    if not shares_memory(device, size):
        check_free_at_start(share, probe.total_bytes(), probe.free_bytes(), probe.name)
    return probe


def measure(group, model: CausalLM, cfg: ModelConfig, spec: CacheSpec, step: ProfileStep, share: float,
            probe: MemoryProbe, device: torch.device) -> tuple[int, str]:
    """This rank's part of the sizing, run by every rank at once: the profile step, the
    all-gather of what each measured, the agreed block count (``agree_blocks``)."""
    used = profile_use(model, cfg, spec, step, probe)
    mine = torch.tensor([used, probe.total_bytes()], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(group.size())]
    group.allgather([every], [mine]).wait()
    uses = [RankUse(*(int(v) for v in t.tolist())) for t in every]
    return agree_blocks(uses, share, shares_memory(device, group.size()), spec.block_bytes, probe.name)


def barrier(group, device: torch.device) -> None:
    """Every rank waits here for the others (rank 0 has sized the shared cache file first)."""
    group.allreduce([torch.zeros(1, device=device)]).wait()


def profile_step(config: EngineConfig, cfg: ModelConfig) -> ProfileStep:
    """The profile step of ``config``'s engine (its ``max_model_len`` as ``LLMEngine`` takes it)."""
    return ProfileStep.of(config, min(config.max_model_len or cfg.max_model_len, cfg.max_model_len))


def follower_fields(config: EngineConfig, cfg: ModelConfig) -> dict:
    """What a ``FollowerSpec`` carries of a cache sized by a share (nothing for an exact one)."""
    if not measured_by_share(config):
        return {}
    step = profile_step(config, cfg)
    return dict(memory_share=config.cache.gpu_memory_utilization, profile_tokens=step.num_tokens,
                profile_rows=step.max_rows, max_model_len=step.max_model_len)


def size_on_rank0(ranks, model: CausalLM, cfg: ModelConfig, config: EngineConfig,
                  probe: MemoryProbe | None) -> CacheSize:
    """Rank 0's part (the others run ``size_on_follower`` meanwhile): measure, agree, and on CPU
    give the shared cache file its size and map rank 0's part (``ranks.caches``). Returns the
    cache rank 0 logs. ``probe``: rank 0's, made before its weights loaded (``start_memory``)."""
    size, device = ranks.tp.size, next(model.parameters()).device
    spec = cache_spec_of(cfg, config.cache.block_size, config.torch_dtype(), size)
    step = profile_step(config, cfg)
    blocks, source = measure(ranks.tp.group, model, cfg, spec, step, config.cache.gpu_memory_utilization,
                             probe or probe_for(device), device)
    if ranks.cache_fd >= 0:  # CPU: the shared file, empty until now
        os.ftruncate(ranks.cache_fd, size * blocks * spec.block_bytes)
        ranks.caches = map_caches(ranks.cache_fd, spec, blocks, size)
        os.close(ranks.cache_fd)
        ranks.cache_fd = -1
        prefault(ranks.caches[0])
    barrier(ranks.tp.group, device)
    return CacheSize(blocks, spec.block_size, spec.block_bytes, size, step.max_model_len, source)


def size_on_follower(spec, group, model: CausalLM, cfg: ModelConfig, probe: MemoryProbe, device: torch.device) -> int:
    """A rank other than 0's part, from its ``FollowerSpec``: measure and agree with the others,
    then wait until rank 0 has sized the shared file (CPU). Returns the block count, the same on
    every rank."""
    kv = cache_spec_of(cfg, spec.block_size, next(model.parameters()).dtype, spec.size)
    step = ProfileStep(spec.profile_tokens, spec.profile_rows, spec.max_model_len, spec.attention_backend)
    blocks, _ = measure(group, model, cfg, kv, step, spec.memory_share, probe, device)
    barrier(group, device)
    return blocks

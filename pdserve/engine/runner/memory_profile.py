"""The profile step: one forward as large as the scheduler ever runs, to measure what a step needs.

A worker sized by ``gpu_memory_utilization`` (pdserve/engine/memory.py) runs this once after its
weights load and before its KV cache exists: a prefill of ``max_num_batched_tokens`` tokens (in
sequences of at most ``max_model_len``), its logits for as many rows as a step samples at most,
on a scratch cache just large enough for those tokens. The probe's peak over it is this
worker's use: weights, plus the largest step's activations. The scratch cache is counted in that
peak, and taken off again: the real cache replaces it.
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.attention.base import host_context
from pdserve.engine.attention.kv_cache import CacheSpec, num_cache_blocks
from pdserve.engine.attention.select import select_attention
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.memory import (SETTING, CacheSize, MemoryProbe, check_free_at_start, kv_budget_for_share,
                                   probe_for, readable)
from pdserve.engine.models.decoder import CausalLM


def profile_sequences(num_tokens: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the profile step: ``num_tokens`` in sequences no longer than
    ``max_model_len``, as the scheduler could batch them."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profile_use(model: CausalLM, cfg: ModelConfig, spec: CacheSpec, config: EngineConfig, max_model_len: int,
                probe: MemoryProbe) -> int:
    """This worker's peak use over one step of ``max_num_batched_tokens`` prompt tokens (bytes;
    ``probe.used_bytes``, less the scratch cache the step wrote its KV into)."""
    device = next(model.parameters()).device
    lengths = profile_sequences(config.scheduler.max_num_batched_tokens, max_model_len)
    bs = spec.block_size
    per_seq = [-(-n // bs) for n in lengths]
    scratch = spec.allocate(sum(per_seq), device)  # (blocks, *block_shape)
    tables, first = [], 0
    for n in per_seq:
        tables.append(list(range(first, first + n)))
        first += n
    backend = select_attention(config.attention_backend, cfg, model.tp, device, bs, scratch.dtype)
    host = host_context([0] * len(lengths), lengths, tables, bs, decode=False)
    tokens = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    probe.start_peak()
    ctx, positions, (input_ids,) = host.to(device, [tokens])
    model.bind_caches(spec.layer_caches(scratch), backend)
    hidden = model(input_ids, positions, ctx)
    rows = min(hidden.shape[0], max(len(lengths), config.scheduler.max_num_seqs))  # a step's sampled rows
    model.compute_logits(hidden[-rows:]).softmax(-1)  # the sampler's float32 probabilities
    used = probe.used_bytes() - scratch.numel() * scratch.element_size()
    model.bind_caches(spec.layer_caches(spec.allocate(0, device)), backend)  # let the scratch go
    del scratch, hidden
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the step's blocks go back to the device for the real cache
    return used


def size_cache(model: CausalLM, cfg: ModelConfig, spec: CacheSpec, config: EngineConfig, max_model_len: int,
               probe: MemoryProbe | None) -> CacheSize:
    """The worker's KV cache: ``num_blocks`` where a test sets it, else the exact budget, else
    what ``gpu_memory_utilization`` leaves after the profile step on ``probe``'s device (None:
    read the model's device)."""
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
    used = profile_use(model, cfg, spec, config, max_model_len, probe)
    budget = kv_budget_for_share(share, total, used, probe.name)
    blocks = spec.blocks_for_budget(budget)
    if blocks < 1:
        raise KVMemoryError(SETTING, f"the {readable(budget)} left of {share:g} x {probe.name}'s "
                                     f"{readable(total)} holds no {spec.block_bytes}-byte KV block")
    return size(blocks, source=f"{SETTING} {share:g} of {probe.name}'s {readable(total)}, {readable(used)} used by "
                               f"weights and a {config.scheduler.max_num_batched_tokens}-token step")


def start_memory(config: EngineConfig, probe: MemoryProbe | None = None) -> MemoryProbe | None:
    """Before a worker loads anything: make its device the current one (``--device cuda:1``),
    and where ``gpu_memory_utilization`` sizes its cache, refuse a share the device cannot give
    now (``check_free_at_start``). Returns the probe the sizing reads (None: an exact cache)."""
    device = config.torch_device()
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # what code that asks for "cuda" (kernels, NIXL) then gets
    share = config.cache.gpu_memory_utilization
    if config.cache.num_blocks or config.cache.exact_budget_bytes() is not None:
        return None
    if config.tensor_parallel_size > 1:  # its ranks map their caches as they start, before any profile
        raise KVMemoryError(SETTING, f"a worker of tensor_parallel_size {config.tensor_parallel_size} sizes its KV "
                                     "cache before its model loads: give it exactly (--kv-cache-memory)")
    probe = probe or probe_for(device)
    check_free_at_start(share, probe.total_bytes(), probe.free_bytes(), probe.name)
    return probe

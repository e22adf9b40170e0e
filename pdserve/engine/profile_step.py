"""The profile step: one forward as large as the scheduler ever runs, to measure what a step needs.

A worker sized by ``gpu_memory_utilization`` (pdserve/engine/memory.py) runs it once after its
weights load and before its KV cache exists (runner/memory_profile.py; at tensor_parallel_size > 1
on every rank at once, distributed/memory_share.py): a prefill of ``max_num_batched_tokens``
tokens (in sequences of at most ``max_model_len``), its logits for as many rows as a step samples
at most, on a scratch cache just large enough for those tokens. The probe's peak over it is this
process's use: weights, plus the largest step's activations. The scratch cache is counted in that
peak, and taken off again: the real cache replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import host_context
from pdserve.engine.attention.kv_cache import CacheSpec
from pdserve.engine.attention.select import select_attention
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.memory import MemoryProbe
from pdserve.engine.models.decoder import CausalLM


def profile_sequences(num_tokens: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the profile step: ``num_tokens`` in sequences no longer than
    ``max_model_len``, as the scheduler could batch them."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class ProfileStep:
    """The profile step's size, as plain values (a tensor-parallel rank gets them from rank 0):
    ``num_tokens`` prompt tokens in sequences of at most ``max_model_len``, logits for
    ``max_rows`` rows at most, through ``attention_backend``."""

    num_tokens: int
    max_rows: int
    max_model_len: int
    attention_backend: str

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> "ProfileStep":
        scheduler = config.scheduler
        return cls(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, max_model_len, config.attention_backend)


@torch.inference_mode()
def profile_use(model: CausalLM, cfg: ModelConfig, spec: CacheSpec, step: ProfileStep, probe: MemoryProbe) -> int:
    """This worker's (this rank's) peak use over one step of ``step.num_tokens`` prompt tokens
    (bytes; ``probe.used_bytes``, less the scratch cache the step wrote its KV into). The tokens
    are the same on every rank, so a tensor-parallel worker's ranks run it together, their
    collectives in step."""
    device = next(model.parameters()).device
    lengths = profile_sequences(step.num_tokens, step.max_model_len)
    bs = spec.block_size
    per_seq = [-(-n // bs) for n in lengths]
    scratch = spec.allocate(sum(per_seq), device)  # (blocks, *block_shape)
    tables, first = [], 0
    for n in per_seq:
        tables.append(list(range(first, first + n)))
        first += n
    backend = select_attention(step.attention_backend, cfg, model.tp, device, bs, scratch.dtype)
    host = host_context([0] * len(lengths), lengths, tables, bs, decode=False)
    tokens = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    probe.start_peak()
    ctx, positions, (input_ids,) = host.to(device, [tokens])
    model.bind_caches(spec.layer_caches(scratch), backend)
    hidden = model(input_ids, positions, ctx)
    rows = min(hidden.shape[0], max(len(lengths), step.max_rows))  # a step's sampled rows
    logits = model.compute_logits(hidden[-rows:])  # None on a rank other than 0 (its slice went there)
    if logits is not None:
        logits.softmax(-1)  # the sampler's float32 probabilities
    used = probe.used_bytes() - scratch.numel() * scratch.element_size()
    model.bind_caches(spec.layer_caches(spec.allocate(0, device)), backend)  # let the scratch go
    del scratch, hidden
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the step's blocks go back to the device for the real cache
    return used

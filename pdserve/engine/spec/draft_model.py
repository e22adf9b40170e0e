"""The draft model of ``speculative_config.method = "draft_model"``: loading it beside the
target, checking that it can guess the target's tokens, sizing its KV cache, and a runner that
gives back logits instead of sampled tokens.

The draft is loaded by the engine's own loader (pdserve/engine/loader.py) on the target's
device and in its dtype, whole on rank 0 (tensor-parallel size 1 whatever the target's): it is
small, and its steps run where the proposals are needed, on the rank that schedules.

Its cache holds as many token slots as the target's cache (no sequence the draft tracks is
longer than the target holds), and no more than the sequences that may speculate in one step
(``min(max_num_seqs, disable_by_batch_size)``) each at the longest context plus the guesses;
where the target's cache is measured at start (``gpu_memory_utilization``), the second bound
alone. Sequences that stop speculating keep their blocks until a step needs them
(pdserve/engine/spec/draft.py evicts the least recently proposed first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.kv_cache import cache_spec_of, num_cache_blocks
from pdserve.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.core.scheduler import SchedulerOutput
from pdserve.engine.errors import KVMemoryError, ModelLoadError
from pdserve.engine.loader import load_model, materialize, read_model_config
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.runner.model_runner import ModelRunner

FIELD = "speculative_config.model"


@dataclass(frozen=True)
class DraftModel:
    """The loaded draft: its module, config and the context length it may run to (the
    smaller of the target's and its own)."""

    model: CausalLM
    cfg: ModelConfig
    max_model_len: int


def check_draft(draft: ModelConfig, target: ModelConfig, source: str) -> None:
    """Refuse a draft that cannot propose the target's tokens: another vocabulary size (its
    token ids would mean other tokens, or fall outside the target's logits)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{FIELD}: the draft {source!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{target.vocab_size}; a draft must share the target's vocabulary")


def load_draft(spec: SpeculativeConfig, engine_config: EngineConfig, target: ModelConfig) -> DraftModel:
    """Read ``spec.model``'s config and check it against the target's before loading any
    weight, then load it in the target's dtype on its device. Every refusal names
    ``speculative_config.model``."""
    if not spec.model:
        raise ValueError(f"{FIELD}: method draft_model needs a draft model directory")
    try:
        directory = materialize(spec.model, progress=False)
        cfg = read_model_config(directory)
    except ModelLoadError as exc:
        raise ModelLoadError(exc.path, f"{FIELD}: {exc.reason}") from exc
    check_draft(cfg, target, spec.model)
    try:
        model, cfg, _ = load_model(str(directory), engine_config.torch_dtype(), engine_config.torch_device(),
                                   progress=False, load_format=engine_config.load_format, huge_pages=True)
    except ModelLoadError as exc:
        raise ModelLoadError(exc.path, f"{FIELD}: {exc.reason}") from exc
    target_len = min(engine_config.max_model_len or target.max_model_len, target.max_model_len)
    return DraftModel(model, cfg, min(target_len, cfg.max_model_len))


def draft_cache_blocks(spec: SpeculativeConfig, engine_config: EngineConfig, target: ModelConfig,
                       max_model_len: int) -> int:
    """Blocks of the draft's cache (module docstring): the target's token slots, capped at the
    speculating sequences' longest contexts plus their guesses."""
    block_size = engine_config.cache.block_size
    sequences = min(engine_config.scheduler.max_num_seqs, spec.disable_by_batch_size)
    per_seq = -(-(max_model_len + spec.num_speculative_tokens) // block_size)
    blocks = sequences * per_seq
    target_spec = cache_spec_of(target, block_size, engine_config.torch_dtype(), engine_config.tensor_parallel_size)
    try:
        blocks = min(blocks, num_cache_blocks(engine_config, target_spec))
    except KVMemoryError:
        pass  # the target's cache is measured at start: the speculating sequences' bound alone
    return max(blocks, 1)


class DraftRunner(ModelRunner):
    """The engine's runner (attention context, cache binding, CUDA graph replay) over the draft,
    returning the sampled rows' logits: the proposer draws from them itself, at the request's
    temperature alone (a draft's distribution needs none of the request's filters to be
    corrected by rejection sampling)."""

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """(S, V) float32 logits of the S rows ``out`` samples, in its order."""
        host, tokens, sample_idx = self._host_inputs(out)
        self.model.bind_caches(self._layer_caches, self.backend)
        logits = self._replay(out, host, tokens)
        if logits is None:
            logits, _ = self._forward(out, host, tokens, sample_idx)
        self.num_forward_tokens += tokens.shape[0]
        return logits

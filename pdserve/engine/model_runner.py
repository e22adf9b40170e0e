"""Runs one scheduled step through the model: inputs in, sampled tokens out.

Builds the packed token ids, positions and the ``AttentionContext`` (slot mapping, block
tables, lengths) from the scheduler's output, hands every attention layer its slice of the
cache, runs the forward, and samples the sequences that finished their
prompt or are decoding.
"""

from __future__ import annotations

from itertools import accumulate, chain

import torch

from pdserve.engine.attention import AttentionContext, host_context
from pdserve.engine.attention_mla import select_latent_backend
from pdserve.engine.attention_select import select_backend
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache import cache_spec_of
from pdserve.engine.model import CausalLM
from pdserve.engine.prompt_logprobs import prompt_logprobs
from pdserve.engine.sampler import Sampler, SamplerRow
from pdserve.engine.scheduler import SampledTokens, SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, cache: torch.Tensor, blocks: BlockManager,
                 attention_backend: str = "auto", seed: int = 0):
        self.model = model
        self.cfg = cfg
        self.cache = cache
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.device = cache.device
        if cfg.mla is not None:
            self.backend = select_latent_backend(attention_backend, cfg.mla)
        else:
            self.backend = select_backend(attention_backend, self.device, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.head_dim, self.block_size, dtype=cache.dtype)
        self._layer_caches = cache_spec_of(cfg, self.block_size, cache.dtype).layer_caches(cache)
        self.sampler = Sampler(self.device, seed)
        self.num_forward_tokens = 0  # tokens run through the model, for tests and metrics

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> SampledTokens:
        input_ids, positions, ctx, sample_idx = self.prepare(out)
        self.model.bind_caches(self._layer_caches, self.backend)
        hidden = self.model(input_ids, positions, ctx)
        self.num_forward_tokens += input_ids.shape[0]
        prompt_lps = prompt_logprobs(self.model, hidden, out)
        sampled = [s for s in out.seqs if s.sample]
        if not sampled:
            return SampledTokens({}, prompt_logprobs=prompt_lps)
        logits = self.model.compute_logits(hidden[sample_idx])  # (N, V) float32
        rows = [SamplerRow(s.seq.seq_id, s.seq.params, s.seq.token_ids, s.seq.num_prompt_tokens) for s in sampled]
        drawn = self.sampler(logits, rows)
        ids = [r.seq_id for r in rows if r.seq_id not in drawn.failed]
        return SampledTokens(dict(zip(ids, drawn.token_ids)), dict(zip(ids, drawn.logprobs)) if drawn.logprobs else {},
                             dict(zip(ids, drawn.top_logprobs)) if drawn.top_logprobs else {}, prompt_lps,
                             dict(drawn.failed))

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        """Packed token ids (T,), positions (T,), the step's ``AttentionContext`` and the rows
        to sample. Python touches each sequence once (its token slice and block table)."""
        items = out.seqs
        starts = [item.seq.num_computed_tokens for item in items]
        query_lens = [item.num_new_tokens for item in items]
        tokens = list(chain.from_iterable(item.seq.token_ids[s:s + n] for item, s, n in zip(items, starts, query_lens)))
        tables = [self.blocks.block_table(item.seq.seq_id) for item in items]
        host = host_context(starts, query_lens, tables, self.block_size, decode=not out.is_prefill)
        # The last token of each sampled sequence.
        sample_idx = [end - 1 for end, item in zip(accumulate(query_lens), items) if item.sample]
        # Every input of the step goes to the device in one copy that the host does not wait for.
        ctx, positions, (input_ids, sample_rows) = host.to(self.device, [
            torch.tensor(tokens, dtype=torch.long), torch.tensor(sample_idx, dtype=torch.long)])
        return input_ids, positions, ctx, sample_rows

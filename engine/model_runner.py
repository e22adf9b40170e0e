"""Runs one scheduled step through the model: inputs in, sampled tokens out.

Builds the packed token ids, positions and the ``AttentionContext`` (slot mapping, block
tables, lengths) from the scheduler's output, hands every attention layer its slice of the
cache, runs the forward, and samples the sequences that finished their
prompt or are decoding.
"""

from __future__ import annotations

from itertools import chain

import torch

from engine.attention import AttentionContext, select_backend
from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import layer_views
from engine.model import CausalLM
from engine.sampler import Sampler, SamplerRow
from engine.scheduler import SampledTokens, SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, cache: torch.Tensor, blocks: BlockManager,
                 attention_backend: str = "auto", seed: int = 0):
        self.model = model
        self.cfg = cfg
        self.cache = cache
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.device = cache.device
        self.backend = select_backend(attention_backend, self.device, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.head_dim, self.block_size)
        self._layer_caches = [layer_views(cache, i) for i in range(cfg.num_layers)]
        self.sampler = Sampler(self.device, seed)
        self.num_forward_tokens = 0  # tokens run through the model, for tests and metrics

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> SampledTokens:
        input_ids, positions, ctx, sample_idx = self.prepare(out)
        # Bound every step (30-odd attribute writes), so engines that share one model object
        # (tests do) never run on each other's cache.
        for attn, (k, v) in zip(self.model.attention_layers, self._layer_caches):
            attn.bind_cache(k, v, self.backend)
        hidden = self.model(input_ids, positions, ctx)
        self.num_forward_tokens += input_ids.shape[0]
        sampled = [s for s in out.seqs if s.sample]
        if not sampled:
            return SampledTokens({})
        logits = self.model.compute_logits(hidden[sample_idx])  # (N, V) float32
        rows = [SamplerRow(s.seq.seq_id, s.seq.params, s.seq.token_ids) for s in sampled]
        tokens, logprobs = self.sampler(logits, rows)
        ids = [r.seq_id for r in rows]
        return SampledTokens(dict(zip(ids, tokens)), dict(zip(ids, logprobs)) if logprobs else {})

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        """Packed inputs and the step's ``AttentionContext``. Python touches each sequence once
        (its token slice and block table); per-token work (positions, slots) is tensor ops."""
        bs = self.block_size
        items = out.seqs
        starts = [item.seq.num_computed_tokens for item in items]
        query_lens = [item.num_new_tokens for item in items]
        context_lens = [s + n for s, n in zip(starts, query_lens)]
        tokens = list(chain.from_iterable(item.seq.token_ids[s:c] for item, s, c in zip(items, starts, context_lens)))
        used = [-(-c // bs) for c in context_lens]
        width = max(used)
        tables = [self.blocks.block_table(item.seq.seq_id)[:u] + [0] * (width - u) for item, u in zip(items, used)]
        block_tables = torch.tensor(tables, dtype=torch.int32)  # (B, M)
        q_lens = torch.tensor(query_lens, dtype=torch.int32)
        cu = torch.zeros(len(items) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=cu[1:])
        seq_of = torch.repeat_interleave(torch.arange(len(items)), q_lens)  # (T,) row of each token
        positions = torch.arange(len(tokens)) - cu[seq_of] + torch.tensor(starts)[seq_of]  # (T,) int64
        sample = torch.tensor([item.sample for item in items])
        dev = self.device
        ctx = AttentionContext(
            is_decode=not out.is_prefill and all(n == 1 for n in query_lens),
            slot_block=block_tables[seq_of, positions // bs].long().to(dev),
            slot_offset=(positions % bs).to(dev),
            block_tables=block_tables.to(dev),
            query_lens=query_lens,
            context_lens=context_lens,
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32).to(dev),
            cu_query_lens=cu.to(dev),
            max_context_len=max(context_lens),
            max_query_len=max(query_lens),
            block_size=bs,
        )
        if ctx.is_decode and self.backend.needs_decode_groups:
            ctx.decode_groups = self._decode_groups(tables, context_lens)
        sample_idx = (cu[1:].long() - 1)[sample]
        return (torch.tensor(tokens, dtype=torch.long).to(dev), positions.to(dev), ctx, sample_idx.to(dev))

    def _decode_groups(self, tables: list[list[int]], context_lens: list[int]):
        """SDPA's decode: rows grouped by context length (see AttentionContext.decode_groups)."""
        rows_by_len: dict[int, list[int]] = {}
        for i, c in enumerate(context_lens):
            rows_by_len.setdefault(c, []).append(i)
        dev = self.device
        bs = self.block_size
        return [(torch.tensor(rows, device=dev),
                 torch.tensor([tables[i][: -(-c // bs)] for i in rows], dtype=torch.long, device=dev), c)
                for c, rows in rows_by_len.items()]

"""Runs one scheduled step through the model: inputs in, sampled tokens out.

Builds the packed token ids, positions and the ``AttentionContext`` (slot mapping, block
tables, lengths) from the scheduler's output, hands every attention layer its slice of the
cache, runs the forward, and samples the sequences that finished their
prompt or are decoding.
"""

from __future__ import annotations

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
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_block: list[int] = []
        slot_offset: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_idx: list[int] = []
        for item in out.seqs:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = self.blocks.block_table(seq.seq_id)
            tokens.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            for p in range(start, start + n):
                slot_block.append(table[p // bs])
                slot_offset.append(p % bs)
            tables.append(table[: -(-(start + n) // bs)])
            query_lens.append(n)
            context_lens.append(start + n)
            if item.sample:
                sample_idx.append(len(tokens) - 1)
        dev = self.device
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        max_ctx = max(context_lens)
        ctx = AttentionContext(
            is_decode=not out.is_prefill and all(n == 1 for n in query_lens),
            slot_block=torch.tensor(slot_block, dtype=torch.long, device=dev),
            slot_offset=torch.tensor(slot_offset, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor([0] + _cumsum(query_lens), dtype=torch.int32, device=dev),
            max_context_len=max_ctx,
            block_size=bs,
        )
        if ctx.is_decode:
            ctx.decode_groups = self._decode_groups(tables, context_lens)
        return (torch.tensor(tokens, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), ctx,
                torch.tensor(sample_idx, dtype=torch.long, device=dev))

    def _decode_groups(self, tables: list[list[int]], context_lens: list[int]):
        rows_by_len: dict[int, list[int]] = {}
        for i, c in enumerate(context_lens):
            rows_by_len.setdefault(c, []).append(i)
        dev = self.device
        return [(torch.tensor(rows, device=dev),
                 torch.tensor([tables[i] for i in rows], dtype=torch.long, device=dev), c)
                for c, rows in rows_by_len.items()]


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out

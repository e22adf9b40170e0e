"""flash-attn backend on CUDA: one attention call per layer, K/V read through the block tables.

flash-attn reads a paged cache (``block_table=``) only when the block size is a multiple of
256: upstream 2.6 through 2.8 and ``main`` check ``page_block_size % 256 == 0`` in
``csrc/flash_attn/flash_api.cpp`` for both ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` (vLLM's fork lifts this; the PyPI package does not). So:

- ``block_size % 256 == 0`` (paged, no copies): a decode-only step is one
  ``flash_attn_with_kvcache`` call (q (B, 1, nh, hd), ``cache_seqlens``, ``block_table``); a
  prefill, chunked-prefill or mixed step is one ``flash_attn_varlen_func`` call with the block
  table (``cu_seqlens_k`` = cumulative context lengths, causal bottom-right aligned, so a chunk
  sees its prefix).
- smaller blocks (pdserve's default is 16): each layer gathers every sequence's context into
  a packed buffer with one indexing op and runs ``flash_attn_varlen_func`` on it.

Batch invariance (the ``batch_invariant`` mode flag, backend name ``flash_invariant``):
- off (``flash``, the default): NOT batch-invariant. For decode, flash-attn picks the number
  of KV splits from batch x heads against the SM count, so a sequence's reduction order
  depends on how many others share the step; and a mixed step runs another kernel than a
  decode-only step, so a recompute after preemption need not reproduce the decode bits.
- on (``flash_invariant``, paged block sizes only): every step, whatever its mix, is the same
  ``flash_attn_with_kvcache`` call with ``num_splits=1`` (one fixed pass over the keys per
  query row), queries right-aligned in a (B, max(2, max_query_len), nh, hd) buffer, padding
  rows discarded. At least 2 rows keeps flash-attn off its decode-only GQA re-layout, so a
  decode row runs exactly as it does beside a prefill chunk. The cost: padded query rows, and
  no split-KV parallelism for long decodes.
A sliding window (``window``, a layer's) is flash-attn's own ``window_size=(window - 1, 0)``
in every one of these calls: with ``causal`` it lets the query at position p see p - window + 1
.. p, the same bottom-right alignment as the causal mask.
This module has never run: no GPU was available where it was written (tests/engine/
test_flash_attention.py checks it against SDPA and checks invariance, on CUDA only).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionContext, write_kv

PAGED_BLOCK_MULTIPLE = 256  # flash-attn's page_block_size constraint (see the docstring)


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttention(AttentionBackend):
    """flash-attn over the paged cache; ``batch_invariant`` selects the fixed-order mode."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 batch_invariant: bool = False, scale: float | None = None):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.paged = block_size % PAGED_BLOCK_MULTIPLE == 0
        if batch_invariant and not self.paged:
            raise ValueError(f"attention_backend=flash_invariant needs cache block_size a multiple of "
                             f"{PAGED_BLOCK_MULTIPLE} (flash-attn's paged KV), got {block_size}")
        self.batch_invariant = batch_invariant
        self.name = "flash_invariant" if batch_invariant else "flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                window: int | None = None) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd). Writes k/v into the cache first."""
        write_kv(k_cache, v_cache, k, v, ctx)
        windowed = {} if window is None else {"window_size": (window - 1, 0)}
        if self.batch_invariant:
            return self._invariant(q, k_cache, v_cache, ctx, windowed)
        if self.paged and ctx.is_decode:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens_t,
                                     block_table=ctx.block_tables, softmax_scale=self.scale, causal=True, **windowed)
            return out.squeeze(1)
        paged = {"block_table": ctx.block_tables} if self.paged else {}
        kk = k_cache if self.paged else _packed_context(k_cache, ctx)
        vv = v_cache if self.paged else _packed_context(v_cache, ctx)
        return self._varlen(
            q, kk, vv, cu_seqlens_q=ctx.cu_query_lens, cu_seqlens_k=ctx.cu_context_lens,
            max_seqlen_q=ctx.max_query_len, max_seqlen_k=ctx.max_context_len,
            softmax_scale=self.scale, causal=True, **paged, **windowed,
        )

    def _invariant(self, q: torch.Tensor, k_cache, v_cache, ctx: AttentionContext, windowed: dict) -> torch.Tensor:
        rows = max(2, ctx.max_query_len)
        index = _right_aligned_rows(ctx, rows)  # (T,) row of each token in the (B * rows) buffer
        padded = q.new_zeros(len(ctx.query_lens) * rows, *q.shape[1:])
        padded[index] = q
        out = self._with_kvcache(padded.view(len(ctx.query_lens), rows, *q.shape[1:]), k_cache, v_cache,
                                 cache_seqlens=ctx.context_lens_t, block_table=ctx.block_tables,
                                 softmax_scale=self.scale, causal=True, num_splits=1, **windowed)
        return out.flatten(0, 1)[index]


def _right_aligned_rows(ctx: AttentionContext, rows: int) -> torch.Tensor:
    """Token t of sequence b, query j of n, goes to row b * rows + rows - n + j: flash-attn
    places the last query row at the last cached position."""
    cu = ctx.cu_query_lens.long()
    lens = cu[1:] - cu[:-1]
    total = sum(ctx.query_lens)  # from the host list: no device sync
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens, output_size=total)
    j = torch.arange(total, device=cu.device) - cu[seq_of]
    return seq_of * rows + rows - lens[seq_of] + j


def _packed_context(cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """(num_blocks, bs, nkv, hd) -> every sequence's context packed, (sum(context_lens), nkv, hd)."""
    lens = ctx.context_lens_t.long()
    cu = ctx.cu_context_lens.long()
    total = sum(ctx.context_lens)  # from the host list: no device sync
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)
    t = torch.arange(total, device=lens.device) - cu[seq_of]  # position inside its sequence
    blocks = ctx.block_tables[seq_of, t // ctx.block_size].long()
    return cache[blocks, t % ctx.block_size]

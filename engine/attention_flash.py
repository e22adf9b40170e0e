"""flash-attn backend, used automatically on CUDA when the ``flash-attn`` package imports.

Prefill runs ``flash_attn_varlen_func`` over the packed tokens; decode runs
``flash_attn_with_kvcache`` with the block table. flash-attn's paged kernels need the
block size to be a multiple of 256; with smaller blocks the cached K/V is gathered into a
packed buffer and both phases go through ``flash_attn_varlen_func``.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionContext, gather_kv, write_kv

PAGED_BLOCK_MULTIPLE = 256


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttention:
    name = "flash"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.scale = head_dim ** -0.5
        self.paged = block_size % PAGED_BLOCK_MULTIPLE == 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd)."""
        write_kv(k_cache, v_cache, k, v, ctx)
        if ctx.is_decode and self.paged:
            out = self._with_kvcache(
                q.unsqueeze(1), k_cache, v_cache,  # q (B, 1, nh, hd)
                cache_seqlens=ctx.context_lens_t, block_table=ctx.block_tables.to(torch.int32),
                softmax_scale=self.scale, causal=True,
            )
            return out.squeeze(1)
        if all(c == n for n, c in zip(ctx.query_lens, ctx.context_lens)):
            # Fresh prompts: K/V are exactly the new tokens.
            kk, vv, cu_k, max_k = k, v, ctx.cu_query_lens, max(ctx.query_lens)
        else:
            kk, vv = self._packed_context(k_cache, v_cache, ctx)
            cu_k = torch.nn.functional.pad(torch.cumsum(ctx.context_lens_t, 0, dtype=torch.int32), (1, 0))
            max_k = ctx.max_context_len
        return self._varlen(
            q, kk, vv, cu_seqlens_q=ctx.cu_query_lens, cu_seqlens_k=cu_k,
            max_seqlen_q=max(ctx.query_lens), max_seqlen_k=max_k,
            softmax_scale=self.scale, causal=True,  # bottom-right aligned: a chunk sees its prefix
        )

    def _packed_context(self, k_cache, v_cache, ctx: AttentionContext):
        ks, vs = [], []
        for i, c in enumerate(ctx.context_lens):
            table = ctx.block_tables[i:i + 1]
            ks.append(gather_kv(k_cache, table, c)[0])  # (c, nkv, hd)
            vs.append(gather_kv(v_cache, table, c)[0])
        return torch.cat(ks), torch.cat(vs)

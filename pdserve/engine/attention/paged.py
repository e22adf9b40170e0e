"""pdserve's paged-attention kernel on CPU: one batch-invariant C++ call per layer.

``torch.ops.pdserve.paged_attention`` (pdserve/engine/kernels/csrc/paged_attention.cpp) reads K/V in place
through the block tables, for decode, prefill, chunked prefill and mixed batches alike, so a
step makes one attention call per layer whatever its mix of sequences. Its reduction order
is fixed per query row (the C++ file's header says why), so a token's output is bitwise the
same alone or in any batch, whole or chunked, recomputed after preemption or not, at any
thread count. With a sliding window (a layer's ``window``) a query reads only its last
``window`` keys, and that holds as well: a row's first key is its own, whatever its batch.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.base import AttentionBackend, AttentionContext, write_kv

_fake_registered = False


def load_kernel() -> None:
    """Build/load the C++ op and give it a shape function, so ``torch.compile`` can trace it."""
    global _fake_registered
    cpu_kernels.load()
    if not _fake_registered:
        torch.library.register_fake("pdserve::paged_attention")(_paged_attention_shape)
        torch.library.register_fake("pdserve::rope_store_kv")(_rope_store_kv_shape)
        _fake_registered = True


def _paged_attention_shape(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=0):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rope_store_kv_shape(qkv, cos, sin, k_cache, v_cache, slot_block, slot_offset, num_heads, num_kv_heads):
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[-1]))


def paged_available(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_kernels.cpu_supported()


class PagedAttention(AttentionBackend):
    """The C++ kernel over the paged cache: float32, bfloat16 and float16, GQA."""

    name = "paged"
    batch_invariant = True
    needs_decode_groups = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        if head_dim % 8:
            raise ValueError(f"attention_backend=paged needs head_dim a multiple of 8, got {head_dim}")
        load_kernel()
        self.scale = head_dim ** -0.5 if scale is None else scale

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
               v_cache: torch.Tensor, ctx: AttentionContext, nh: int, nkv: int, hd: int,
               window: int | None = None) -> torch.Tensor:
        """Two calls per layer: RoPE + K/V store in one (``rope_store_kv``, the same bits as
        the eager ops), then attention (over the last ``window`` keys of each query, if given)."""
        q = torch.ops.pdserve.rope_store_kv(qkv.contiguous(), rope[0], rope[1], k_cache, v_cache, ctx.slot_block,
                                            ctx.slot_offset, nh, nkv)
        return self._attention(q, k_cache, v_cache, ctx, window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                window: int | None = None) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd). Writes k/v into the cache first."""
        write_kv(k_cache, v_cache, k, v, ctx)
        return self._attention(q, k_cache, v_cache, ctx, window)

    def _attention(self, q, k_cache, v_cache, ctx: AttentionContext, window: int | None) -> torch.Tensor:
        if window is None:  # the call as it was before windows, to the bit
            return torch.ops.pdserve.paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens,
                                                     ctx.context_lens_t, self.scale)
        return torch.ops.pdserve.paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens,
                                                 ctx.context_lens_t, self.scale, window)

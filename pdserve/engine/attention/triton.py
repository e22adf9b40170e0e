"""Paged attention in Triton: one launch a layer for the whole batch, K/V read in place.

For CUDA without flash-attn's paged mode (which needs blocks of 256; pdserve's are 16), the
other backends gather every sequence's context into a contiguous copy, every layer, and SDPA
runs one group per distinct context length. This kernel reads each key's block id from the
block table and its K/V from the cache where they lie, for decode, prefill, a chunk after a
cached prefix and mixed steps alike.

The grid is (sequence, tile of ``block_q`` query tokens, KV head). A program takes the
``group`` query heads that share its KV head (GQA) for its tokens, rows ``(token, head)``,
and walks the sequence's keys ``block_n`` at a time up to its last token's position: one
``q @ k^T``, a causal mask (a query at position p sees keys 0..p: the cached prefix and the
chunk's earlier tokens; with a sliding window, only its last ``WINDOW`` of them, and the walk
starts at the tile's first query's first key), an online softmax in float32 and one ``p @ v``. Every input the
grid reads about lengths is a device tensor (``cu_query_lens``, ``context_lens``,
``block_tables``); from the host it takes only the batch size and the longest query, so a
decode step's launch is the same for any mix of context lengths, and can be captured in a CUDA
graph (pdserve/engine/cuda_graphs.py). A second small kernel stores the step's new K/V into
their slots, and skips rows whose ``slot_block`` is -1 (a CUDA graph's padding rows).

Decode launches (one query token a sequence) split the keys (flash-decoding) where the grid
above would leave SMs idle: pdserve/engine/attention/triton_split.py. The key walk and the
launch constants both kernels use are in triton_walk.py.

On the CPU the same kernels run under Triton's interpreter, where ``TRITON_INTERPRET=1`` was
set before triton was first imported (tests/conftest.py does so on a host without CUDA):
that is how tests/engine/test_triton_attention.py and test_triton_split_kv.py check them
against SDPA over the gathered context in ``make test``. Not batch-invariant (the tile shapes
differ between decode and prefill launches, and a decode step's split count with its batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.base import AttentionBackend, AttentionContext
from pdserve.engine.attention.triton_split import SPLIT_MIN_KEYS, decode_splits, split_kv_attention
from pdserve.engine.attention.triton_walk import (BLOCK_N, _check_device, _last_dim_contiguous, _walk_keys,
                                                  interpreted, launch_constants)
from pdserve.engine.kernels.triton_fused import rotary


# The block table's row stride is the step's longest sequence in blocks (eager steps): Triton
# would compile again whenever it turns 1 or a multiple of 16, so it is not specialised on.
@triton.jit(do_not_specialize=["stride_bt"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        ctx_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tok = tile * BLOCK_Q + rows // GROUP_PAD  # query token of each row, in its sequence
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
        pos = ctx_len - q_len + tok  # each row's position: it sees keys 0..pos
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (M, D)
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
        # Keys up to the tile's last token's position; with a window, from the first key its
        # first token sees (down to a whole BLOCK_N).
        end = ctx_len - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
        first = 0
        if WINDOW > 0:
            first = tl.maximum(ctx_len - q_len + tile * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _walk_keys(q, m_i, l_i, acc, pos, first, end, seq, kv_head, k_cache_ptr, v_cache_ptr,
                                   block_tables_ptr, scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                   stride_vh, stride_bt, d, d_ok, BLOCK_SIZE, BLOCK_N, DOT, WINDOW)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_block_ptr, slot_offset_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ckb, stride_ckt, stride_ckh, stride_cvb, stride_cvt, stride_cvh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    block = tl.load(slot_block_ptr + t)
    if block >= 0:  # -1: a padding row, with no slot of its own
        offset = tl.load(slot_offset_ptr + t)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
        tl.store(k_cache_ptr + block * stride_ckb + offset * stride_ckt + h[:, None] * stride_ckh + d[None, :], k, mask=ok)
        tl.store(v_cache_ptr + block * stride_cvb + offset * stride_cvt + h[:, None] * stride_cvh + d[None, :], v, mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_block: torch.Tensor, slot_offset: torch.Tensor) -> None:
    """k, v (T, nkv, hd), any token and head strides, into their slots: one launch for both.
    A token whose ``slot_block`` is -1 is skipped."""
    _last_dim_contiguous(k, v, k_cache, v_cache)
    _check_device(k)
    t, nkv, hd = k.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_block, slot_offset, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
                v_cache.stride(2), NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_H=triton.next_power_of_2(nkv),
                BLOCK_D=triton.next_power_of_2(hd))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_query_lens: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """q (T, nh, hd) -> (T, nh, hd): each sequence's queries (``cu_query_lens``, (B+1,)) over
    its ``context_lens`` (B,) cached tokens, the last ``query_len`` of which are its own,
    causally (and each over its last ``window`` keys only, if given). ``k_cache``/``v_cache``
    (num_blocks, block_size, nkv, hd), any strides but the last; ``block_tables`` (B, M) int32."""
    _last_dim_contiguous(q, k_cache, v_cache)
    _check_device(q)
    t, nh, hd = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    nkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if max_query_len == 1:
        splits = decode_splits(block_tables.shape[0], nkv, q.device)
        if splits > 1:
            return split_kv_attention(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window,
                                      splits, BLOCK_N if interpreted() else SPLIT_MIN_KEYS)
    constants = launch_constants(nh, nkv, hd, block_size, max_query_len, q.dtype, interpreted(), window)
    _attention_kernel[(block_tables.shape[0], triton.cdiv(max_query_len, constants["BLOCK_Q"]), nkv)](
        q, k_cache, v_cache, out, block_tables, cu_query_lens, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        **constants,
    )
    return out


class TritonAttention(AttentionBackend):
    """The Triton kernels over the paged cache: float32, bfloat16 and float16, GQA."""

    name = "triton"
    batch_invariant = False
    graph_safe = True  # its launches read every length from the device (CUDA graphs)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"attention_backend=triton needs num_heads ({num_heads}) a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.scale = head_dim ** -0.5 if scale is None else scale

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
               v_cache: torch.Tensor, ctx: AttentionContext, nh: int, nkv: int, hd: int,
               window: int | None = None) -> torch.Tensor:
        """As ``AttentionBackend.attend``, with RoPE on q and k in one launch (``triton_fused.rotary``,
        the bits of ``apply_rotary``) reading them where they lie in ``qkv``."""
        t = qkv.shape[0]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = rotary(q.view(t, nh, hd), k.view(t, nkv, hd), *rope)  # contiguous, as the kernel wants q
        return self.forward(q, k, v.view(t, nkv, hd), k_cache, v_cache, ctx, window=window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                window: int | None = None) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd) -> (T, nh, hd). Stores k/v in their slots first."""
        store_kv(k, v, k_cache, v_cache, ctx.slot_block, ctx.slot_offset)
        return paged_attention(q.contiguous(), k_cache, v_cache, ctx.block_tables, ctx.cu_query_lens,
                               ctx.context_lens_t, ctx.max_query_len, self.scale, window)

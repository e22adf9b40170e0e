"""Split-KV (flash-decoding) decode attention in Triton, for pdserve/engine/attention/triton.py.

Decode launches (one query token a sequence) split the keys (flash-decoding): at batch 1 the
grid above is only a program a KV head (8 for Llama-3.1-8B on 132 SMs), each walking every
key. ``decode_splits`` picks S, a power of two up to ``MAX_SPLITS``, so the (sequence, split,
KV head) programs come to about ``WAVES`` waves of the SMs: from the batch size, the KV heads
and the SM count alone, never the context lengths, so the launch stays graph-safe. On the
device each sequence's keys (from its window's first key tile, with a window) go to its
first splits in runs of whole key tiles, at least ``SPLIT_MIN_KEYS`` each: a short context
fills fewer splits, and the rest write an empty partial (max -inf, sum 0) and stop. Each
split's running max, sum and unnormalised output go to a float32 scratch, which a second
kernel merges per (sequence, head) by rescaling each to the largest max. With S = 1 (large
batches) the single-pass kernel runs alone. Under the interpreter S is
``INTERPRETED_SPLITS`` with splits of one key tile, so the tests cross several.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.triton_walk import (BLOCK_N, _check_device, _last_dim_contiguous, _walk_keys,
                                                  interpreted, launch_constants)

# Split-KV decode (``decode_splits``): programs enough for about WAVES waves of the SMs, at
# most MAX_SPLITS splits a sequence, each of at least SPLIT_MIN_KEYS keys (two key tiles: at
# batch 1 a 1k context then takes 8 splits, 64 programs for Llama-3.1-8B's 8 KV heads).
WAVES, MAX_SPLITS, SPLIT_MIN_KEYS = 2, 32, 128
INTERPRETED_SPLITS = 4  # on the CPU: few programs, but several splits for the tests (of BLOCK_N keys each)


@triton.jit(do_not_specialize=["stride_bt"])
def _split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, m_ptr, l_ptr, acc_ptr, block_tables_ptr, cu_query_lens_ptr, context_lens_ptr,
    scale, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    WINDOW: tl.constexpr, SPLITS: tl.constexpr, MIN_KEYS: tl.constexpr,
):
    """Decode only (one query token a sequence): split ``split`` of ``SPLITS`` walks its own run
    of the sequence's keys and writes its rows' running max, sum and unnormalised output to
    the scratch, float32, (B, nh, SPLITS[, hd]). A split past the keys writes -inf, 0, 0."""
    seq = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + seq)
    if tl.load(cu_query_lens_ptr + seq + 1) > q_start:
        ctx_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # the group's heads, padded to tl.dot's side
        head = kv_head * GROUP + rows
        row_ok = rows < GROUP
        pos = tl.zeros([BLOCK_Q * GROUP_PAD], tl.int32) + ctx_len - 1  # every row: the sequence's last token
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (M, D)
        first = 0
        if WINDOW > 0:
            first = tl.maximum(ctx_len - WINDOW, 0) // BLOCK_N * BLOCK_N
        # Whole BLOCK_N tiles a split, at least MIN_KEYS: a short context fills fewer splits.
        per = tl.maximum((ctx_len - first + SPLITS * BLOCK_N - 1) // (SPLITS * BLOCK_N) * BLOCK_N, MIN_KEYS)
        lo = first + split * per
        hi = tl.minimum(lo + per, ctx_len)
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
        m_i, l_i, acc = _walk_keys(q, m_i, l_i, acc, pos, lo, hi, seq, kv_head, k_cache_ptr, v_cache_ptr,
                                   block_tables_ptr, scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                   stride_vh, stride_bt, d, d_ok, BLOCK_SIZE, BLOCK_N, DOT, WINDOW)
        at = (seq * tl.num_programs(2) * GROUP + head) * SPLITS + split  # (M,) into (B, nh, SPLITS)
        tl.store(m_ptr + at, m_i, mask=row_ok)
        tl.store(l_ptr + at, l_i, mask=row_ok)
        tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, cu_query_lens_ptr, stride_ot, stride_oh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """One (sequence, head)'s splits into its output: each split's sum and output scaled by
    exp(its max - the largest), summed, divided. Splits that saw no key weigh 0; a sequence
    with no key at all gets zeros, as the single-pass kernel gives it."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_query_lens_ptr + seq)
    if tl.load(cu_query_lens_ptr + seq + 1) > q_start:
        at = (seq * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)  # (S,)
        m = tl.load(m_ptr + at)
        l = tl.load(l_ptr + at)
        m_max = tl.max(m, 0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # (S,): 0 for a split with no key
        total = tl.sum(l * w, 0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        acc = tl.load(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)  # (S, D)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + q_start * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       cu_query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                       splits: int, min_keys: int) -> torch.Tensor:
    """``paged_attention`` for a decode step (at most one query token a sequence) in two launches:
    ``split_partials``, then one program a (sequence, head) that merges its splits."""
    m, l, acc = split_partials(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window,
                               splits, min_keys)
    out = torch.empty_like(q)
    _reduce_kernel[(block_tables.shape[0], q.shape[1])](
        m, l, acc, out, cu_query_lens, out.stride(0), out.stride(1),
        HEAD_DIM=q.shape[2], BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])), SPLITS=splits)
    return out


def split_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   cu_query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                   splits: int, min_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each decode row's ``splits`` partial results, float32: running max and sum (B, nh, S) and
    unnormalised output (B, nh, S, hd). A sequence's keys (from its window's first key tile)
    go to its first splits in runs of whole ``BLOCK_N`` tiles, at least ``min_keys`` each, as
    few splits as that allows; a split past them holds -inf, 0, 0. Rows of sequences without a
    query token are left unwritten."""
    if splits < 2 or splits & (splits - 1) or min_keys < BLOCK_N or min_keys % BLOCK_N:
        raise ValueError(f"split-KV attention needs splits a power of two from 2 (got {splits}) and min_keys a "
                         f"positive multiple of {BLOCK_N} (got {min_keys})")
    _last_dim_contiguous(q, k_cache, v_cache)
    _check_device(q)
    _, nh, hd = q.shape
    b, nkv = block_tables.shape[0], k_cache.shape[2]
    constants = launch_constants(nh, nkv, hd, k_cache.shape[1], 1, q.dtype, interpreted(), window)
    m_l = torch.empty(2, b, nh, splits, dtype=torch.float32, device=q.device)
    acc = torch.empty(b, nh, splits, hd, dtype=torch.float32, device=q.device)
    _split_kernel[(b, splits, nkv)](
        q, k_cache, v_cache, m_l[0], m_l[1], acc, block_tables, cu_query_lens, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        **constants, SPLITS=splits, MIN_KEYS=min_keys,
    )
    return m_l[0], m_l[1], acc


def decode_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """How many splits a decode launch of ``batch`` sequences takes: a power of two up to
    ``MAX_SPLITS``, as many as keep the (sequence, split, KV head) programs within ``WAVES``
    of the GPU's SMs; under the interpreter ``INTERPRETED_SPLITS``. Host values only, so a
    CUDA graph's launch stays the same whatever the context lengths."""
    if interpreted():
        return INTERPRETED_SPLITS
    fill = WAVES * _sm_count(device) // (batch * num_kv_heads)
    return min(MAX_SPLITS, 1 << (max(fill, 1).bit_length() - 1))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count

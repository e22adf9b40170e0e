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

On the CPU the same kernels run under Triton's interpreter, where ``TRITON_INTERPRET=1`` was
set before triton was first imported (tests/conftest.py does so on a host without CUDA):
that is how tests/engine/test_triton_attention.py and test_triton_split_kv.py check them
against SDPA over the gathered context in ``make test``. Not batch-invariant (the tile shapes
differ between decode and prefill launches, and a decode step's split count with its batch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.engine.attention.base import AttentionBackend, AttentionContext
from pdserve.engine.kernels.triton_fused import rotary

BLOCK_N = 64  # keys an iteration: four 16-token cache blocks
MIN_ROWS = 16  # a decode program's rows, padded up to the tile side tl.dot has long required
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) a prefill program takes
# Split-KV decode (``decode_splits``): programs enough for about WAVES waves of the SMs, at
# most MAX_SPLITS splits a sequence, each of at least SPLIT_MIN_KEYS keys (two key tiles: at
# batch 1 a 1k context then takes 8 splits, 64 programs for Llama-3.1-8B's 8 KV heads).
WAVES, MAX_SPLITS, SPLIT_MIN_KEYS = 2, 32, 128
INTERPRETED_SPLITS = 4  # on the CPU: few programs, but several splits for the tests (of BLOCK_N keys each)


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (on host tensors), not on a GPU."""
    return not isinstance(_attention_kernel, triton.runtime.JITFunction)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not interpreted():
        raise ValueError("attention_backend=triton runs on CUDA, or on the CPU under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before triton is imported)")


@triton.jit
def _walk_keys(q, m_i, l_i, acc, pos, first, end, seq, kv_head, k_cache_ptr, v_cache_ptr, block_tables_ptr, scale,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, d, d_ok,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr):
    """Keys ``first``..``end`` (exclusive) of a sequence into one program's online softmax: rows
    (M,) each at position ``pos``, running max ``m_i`` and sum ``l_i`` (M,) and unnormalised
    ``acc`` (M, D), all float32, returned updated. The single-pass and split kernels share it."""
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_ok = n_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_kt + kv_head * stride_kh
                    + d[:, None], mask=kv_ok, other=0.0)  # (D, N): K transposed
        if DOT == 1:  # float32: IEEE products, not TF32's
            s = tl.dot(q, k, input_precision="ieee")
        elif DOT == 2:  # 16-bit inputs in the interpreter, whose dot reads them as integers
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k)
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:  # a query at pos sees pos - WINDOW + 1 .. pos
            visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s * scale, float("-inf"))  # (M, N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
                    + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # (N, D)
        if DOT == 1:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        elif DOT == 2:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


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


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton attention kernels need the head dimension contiguous, got strides {t.stride()}")


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


def launch_constants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_query_len: int,
                     dtype: torch.dtype, interpreted: bool, window: int | None = None) -> dict[str, int]:
    """The attention kernel's compile-time constants for one launch (tests/engine/
    triton_compile.py compiles the same ones for a GPU). A window is one of them (0: none): a
    model's layers have one or two, each its own compiled kernel."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
                GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, BLOCK_Q=_block_q(max_query_len, group_pad),
                BLOCK_N=BLOCK_N, DOT=1 if dtype == torch.float32 else 2 if interpreted else 0, WINDOW=window or 0)


def _block_q(max_query_len: int, group_pad: int) -> int:
    """Query tokens a program takes: a decode program one token's heads, padded to tl.dot's
    ``MIN_ROWS``; a prefill program up to ``PREFILL_ROWS`` rows (tokens x heads)."""
    rows = MIN_ROWS if max_query_len == 1 else PREFILL_ROWS
    return max(1, MIN_ROWS // group_pad, min(rows // group_pad, triton.next_power_of_2(max_query_len)))


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

"""What the Triton attention kernels share (pdserve/engine/attention/triton.py, the single-pass
kernel; triton_split.py, split-KV decode): the walk over a sequence's keys into one program's
online softmax, the launch constants, and the checks on where they may run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.triton_fused import interpreted

BLOCK_N = 64  # keys an iteration: four 16-token cache blocks
MIN_ROWS = 16  # a decode program's rows, padded up to the tile side tl.dot has long required
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) a prefill program takes


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


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the Triton attention kernels need the head dimension contiguous, got strides {t.stride()}")


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

"""Fused elementwise kernels for the CUDA path, in Triton: RMSNorm (with the residual add),
silu(gate) * up, and RoPE on q and k. Each is one launch where torch issues several (RMSNorm
with its add ~10, silu * up 3, RoPE ~10): a graphed decode step of a small model is bound by
its launches, not by its bytes.

Each kernel computes what the torch ops it replaces compute, rounding where they round:
``RMSNorm.forward`` (layers/norm.py), ``SiluAndMul`` (layers/activation.py) and
``apply_rotary`` (layers/rotary.py). A value torch holds in the model's dtype is rounded to it
here too, by ``_round``, to nearest even through its bits: Triton's interpreter truncates on
a cast to bfloat16 where a GPU rounds, so the cast alone would not test what a GPU runs. What
is not bitwise torch's: RMSNorm's sum of squares (a tree here; torch picks its own order), so
its float32 output may differ from torch's by an ulp or two, and in bfloat16 a few elements in
a million by a step or two, in a row whose scale sits near a rounding midpoint
(tests/engine/test_triton_fused.py says what was measured);
on a GPU the exp of silu is libdevice's, as torch's CUDA silu uses; the interpreter uses
numpy's. Launches run with fused multiply-adds off (``enable_fp_fusion``), as torch's separate
ops cannot fuse them.

Shapes and strides come from the host and nothing is read back, so every launch can be
captured in a CUDA graph. On the CPU they run only under Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

ROW_BLOCK = 1024  # silu * up: output columns a program takes


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (on host tensors), not on a GPU."""
    return not isinstance(_rms_norm_kernel, triton.runtime.JITFunction)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (to nearest even), still held in float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)  # the interpreter's float16 cast rounds (numpy)
    else:
        return x


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps, stride_x, stride_r, stride_o, stride_s,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # x = x + residual, in x's dtype: the new residual stream
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = _round(x + r, x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x.to(sum_ptr.dtype.element_ty), mask=ok)
    var = tl.div_rn(tl.sum(x * x, 0), n.to(tl.float32))  # an IEEE division, as torch's mean's
    normed = _round(x * tl.math.rsqrt(var + eps), x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _round(w * normed, out_ptr.dtype.element_ty)  # weight * x in torch's promoted dtype
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE:  # torch's CUDA silu: x / (1 + expf(-x)), an IEEE division
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = _round(tl.div_rn(gate, 1.0 + e), out_ptr.dtype.element_ty)  # F.silu rounds to gate's dtype
    y = _round(silu * up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(x_ptr, out_ptr, cos_ptr, sin_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, stride_c, heads,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token ``t``'s ``heads`` heads: x * cos + rotate_half(x) * sin, each product and the sum
    rounded to x's dtype, as torch's ops round them."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < heads) & (d < HALF)
    dt = x_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)  # (1, HALF)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    x = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)  # (H, HALF): the first halves
    x2 = tl.load(x + HALF, mask=ok, other=0.0).to(tl.float32)
    out1 = _round(_round(x1 * c1, dt) + _round(-x2 * s1, dt), dt)
    out2 = _round(_round(x2 * c2, dt) + _round(x1 * s2, dt), dt)
    o = out_ptr + t * stride_ot + h * stride_oh + d
    tl.store(o, out1.to(dt), mask=ok)
    tl.store(o + HALF, out2.to(dt), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _rotate(q_ptr, q_out_ptr, cos_ptr, sin_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, stride_c,
            NUM_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate(k_ptr, k_out_ptr, cos_ptr, sin_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, stride_c,
            NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., n) as (rows, n) with its last dimension contiguous (a copy only where needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``RMSNorm.forward`` in one launch: x (..., n) -> norm(x); with ``residual`` (x's shape and
    dtype), (norm(x + residual), x + residual). The output's dtype is torch's promotion of the
    weight's and x's (bfloat16 weight, bfloat16 x: bfloat16; float32 weight: float32)."""
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        out2, total2 = out.view(-1, n), total.view(-1, n)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out2, total2, n, eps, x2.stride(0), r2.stride(0),
                                        out2.stride(0), total2.stride(0), HAS_RESIDUAL=residual is not None,
                                        BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False)
    return out if residual is None else (out, total)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) gate|up -> (..., I) silu(gate) * up, in one launch."""
    inter = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(ROW_BLOCK, triton.next_power_of_2(inter))
        out2 = out.view(-1, inter)
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, LIBDEVICE=not interpreted(),
            num_warps=_warps(block), enable_fp_fusion=False)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` in one launch: q (T, nh, hd) and k (T, nkv, hd), any token and head strides
    (views into the fused q|k|v), cos/sin (T, 1, hd) in their dtype -> new contiguous q, k."""
    t, nh, hd = q.shape
    nkv = k.shape[1]
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary needs {name}'s head dimension contiguous, got strides {tuple(x.stride())}")
    if cos.stride() != sin.stride():
        raise ValueError(f"rotary needs cos and sin alike, got strides {tuple(cos.stride())} and {tuple(sin.stride())}")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                     device=k.device)
    if t > 0:
        _rotary_kernel[(t,)](q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
                             NUM_HEADS=nh, NUM_KV_HEADS=nkv, HALF=hd // 2, BLOCK_QH=triton.next_power_of_2(nh),
                             BLOCK_KH=triton.next_power_of_2(nkv), BLOCK_HALF=triton.next_power_of_2(hd // 2),
                             num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


class TritonRMSNorm(nn.Module):
    """A ``layers.norm.RMSNorm`` computed by ``rms_norm``: its weight and eps, shared."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As ``RMSNorm.forward``: norm(x), or with ``residual`` (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


class TritonSiluAndMul(nn.Module):
    """``layers.activation.SiluAndMul`` computed by ``silu_mul``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

"""The batched LoRA product on CUDA: a shrink and an expand kernel indexed by each token's slot.

As punica's and S-LoRA's kernels do, each token reads only its own adapter's weights: the
shrink computes s = x a[slot]^T (T, PR) for every token, the expand adds s bt[slot] to the
base output y (T, out) in place. A token of slot 0 (the base model) returns at once in both: a
step's base rows cost a load of their slot index. Both accumulate in float32 and are GEMVs per
token (a program per token and tile of outputs): LoRA's rank is small, so a step's cost is
reading the step's adapters' weights, once per token, from L2 when tokens share an adapter.

Tested in Triton's interpreter on the CPU against the torch formulation
(tests/engine/test_lora_kernels.py), like the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(x_ptr, a_ptr, s_ptr, slots_ptr, K, R, stride_x, stride_as, stride_ar, stride_s,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """s[t, r-tile] = x[t] . a[slot[t], r, :] over K; zeros for slot 0."""
    t = tl.program_id(0)
    r_offs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot != 0:
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_x + k_offs, mask=k_offs < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + r_offs[:, None] * stride_ar + k_offs[None, :],
                        mask=(r_offs[:, None] < R) & (k_offs[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xv[None, :], axis=1)
    tl.store(s_ptr + t * stride_s + r_offs, acc, mask=r_offs < R)


@triton.jit
def _expand(s_ptr, bt_ptr, y_ptr, slots_ptr, N, R, stride_s, stride_bs, stride_br, stride_y,
            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[t, n-tile] += s[t] . bt[slot[t], :, n-tile]; nothing for slot 0."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot != 0:
        n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_offs = r0 + tl.arange(0, BLOCK_R)
            sv = tl.load(s_ptr + t * stride_s + r_offs, mask=r_offs < R, other=0.0)
            b = tl.load(bt_ptr + slot * stride_bs + r_offs[:, None] * stride_br + n_offs[None, :],
                        mask=(r_offs[:, None] < R) & (n_offs[None, :] < N), other=0.0).to(tl.float32)
            acc += tl.sum(b * sv[:, None], axis=0)
        y_ptrs = y_ptr + t * stride_y + n_offs
        y = tl.load(y_ptrs, mask=n_offs < N, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=n_offs < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x (T, K), a (S, R, K), slots (T,) -> s (T, R) float32."""
    t, r = x.shape[0], a.shape[1]
    s = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t:
        block_r = min(64, triton.next_power_of_2(r))
        _shrink[(t, triton.cdiv(r, block_r))](x, a, s, slots, x.shape[1], r, x.stride(0), a.stride(0), a.stride(1),
                                             s.stride(0), BLOCK_R=block_r, BLOCK_K=64)
    return s


def lora_expand(s: torch.Tensor, bt: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y (T, N) += s (T, R) bt[slot] (R, N), in place; returns y."""
    t, n = y.shape
    if t:
        block_r = min(64, triton.next_power_of_2(bt.shape[1]))
        _expand[(t, triton.cdiv(n, 128))](s, bt, y, slots, n, bt.shape[1], s.stride(0), bt.stride(0), bt.stride(1),
                                          y.stride(0), BLOCK_N=128, BLOCK_R=block_r)
    return y


class TritonLoRA:
    """``LoRALinear``'s kernel on CUDA (lora/kernels.py): shrink, then expand into the base output."""

    name = "triton"

    def repack(self, layer, slot: int | None = None) -> None:
        """The kernels read the slots as they are."""

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        x, y = x.contiguous(), y.contiguous()
        return lora_expand(lora_shrink(x, layer.a, state.slots), layer.bt, y, state.slots)

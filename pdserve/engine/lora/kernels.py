"""The batched LoRA product of one linear: every token through its own adapter, in one pass.

A linear's adapters live in slots (``LoRALinear``): ``a`` (S, PR, in) and ``bt`` (S, PR, out),
slot 0 all zeros (the base model), PR = parts x max rank (a fused linear's parts each have their
own rank block). A token in slot i adds ``(x a[i]^T) bt[i]`` to the base output: the shrink
x (in) -> (PR), then the expand (PR) -> (out). No loop over requests or rows in Python; three
ways, by device:

- ``TorchLoRA``: any device. Gather-free: x times every adapter slot's A at once
  (T, (S-1) PR), each token's other slots' columns zeroed by a one-hot mask, times every slot's
  B at once. It costs S-1 adapters' worth of the small products for each token, which at the
  few slots a step uses (S <= max_loras + 1, PR ~ 3 x 16) is cheaper than gathering a weight
  per token.
- ``PackedLoRA``: the same two products through pdserve's packed CPU kernels
  (pdserve/engine/kernels/csrc/linear.cpp), whose every output is summed in one fixed order:
  a token's delta is bitwise the same whatever else is in its batch, as the base linears'.
  Slots are packed again when an adapter enters one (``repack``).
- ``TritonLoRA`` (lora/triton_ops.py): CUDA. A shrink and an expand kernel that read each
  token's slot index and only that slot's weights (punica's and S-LoRA's scheme); base tokens
  (slot 0) skip both.
"""

from __future__ import annotations

import torch


class TorchLoRA:
    """The gather-free formulation in torch (module docstring)."""

    name = "torch"

    def repack(self, layer) -> None:
        """Nothing cached beyond the slots themselves."""

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        """y (T, out) plus each token's delta, in place where it can; x (T, in); ``state`` a
        ``LoRAState`` (each token's slot and its one-hot mask)."""
        a, bt = layer.a[1:], layer.bt[1:]  # (S-1, PR, in), (S-1, PR, out): slot 0 adds nothing
        s, pr = a.shape[0], a.shape[1]
        shrunk = x.to(a.dtype) @ a.reshape(s * pr, -1).t()  # (T, (S-1) PR)
        shrunk = (shrunk.view(-1, s, pr) * state.mask.to(shrunk.dtype)).view(-1, s * pr)
        return y.add_((shrunk @ bt.reshape(s * pr, -1)).to(y.dtype))


class PackedLoRA:
    """The gather-free formulation on pdserve's packed, batch-invariant CPU kernels."""

    name = "packed-cpu"

    def repack(self, layer) -> None:
        """Pack every adapter slot's A (S-1) PR x in and B^T out x (S-1) PR for the kernels."""
        a, bt = layer.a[1:], layer.bt[1:]
        layer.packed_a = torch.ops.pdserve.linear_pack(a.reshape(-1, a.shape[-1]).contiguous())
        layer.packed_b = torch.ops.pdserve.linear_pack(bt.reshape(-1, bt.shape[-1]).t().contiguous())

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        s, pr = layer.a.shape[0] - 1, layer.a.shape[1]
        shrunk = torch.ops.pdserve.linear(x, layer.packed_a, s * pr, None, False)  # (T, (S-1) PR)
        shrunk = (shrunk.view(-1, s, pr) * state.mask.to(shrunk.dtype)).view(-1, s * pr)
        delta = torch.ops.pdserve.linear(shrunk, layer.packed_b, layer.bt.shape[-1], None, y.dtype == torch.float32)
        return y.add_(delta.to(y.dtype))


def select_kernel(device: torch.device, linear_backend: str):
    """Triton on CUDA (where it imports), the packed kernels where the model's linears are
    packed (their dtype and instruction set), torch otherwise."""
    if device.type == "cuda":
        try:
            from pdserve.engine.lora.triton_ops import TritonLoRA
        except ImportError:
            return TorchLoRA()
        return TritonLoRA()
    if linear_backend.startswith("packed-cpu"):
        return PackedLoRA()
    return TorchLoRA()

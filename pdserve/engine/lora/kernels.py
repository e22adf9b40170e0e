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


class SegmentedLoRA:
    """Each token through its own adapter only, on pdserve's packed, batch-invariant CPU kernels.

    The step's adapter tokens are gathered once per linear, sorted by slot (``LoRAState.segments``,
    made once a step for every layer); each active slot's run of rows is shrunk by that slot's A
    alone and expanded, part by part of a fused linear, by that part's own rank block of B alone
    (no other slot's columns, no zero blocks); the deltas go back to their rows with one
    ``index_add_`` (each row once: no sum whose order could vary). A loop over the step's active
    slots (at most max_loras) and a fused linear's parts, never over requests or rows. Every
    product is a packed-kernel call whose rows are summed in one fixed order, so a token's delta
    is bitwise the same whatever else is in its batch."""

    name = "segmented-cpu"

    def repack(self, layer) -> None:
        """Per slot: A (PR, in) packed whole; per part, the rank block of B that feeds the part's
        output columns (found from the nonzero rows: part p's own block, or block 0 where a fused
        module was adapted whole), packed alone."""
        a, bt = layer.a, layer.bt
        pr, sizes = a.shape[1], getattr(layer, "local_sizes", None) or [bt.shape[-1]]
        width = pr // len(sizes)
        starts = [sum(sizes[:p]) for p in range(len(sizes))]
        layer.seg_a, layer.seg_b = [None], [None]
        for slot in range(1, a.shape[0]):
            layer.seg_a.append(torch.ops.pdserve.linear_pack(a[slot].contiguous()))
            parts = []
            for p, (start, size) in enumerate(zip(starts, sizes)):
                cols = bt[slot, :, start:start + size]
                blocks = [k for k in range(len(sizes)) if cols[k * width:(k + 1) * width].any()] or [p]
                lo, hi = (min(blocks) * width, (max(blocks) + 1) * width)
                parts.append((lo, hi, size, torch.ops.pdserve.linear_pack(cols[lo:hi].t().contiguous())))
            layer.seg_b.append(parts)

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        order, runs = state.segments()
        if not runs:
            return y
        xs = x.index_select(0, order)
        pr, f32 = layer.a.shape[1], y.dtype == torch.float32
        deltas = []
        for slot, start, end in runs:
            shrunk = torch.ops.pdserve.linear(xs[start:end], layer.seg_a[slot], pr, None, False)
            parts = [torch.ops.pdserve.linear(shrunk[:, lo:hi] if hi - lo < pr else shrunk, packed, size, None, f32)
                     for lo, hi, size, packed in layer.seg_b[slot]]
            deltas.append(parts[0] if len(parts) == 1 else torch.cat(parts, 1))
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        return y.index_add_(0, order, delta.to(y.dtype))


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
        return SegmentedLoRA()
    return TorchLoRA()

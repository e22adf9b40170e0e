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
- ``PackedLoRA``: the same shrink through pdserve's packed CPU kernels
  (pdserve/engine/kernels/csrc/linear.cpp), whose every output is summed in one fixed order:
  a token's delta is bitwise the same whatever else is in its batch, as the base linears'.
  The expand runs once per part of a fused linear (q, k, v; gate, up), over that part's own
  rank blocks and into its own output columns (``ExpandPlan``): the full-width expand would
  also multiply every other part's zero blocks. Slots are packed again when an adapter enters
  one (``repack``).
- ``TritonLoRA`` (lora/triton_ops.py): CUDA. A shrink and an expand kernel that read each
  token's slot index and only that slot's weights (punica's and S-LoRA's scheme); base tokens
  (slot 0) skip both.
"""

from __future__ import annotations

import torch


class TorchLoRA:
    """The gather-free formulation in torch (module docstring)."""

    name = "torch"

    def repack(self, layer, slot: int | None = None) -> None:
        """Nothing cached beyond the slots themselves."""

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        """y (T, out) plus each token's delta, in place where it can; x (T, in); ``state`` a
        ``LoRAState`` (each token's slot and its one-hot mask)."""
        a, bt = layer.a[1:], layer.bt[1:]  # (S-1, PR, in), (S-1, PR, out): slot 0 adds nothing
        s, pr = a.shape[0], a.shape[1]
        shrunk = x.to(a.dtype) @ a.reshape(s * pr, -1).t()  # (T, (S-1) PR)
        shrunk = (shrunk.view(-1, s, pr) * state.mask.to(shrunk.dtype)).view(-1, s * pr)
        return y.add_((shrunk @ bt.reshape(s * pr, -1)).to(y.dtype))


class ExpandPlan:
    """Where each part's expand reads its input: for part p of a linear of P parts, rank R
    (``max_lora_rank``) and S1 adapter slots, slot j's R masked shrink columns
    (j PR + p R .. +R of the shrink's (T, S1 PR) output) go to a block of W = R rounded up to
    even at j W + o, o = (j PR + p R) mod 2, every other column zero. The part's B rows sit at
    the same places (``packed_b(p)``), so the expand sums the same nonzero products as the
    full-width one did, in the same order and in the same pairs of k (the avx512_bf16 and amx
    kernels add two products a step): only all-zero terms and pairs are left out, which add
    exactly nothing to a float32 sum that starts at +0. So the deltas keep their bits.

    ``columns``: each part's (first output column, width); ``index``: each part's (S1 W,)
    gather index into the masked shrink with one zero column appended (index S1 PR)."""

    def __init__(self, slots: int, rank: int, sizes: list[int]):
        parts = len(sizes)
        pr, width = parts * rank, rank + rank % 2
        self.slots, self.rank, self.width = slots, rank, width
        starts = [sum(sizes[:p]) for p in range(parts)]
        self.columns = list(zip(starts, sizes))
        self.index = []
        for p in range(parts):
            index = torch.full((slots * width,), slots * pr, dtype=torch.int64)
            for j in range(slots):
                source = j * pr + p * rank
                at = j * width + source % 2
                index[at:at + rank] = torch.arange(source, source + rank)
            self.index.append(index)

    @staticmethod
    def rows(bt: torch.Tensor) -> torch.Tensor:
        """``bt`` (S1, PR, out) as (S1 PR + 1, out) rows, the last one zero: what ``index`` picks from."""
        return torch.cat([bt.reshape(-1, bt.shape[-1]), bt.new_zeros(1, bt.shape[-1])])

    def packed_b(self, rows: torch.Tensor, part: int, slot: int | None = None) -> torch.Tensor:
        """Part ``part``'s B for the kernels from ``rows`` (``ExpandPlan.rows``): (out_p, S1 W)
        packed, or with ``slot`` that slot's block alone, (out_p, W) (the whole-stack call's
        per-slot expand of a long step, pdserve/engine/kernels/csrc/decoder_lora.cpp)."""
        start, size = self.columns[part]
        index = self.index[part] if slot is None else self.index[part][slot * self.width:(slot + 1) * self.width]
        return torch.ops.pdserve.linear_pack(rows[index, start:start + size].t().contiguous())


class PackedLoRA:
    """The gather-free formulation on pdserve's packed, batch-invariant CPU kernels: one shrink
    over every slot, one expand per part (``ExpandPlan``)."""

    name = "packed-cpu"

    def __init__(self) -> None:
        self.generation = 0  # counts repacks: a holder of packed slots lists them again when it moves

    def repack(self, layer, slot: int | None = None) -> None:
        """Pack every adapter slot's A, (S-1) PR x in, and each part's B^T, out_p x (S-1) W; and
        each slot's alone, for the whole-stack call's per-slot products (LoRAStack): all of
        them, or with ``slot`` (the one that changed) only that slot's own.
        ``layer.local_sizes``: the parts' output widths (one part, all of ``bt``, if absent)."""
        self.generation += 1
        a, bt = layer.a[1:], layer.bt[1:]
        sizes = list(getattr(layer, "local_sizes", [bt.shape[-1]]))
        plan = ExpandPlan(a.shape[0], a.shape[1] // len(sizes), sizes)
        rows = plan.rows(bt)
        layer.expand_plan = plan
        layer.packed_a = torch.ops.pdserve.linear_pack(a.reshape(-1, a.shape[-1]).contiguous())
        layer.packed_b = [plan.packed_b(rows, p) for p in range(len(sizes))]
        if slot is None or not hasattr(layer, "packed_a_slots"):
            layer.packed_a_slots, layer.packed_b_slots = [None] * a.shape[0], [None] * a.shape[0]
            changed = range(a.shape[0])
        else:
            changed = [slot - 1]
        for j in changed:
            layer.packed_a_slots[j] = torch.ops.pdserve.linear_pack(a[j].contiguous())
            layer.packed_b_slots[j] = [plan.packed_b(rows, p, j) for p in range(len(sizes))]

    def add(self, layer, x: torch.Tensor, y: torch.Tensor, state) -> torch.Tensor:
        s, pr = layer.a.shape[0] - 1, layer.a.shape[1]
        shrunk = torch.ops.pdserve.linear(x, layer.packed_a, s * pr, None, False)  # (T, (S-1) PR)
        shrunk = (shrunk.view(-1, s, pr) * state.mask.to(shrunk.dtype)).view(-1, s * pr)
        shrunk = torch.cat([shrunk, shrunk.new_zeros(shrunk.shape[0], 1)], dim=1)  # column S1 PR: the zeros' source
        f32 = y.dtype == torch.float32
        for index, packed, (start, size) in zip(layer.expand_plan.index, layer.packed_b, layer.expand_plan.columns):
            delta = torch.ops.pdserve.linear(shrunk.index_select(1, index), packed, size, None, f32)  # (T, out_p)
            y[:, start:start + size].add_(delta.to(y.dtype))
        return y


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

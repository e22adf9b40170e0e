"""LoRA on the model's parallel linears: each adapted linear wrapped in a ``LoRALinear``.

``attach`` wraps, after loading (the linears may already be a backend's packed modules,
pdserve/engine/linear.py), every q|k|v, o, gate|up and down projection of the decoder layers.
A wrapper holds its adapters' weights in slots on the device:

- ``a`` (S, P*R, in_local): slot i's A of each of the linear's P parts (q, k, v; gate, up; or
  the one part of o and down), part p in rows [p R, p R + r); R = max_lora_rank, rows past an
  adapter's own rank r stay zero;
- ``bt`` (S, P*R, out_local): slot i's B, transposed (the expand reads it row by row), part p's
  rows in part p's rank block and its output columns, the scale folded in; so part p's output
  columns depend on rank block p alone, and a kernel may expand each part by itself. A fused
  checkpoint module adapted whole (Phi-3's ``qkv_proj``: one A for every part) keeps a copy of
  its A in every part's block, which costs the shrink nothing (it computes every block anyway);
- S = max_loras + 1: slot 0 is all zeros, the base model's.

Tensor parallelism, as the weights split: a column-parallel linear (q|k|v, gate|up) keeps A
whole and this rank's output columns of B; a row-parallel one (o, down) keeps this rank's input
columns of A and B whole, so each rank's partial x_r A_r^T B^T sums in the all-reduce that
completes the base output (it is linear in x_r).

``LoRAState`` is the step's per-token slot index, shared by every wrapper of a model; the model
runner sets it before each forward (``LoRAManager.begin_step``). With no adapter in the step
(``active`` False) a wrapper returns its base linear's output untouched: the step computes as
without LoRA, bit for bit, at no extra cost, and the whole-stack CPU kernel
(``PackedDecoderStack``) still runs such steps (``LoRAStack``). A step with adapters runs that
one call too, with the LoRA products inside it (``decoder_layers_lora``), where the linears'
LoRA kernel is ``PackedLoRA``; elsewhere its layers run one by one through the wrappers.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.lora.kernels import PackedLoRA
from pdserve.engine.lora.peft import LoRAAdapter, TargetShape
from pdserve.engine.models.decoder import DecoderStack
from pdserve.engine.parallel import TensorParallel


class LoRAState:
    """The step's adapters: ``slots`` (T,) int64 on the device, each token's slot (0: the base
    model); ``mask`` (T, S-1, 1) in the model dtype, 1 where a token's slot is slot 1 + j (the
    CPU formulation's one-hot, made once a step for every layer); ``active``, whether any token
    of the step has an adapter."""

    def __init__(self, num_slots: int = 1, dtype: torch.dtype = torch.float32) -> None:
        self.num_slots, self.dtype = num_slots, dtype
        self.active = False
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def set(self, slots: torch.Tensor | None) -> None:
        self.active, self.slots, self.mask = slots is not None, slots, None
        if slots is not None:
            adapters = torch.arange(1, self.num_slots, device=slots.device)
            self.mask = (slots[:, None] == adapters).to(self.dtype)[:, :, None]


class LoRALinear(nn.Module):
    """``base(x)`` plus each token's adapter (module docstring). ``row``: the linear is
    row-parallel (A split by input columns) rather than column-parallel (B by output rows)."""

    def __init__(self, base: nn.Module, shape: TargetShape, row: bool, tp: TensorParallel, num_slots: int,
                 max_rank: int, state: LoRAState, kernel, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.shape, self.row, self.tp = base, shape, row, tp
        self.state, self.kernel, self.max_rank = state, kernel, max_rank
        parts = len(shape.part_sizes)
        in_local = shape.in_features // tp.size if row else shape.in_features
        self.local_sizes = list(shape.part_sizes) if row else [n // tp.size for n in shape.part_sizes]
        self.register_buffer("a", torch.zeros(num_slots, parts * max_rank, in_local, dtype=dtype, device=device))
        self.register_buffer("bt", torch.zeros(num_slots, parts * max_rank, sum(self.local_sizes), dtype=dtype,
                                               device=device))
        kernel.repack(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.state.active:
            return y
        lead = x.shape[:-1]
        out = self.kernel.add(self, x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]), self.state)
        return out.view(*lead, out.shape[-1])

    def fill(self, slot: int, adapter: LoRAAdapter, module: str) -> None:
        """Put this rank's share of ``adapter``'s weights for this linear (``module``, our name)
        into ``slot``; zeros where the adapter leaves a part unadapted."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for index, part in enumerate(self.shape.parts):
            if (module, part) in adapter.weights:
                self._fill_part(slot, index, index, *adapter.weights[(module, part)])
        if (module, None) in adapter.weights and len(self.shape.parts) > 1:  # a fused module adapted whole
            a, b = adapter.weights[(module, None)]
            for index, rows in enumerate(b.split(list(self.shape.part_sizes))):
                self._fill_part(slot, index, index, a, rows)  # the one A copied into every part's block
        self.kernel.repack(self, slot)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.kernel.repack(self, slot)

    def _fill_part(self, slot: int, block: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A (r, in) into rank block ``block``, B (out_part, r) of part ``part`` beside it, each
        cut to this rank's share."""
        r, rank, size = a.shape[0], self.tp.rank, self.tp.size
        if self.row:
            cols = a.shape[1] // size
            a = a[:, rank * cols:(rank + 1) * cols]
        else:
            rows = b.shape[0] // size
            b = b[rank * rows:(rank + 1) * rows]
        start = sum(self.local_sizes[:part])
        self.a[slot, block * self.max_rank:block * self.max_rank + r].copy_(a)
        self.bt[slot, block * self.max_rank:block * self.max_rank + r, start:start + b.shape[0]].copy_(b.t())


# A step of this many tokens or more (a prefill, a large decode batch) runs the whole-stack call's
# LoRA products slot by slot: a quarter of the multiply-adds at four adapters, with the same bits
# (decoder_lora.h); below it the gather-free form's fewer kernel calls cost less. Measured on
# SmolLM2-135M with four adapters (BENCHMARKS.md): on the AVX-512 EPYC gather-free ahead at 4 and
# 16 tokens, slot by slot ahead at 32 and in prefills; on the AVX2-only EPYC, whose 8-lane FMAs
# make each multiply-add dearer against a call, slot by slot from 8 tokens served four adapters
# mixed at 0.88-0.95 of the base model against 0.76-0.88 at 24 (concurrency 16).
SEGMENT_TOKENS = 24
SEGMENT_TOKENS_BY_PATH = {"avx2": 8}


def segment_tokens() -> int:
    """``SEGMENT_TOKENS`` for the CPU kernel path in force."""
    from pdserve.engine.kernels import cpu_kernels

    return SEGMENT_TOKENS_BY_PATH.get(cpu_kernels.isa(), SEGMENT_TOKENS) if cpu_kernels.is_loaded() else SEGMENT_TOKENS


class LoRAStack(nn.Module):
    """The decoder stack around the backend's whole-stack call (``packed``): a step without
    adapters runs it as it is; a step with adapters runs ``decoder_layers_lora``, the same one
    call with each projection's LoRA delta added inside it in ``PackedLoRA``'s arithmetic
    (pdserve/engine/kernels/csrc/decoder_lora.cpp), so its bits are the layer-by-layer path's.
    ``projections``: each layer's q|k|v, o, gate|up and down ``LoRALinear``, or None where the
    one call cannot take them (a projection not adapted, another LoRA kernel); then, and with
    another attention backend, a step with adapters runs the layers one by one.
    ``segment_tokens``: the step size from which the one call runs the products slot by slot
    (0: never), the same bits by fewer multiply-adds (``segment_tokens()``)."""

    def __init__(self, packed: nn.Module, state: LoRAState, projections: list[list[LoRALinear]] | None):
        super().__init__()
        self.packed, self.plain, self.state = packed, DecoderStack(), state
        self.projections = projections
        # Each projection's parts, their output widths and the rank blocks' width R (fixed at attach).
        first = [] if projections is None else projections[0]
        self.parts = [len(w.local_sizes) for w in first]
        self.part_sizes = [size for w in first for size in w.local_sizes]
        self.rank = first[0].max_rank if first else 0
        self.segment_tokens = segment_tokens()
        self._listed = None  # (the kernel's generation, the call's weight lists): _weights

    def forward(self, layers, h, rope, ctx):
        if not self.state.active:
            return self.packed(layers, h, rope, ctx)
        if self.projections is None or not self.packed.runs(layers):
            return self.plain(layers, h, rope, ctx)
        shrink, expand, shrink_slots, expand_slots = self._weights()
        if 0 < self.segment_tokens <= h.shape[0]:  # slot by slot: the gather-free lists are not read
            shrink, expand = [], []
        else:  # gather-free: nor are the slot by slot ones (1,320 tensors at 30 layers, 4 slots)
            shrink_slots, expand_slots = [], []
        return torch.ops.pdserve.decoder_layers_lora(*self.packed.arguments(layers, h, rope, ctx), shrink, expand,
                                                     shrink_slots, expand_slots, self.parts, self.part_sizes,
                                                     self.rank, self.state.mask, self.segment_tokens)

    def _weights(self) -> tuple[list, list, list, list]:
        """Every projection's packed slots in the call's order: the shrinks, the expands (one per
        part), then the same slot by slot. Listed again only after a slot was repacked (the
        kernel's ``generation``), not on every step: they are some 1,600 tensors."""
        generation = self.projections[0][0].kernel.generation
        if self._listed is None or self._listed[0] != generation:
            linears = [w for layer in self.projections for w in layer]
            self._listed = (generation, ([w.packed_a for w in linears], [b for w in linears for b in w.packed_b],
                                         [a for w in linears for a in w.packed_a_slots],
                                         [slot[q] for w in linears for q in range(len(w.packed_b))
                                          for slot in w.packed_b_slots]))
        return self._listed[1]


# Our linears an adapter may adapt, by their name in a decoder layer, and whether each is row-parallel.
_TARGETS = {"self_attn.qkv_proj": False, "self_attn.o_proj": True, "mlp.gate_up_proj": False, "mlp.down_proj": True}


def target_shapes(model) -> dict[str, tuple[TargetShape, bool]]:
    """The model's LoRA-able linears at whole-model sizes: our module name -> (shape, row-parallel).
    Read from the config (the linears may be packed already): Llama's geometry, checked against
    each linear's own sizes so that a family whose projections differ is not adapted wrongly."""
    cfg, tp = model.cfg, model.tp
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"self_attn.qkv_proj": TargetShape(cfg.hidden_size, (q, kv, kv), ("q", "k", "v")),
              "self_attn.o_proj": TargetShape(q, (cfg.hidden_size,), (None,)),
              "mlp.gate_up_proj": TargetShape(cfg.hidden_size, (cfg.intermediate_size,) * 2, (0, 1)),
              "mlp.down_proj": TargetShape(cfg.intermediate_size, (cfg.hidden_size,), (None,))}
    found = {}
    for i, layer in enumerate(model.layers):
        for name, row in _TARGETS.items():
            module = layer.get_submodule(name) if _has(layer, name) else None
            shape = shapes[name]
            local_in = shape.in_features // tp.size if row else shape.in_features
            local_out = sum(shape.part_sizes) if row else sum(shape.part_sizes) // tp.size
            if module is not None and (module.in_features, module.out_features) == (local_in, local_out):
                found[f"layers.{i}.{name}"] = (shape, row)
    return found


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def attach(model, num_slots: int, max_rank: int, kernel, dtype: torch.dtype,
           device: torch.device) -> tuple[LoRAState, dict[str, LoRALinear]]:
    """Wrap the model's LoRA-able linears in place; returns the shared state and the wrappers
    by our module name."""
    state, wrapped = LoRAState(num_slots, dtype), {}
    for name, (shape, row) in target_shapes(model).items():
        parent_name, child = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        wrapper = LoRALinear(getattr(parent, child), shape, row, model.tp, num_slots, max_rank, state, kernel,
                             dtype, device)
        setattr(parent, child, wrapper)
        wrapped[name] = wrapper
    if type(model.stack) is not DecoderStack:  # a backend's whole-stack call, with adapters inside it where it can
        model.stack = LoRAStack(model.stack, state, _stack_projections(model, wrapped, kernel))
    return state, wrapped


def _stack_projections(model, wrapped: dict[str, LoRALinear], kernel) -> list[list[LoRALinear]] | None:
    """Each layer's four wrapped projections in ``decoder_layers_lora``'s order, where the
    whole-stack call can add their deltas: the backend's stack is ``PackedDecoderStack``, the
    kernel ``PackedLoRA`` (its packed slots) and every layer has all four wrapped."""
    if not isinstance(model.stack, PackedDecoderStack) or not isinstance(kernel, PackedLoRA):
        return None
    names = [f"layers.{i}.{name}" for i in range(len(model.layers)) for name in _TARGETS]
    if not all(name in wrapped for name in names):
        return None
    return [[wrapped[f"layers.{i}.{name}"] for name in _TARGETS] for i in range(len(model.layers))]

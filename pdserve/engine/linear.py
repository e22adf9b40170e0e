"""How a model's projections, RMSNorms and LM head compute: one ``LinearBackend`` per model.

The model (pdserve/engine/models/) is built from ``nn.Linear`` (layers/linear.py), ``RMSNorm`` and ``SiluAndMul`` modules so
that weights load by name. ``select_backend(dtype, device)`` then picks a backend once, at
load, and ``apply_backend`` swaps those modules for the backend's own (a transform of an
unchanged model, never a branch inside it):

- ``TorchBackend``: leaves everything to torch (any dtype on CUDA; a CPU without AVX2 + FMA).
- ``PackedCpuBackend``: bfloat16 on an x86-64 CPU with AVX2 + FMA (linears, norms, and
  the MLP's silu * up fused into one pass). Weights are packed once into panels for
  pdserve's kernels (pdserve/engine/kernels/csrc/linear.cpp) on the processor's fastest instruction-set
  path (AVX2, AVX-512, AVX-512 BF16 or AMX; ``PDSERVE_CPU_ISA`` pins one). Every output
  element is one float32 accumulator updated over k in a fixed order, so a row's result is
  bitwise the same alone or in a batch of any size, at any thread count, on that processor
  (not across processors: AVX-512 BF16 and AMX sum pairs of products). The LM head writes
  float32 logits straight from the float32 sums.
- ``PackedCpuBackend(torch.float32)``: float32 on such a CPU. The linears and the LM head
  run the same kernels on float32 panels, for the same reason: torch's float32 matmul picks
  its summation order by the number of rows, so a sequence's greedy tokens could change with
  its batch at a near-tie (it did: two logits 1e-5 apart on the default model gave one token
  alone and another in a batch of 16). RMSNorm and silu * up stay torch's, which are
  row-local (and are ``transformers``' own ops, so float32 stays close to it).

Packing replaces each ``nn.Linear`` (its bfloat16 weight is freed), so the linears' weight
memory is not doubled. A tied LM head is the exception: the embedding table stays for
lookups and the head gets its packed copy (vocab x hidden bfloat16, 57 MB for SmolLM2-135M;
at tensor-parallel size N each rank packs only its 1/N of the vocabulary rows).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.attention.paged import PagedAttention
from pdserve.engine.layers.activation import SiluAndMul
from pdserve.engine.layers.linear import RowParallelLinear
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.models.decoder import Attention, CausalLM, DecoderStack


class TorchBackend:
    """torch's own kernels: not batch-invariant on CPU (oneDNN and MKL pick kernels, and
    summation orders, by M and by instruction set)."""

    name = "torch"
    batch_invariant = False

    def linear(self, layer: nn.Linear, f32_out: bool = False) -> nn.Module:
        return layer  # its output in the model dtype: NCCL sums bfloat16 as it is

    def norm(self, norm: RMSNorm) -> nn.Module:
        return norm

    def act(self, act: SiluAndMul) -> nn.Module:
        return act

    def logits_head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        return None  # CausalLM computes F.linear(hidden, weight).float(), as transformers does

    def stack(self, layers: nn.ModuleList) -> nn.Module | None:
        return None  # the layers run one by one


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` through ``torch.ops.pdserve.linear`` on weights packed at load.

    x (..., K) in the weight's dtype (bfloat16 or float32) -> (..., N) in that dtype, or
    float32 when ``f32_out`` (the LM head; a row-parallel linear at tensor-parallel size > 1).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, f32_out: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.f32_out = f32_out
        self.register_buffer("packed", torch.ops.pdserve.linear_pack(weight.detach()))  # (N/16, K, 16)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.pdserve.linear(x.reshape(-1, self.in_features), self.packed, self.out_features,
                                     self.bias, self.f32_out)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, f32_out={self.f32_out}"


class PackedRMSNorm(nn.Module):
    """RMSNorm through ``torch.ops.pdserve.rms_norm``: row-local, one fixed reduction order."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As ``RMSNorm.forward``; with ``residual``, the add runs in the same pass (``add_rms_norm``)."""
        if residual is None:
            return torch.ops.pdserve.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        y, h = torch.ops.pdserve.add_rms_norm(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]),
                                              self.weight, self.eps)
        return y.view(x.shape), h.view(x.shape)


class PackedSiluAndMul(nn.Module):
    """silu(gate) * up in one pass (``torch.ops.pdserve.silu_mul``): elementwise, fixed exp."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(
            *gate_up.shape[:-1], gate_up.shape[-1] // 2)


class PackedDecoderStack(DecoderStack):
    """The whole bfloat16 decoder stack in one call (``torch.ops.pdserve.decoder_layers``,
    pdserve/engine/kernels/csrc/decoder.cpp): the layers' own packed operators in their own order, called
    from C++, so the step pays Python's dispatch once instead of ~300 times. Bitwise the
    layer-by-layer result. Needs the paged-attention kernel; with another attention backend
    (``attention_backend="sdpa"``) the layers run one by one, as ``DecoderStack`` runs them.

    The weight lists reference the layers' packed tensors (no copy); they are built once,
    after packing, which is the last time the weights change.
    """

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        attn = [layer.self_attn for layer in layers]
        mlp = [layer.mlp for layer in layers]
        self.input_norm = [layer.input_layernorm.weight.data for layer in layers]
        self.post_norm = [layer.post_attention_layernorm.weight.data for layer in layers]
        self.qkv = [a.qkv_proj.packed for a in attn]
        self.qkv_bias = [a.qkv_proj.bias for a in attn]
        self.o = [a.o_proj.packed for a in attn]
        self.gate_up = [m.gate_up_proj.packed for m in mlp]
        self.down = [m.down_proj.packed for m in mlp]
        self.widths = [attn[0].qkv_proj.out_features, attn[0].o_proj.out_features,
                       mlp[0].gate_up_proj.out_features, mlp[0].down_proj.out_features]
        self.num_heads, self.num_kv_heads = attn[0].nh, attn[0].nkv
        self.eps = layers[0].input_layernorm.eps

    def forward(self, layers: nn.ModuleList, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        backend = layers[0].self_attn.backend
        if not isinstance(backend, PagedAttention):
            return super().forward(layers, h, rope, ctx)
        k_caches = [layer.self_attn.k_cache for layer in layers]
        v_caches = [layer.self_attn.v_cache for layer in layers]
        return torch.ops.pdserve.decoder_layers(
            h, rope[0], rope[1], self.input_norm, self.qkv, self.qkv_bias, self.o, self.post_norm, self.gate_up,
            self.down, k_caches, v_caches, ctx.slot_block, ctx.slot_offset, ctx.block_tables, ctx.cu_query_lens,
            ctx.context_lens_t, self.widths, self.num_heads, self.num_kv_heads, self.eps, backend.scale)


_fakes_registered = False


def _register_fakes() -> None:
    """Shapes of the kernels' outputs for torch.compile's tracing (FakeTensor), once per process."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("pdserve::linear")
    def _linear(x, packed, n, bias, f32_out):
        return x.new_empty((x.shape[0], n), dtype=torch.float32 if f32_out else x.dtype)

    @torch.library.register_fake("pdserve::rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("pdserve::add_rms_norm")
    def _add_rms_norm(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("pdserve::decoder_layers")
    def _decoder_layers(h, *args):
        return torch.empty_like(h), torch.empty_like(h)

    @torch.library.register_fake("pdserve::silu_mul")
    def _silu_mul(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    _fakes_registered = True


class PackedCpuBackend:
    """pdserve's batch-invariant CPU kernels (pdserve/engine/kernels/csrc/linear.cpp): every linear and the LM
    head in bfloat16 or float32; in bfloat16 the norms and silu * up too."""

    batch_invariant = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the packed CPU kernels run bfloat16 or float32, not {dtype}")
        self.dtype = dtype
        self.name = "packed-cpu" if dtype == torch.bfloat16 else "packed-cpu-f32"
        cpu_kernels.load()
        # The instruction-set path the weights are packed for (pdserve/engine/kernels/csrc/isa.h): fixed per
        # process, so every layer of the model computes the same way.
        self.kernel_path = cpu_kernels.isa()
        _register_fakes()

    def linear(self, layer: nn.Linear, f32_out: bool = False) -> nn.Module:
        return PackedLinear(layer.weight, layer.bias, f32_out)

    def norm(self, norm: RMSNorm) -> nn.Module:
        return PackedRMSNorm(norm) if self.dtype == torch.bfloat16 else norm

    def act(self, act: SiluAndMul) -> nn.Module:
        return PackedSiluAndMul() if self.dtype == torch.bfloat16 else act

    def logits_head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        return PackedLinear(weight, bias, f32_out=True)

    def stack(self, layers: nn.ModuleList) -> nn.Module | None:
        """bfloat16: one call over the whole stack, where the layers are Llama's (the C++ stack
        is that layer, op for op, with attention over every key: a sliding window's layers, or
        another family's, run one by one). float32 keeps torch's norms between the linears, so
        its layers run one by one."""
        llama = all(type(layer.self_attn) is Attention and layer.self_attn.window is None
                    and type(layer.mlp) is GatedMLP for layer in layers)
        return PackedDecoderStack(layers) if self.dtype == torch.bfloat16 and llama else None


LinearBackend = TorchBackend | PackedCpuBackend


def select_backend(dtype: torch.dtype, device: torch.device) -> LinearBackend:
    """The packed kernels for bfloat16 and float32 on an AVX2 + FMA CPU; torch's everywhere else."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and cpu_kernels.cpu_supported():
        return PackedCpuBackend(dtype)
    return TorchBackend()


def apply_backend(model: CausalLM, backend: LinearBackend) -> CausalLM:
    """Swap ``model``'s linears, norms and LM head for ``backend``'s, in place (after loading).

    At tensor-parallel size > 1, a row-parallel linear (o_proj, down_proj) hands its partial
    sums on in float32, as its kernel accumulates them: the all-reduce adds them there and the
    model rounds once to bfloat16, where bfloat16 partials would round once per rank first.
    The whole-stack call runs only at size 1 (the all-reduces happen between its layers)."""
    split = model.tp.size > 1
    # Parents only, by name: a list of every module would keep each replaced linear (and its
    # weight) alive until the end, doubling the weights' memory while packing (a 1B model
    # peaked at 4.6 GiB for 3.2 steady); so each is freed as its packed copy takes its place.
    for parent_name in [n for n, m in model.named_modules() if any(True for _ in m.children())]:
        parent = model.get_submodule(parent_name)
        for name in [n for n, _ in parent.named_children()]:
            child = getattr(parent, name)
            if isinstance(child, nn.Linear):
                f32_out = split and isinstance(child, RowParallelLinear) and child.f32_partials
                setattr(parent, name, backend.linear(child, f32_out=f32_out))
            elif isinstance(child, RMSNorm):
                setattr(parent, name, backend.norm(child))
            elif isinstance(child, SiluAndMul):
                setattr(parent, name, backend.act(child))
            del child
    # Every rank's head: its rows of the vocabulary (layers/vocab.py), tied or not.
    packed_head = backend.logits_head(model.lm_head.matrix(), None)
    if packed_head is not None:
        model.lm_head.use_kernel(packed_head)
    # After the layers are packed: the fused stack holds their packed weights. It runs only at
    # size 1 (the all-reduces happen between its layers) and only the layers it is (packed_stack).
    stack = backend.stack(model.layers) if model.packed_stack and not split else None
    if stack is not None:
        model.stack = stack
    model.linear_backend = backend.name
    model.kernel_path = getattr(backend, "kernel_path", None)
    return model


"""How a model's projections, RMSNorms and LM head compute: one ``LinearBackend`` per model.

The model (pdserve/engine/models/) is built from ``nn.Linear`` (layers/linear.py), ``RMSNorm`` and ``SiluAndMul`` modules so
that weights load by name. ``select_backend(dtype, device)`` then picks a backend once, at
load, and ``apply_backend`` swaps those modules for the backend's own (a transform of an
unchanged model, never a branch inside it):

- ``TorchBackend``: leaves everything to torch (any dtype on CUDA; a CPU without AVX2 + FMA).
  On CUDA (``TorchBackend(fused=True)``, where triton imports) each ``RMSNorm``, its residual
  add included, and each ``SiluAndMul`` is one Triton launch instead of ~10 and 3 torch ops
  (pdserve/engine/kernels/triton_fused.py), rounding where torch's ops round: a graphed decode
  step is bound by its launches. Only those exact classes: a family's own norm (Gemma's) stays.
  RoPE's fused launch is the Triton attention backend's (``TritonAttention.attend``).
  ``TorchBackend(fp8=True)``: the same, and the linears whose checkpoint weights are FP8 (e4m3,
  a scale per tensor or per output row) keep them as they are, 1 byte a weight and a float32
  scale a row, and compute with ``torch._scaled_mm`` (``Fp8Linear``). Chosen in bfloat16 on a
  CUDA device with FP8 matmuls (capability 8.9 and up, ``fp8_matmuls``); the loader asks the
  backend first (``keeps_fp8``), so those weights are never dequantized (``weights.keep_fp8``).
  Block-wise FP8 (DeepSeek-V3's), e5m2, an MoE's experts, float32 and float16 serving, and every
  other device stay dequantized at load.
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

import logging

import torch
from torch import nn

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.attention.paged import PagedAttention
from pdserve.engine.attention.select import triton_available
from pdserve.engine.layers.activation import SiluAndMul
from pdserve.engine.layers.linear import RowParallelLinear
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.models.decoder import Attention, CausalLM, DecoderStack

log = logging.getLogger(__name__)


E4M3_MAX = 448.0  # float8 e4m3's largest magnitude


class Fp8Linear(nn.Module):
    """``y = x @ (W * s)^T + b`` with W float8 e4m3 (N, K) and s a float32 scale per output row,
    through ``torch._scaled_mm``: x (..., K) is quantized to e4m3 per row on the fly (each row's
    largest magnitude to e4m3's largest), so a row's result does not depend on the others in its
    batch, and the product is scaled back per row and column in float32; y (..., N) in x's dtype."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = layer.weight.shape
        self.register_buffer("weight", layer.weight.detach())  # (N, K) e4m3, row-major: W^T is column-major
        self.register_buffer("scale", layer.weight_scale.detach().reshape(1, -1))  # (1, N) float32
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        scale_x = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX  # (M, 1)
        xq = (x2.float() / scale_x).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=scale_x, scale_b=self.scale, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8=e4m3"


class TorchBackend:
    """torch's own kernels: not batch-invariant on CPU (oneDNN and MKL pick kernels, and
    summation orders, by M and by instruction set). ``fp8``: FP8 weights stay FP8 (module
    docstring). ``fused``: RMSNorm and silu * up run as one Triton launch each
    (pdserve/engine/kernels/triton_fused.py); CUDA only, or Triton's interpreter."""

    batch_invariant = False

    def __init__(self, fp8: bool = False, fused: bool = False):
        self.keeps_fp8, self.fused = fp8, fused
        self.name = "torch+fp8" if fp8 else "torch"

    def fits_fp8(self, layer: nn.Linear) -> bool:
        """Whether ``torch._scaled_mm`` takes this linear's shape (K and N multiples of 16)."""
        n, k = layer.weight.shape
        return n % 16 == 0 and k % 16 == 0

    def linear(self, layer: nn.Linear, f32_out: bool = False) -> nn.Module:
        if layer.weight.dtype == torch.float8_e4m3fn:
            return Fp8Linear(layer)
        return layer  # its output in the model dtype: NCCL sums bfloat16 as it is

    def norm(self, norm: RMSNorm) -> nn.Module:
        if self.fused and type(norm) is RMSNorm:  # a subclass may round elsewhere
            from pdserve.engine.kernels.triton_fused import TritonRMSNorm  # imports triton: CUDA only

            return TritonRMSNorm(norm)
        return norm

    def act(self, act: SiluAndMul) -> nn.Module:
        if self.fused and type(act) is SiluAndMul:
            from pdserve.engine.kernels.triton_fused import TritonSiluAndMul

            return TritonSiluAndMul()
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
        if not self.runs(layers):
            return super().forward(layers, h, rope, ctx)
        return torch.ops.pdserve.decoder_layers(*self.arguments(layers, h, rope, ctx))

    def runs(self, layers: nn.ModuleList) -> bool:
        """Whether the one call runs these layers (their attention is the paged kernel's)."""
        return isinstance(layers[0].self_attn.backend, PagedAttention)

    def arguments(self, layers: nn.ModuleList, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  ctx: AttentionContext) -> tuple:
        """``decoder_layers``' arguments for this step (``decoder_layers_lora`` takes them first too)."""
        k_caches = [layer.self_attn.k_cache for layer in layers]
        v_caches = [layer.self_attn.v_cache for layer in layers]
        return (h, rope[0], rope[1], self.input_norm, self.qkv, self.qkv_bias, self.o, self.post_norm, self.gate_up,
                self.down, k_caches, v_caches, ctx.slot_block, ctx.slot_offset, ctx.block_tables, ctx.cu_query_lens,
                ctx.context_lens_t, self.widths, self.num_heads, self.num_kv_heads, self.eps,
                layers[0].self_attn.backend.scale)


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

    @torch.library.register_fake("pdserve::decoder_layers_lora")
    def _decoder_layers_lora(h, *args):
        return torch.empty_like(h), torch.empty_like(h)

    @torch.library.register_fake("pdserve::silu_mul")
    def _silu_mul(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    _fakes_registered = True


class PackedCpuBackend:
    """pdserve's batch-invariant CPU kernels (pdserve/engine/kernels/csrc/linear.cpp): every linear and the LM
    head in bfloat16 or float32; in bfloat16 the norms and silu * up too."""

    batch_invariant = True
    keeps_fp8 = False  # FP8 checkpoints are dequantized at load for these kernels

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
    """The packed kernels for bfloat16 and float32 on an AVX2 + FMA CPU; torch's everywhere else,
    keeping FP8 weights where the device has FP8 matmuls (``fp8_matmuls``), and on CUDA with
    RMSNorm and silu * up fused in Triton where triton imports."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and cpu_kernels.cpu_supported():
        return PackedCpuBackend(dtype)
    return TorchBackend(fp8=fp8_matmuls(dtype, device), fused=triton_available(device))


def fp8_matmuls(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FP8 weights compute as FP8 here: bfloat16 serving on a CUDA device of capability
    8.9 or more (Ada, Hopper and later) where ``torch._scaled_mm`` runs with a scale per row
    (tried once on a 16 x 16 product: a build without it says so in the log and dequantizes)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        a = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError) as exc:
        log.warning("FP8 weights are dequantized on %s: torch._scaled_mm with a scale per row fails there (%s)",
                    device, exc)
        return False
    return True


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


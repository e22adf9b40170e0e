"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 3 1B, and the
language model of the 4B, 12B and 27B when its checkpoint is a text-only one.

What differs from Llama (decoder.py), op for op as ``transformers``' ``modeling_gemma3`` does:
- every RMSNorm is Gemma's: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)``, all in float32, the
  product rounded once to the model dtype (Llama's rounds before the weight multiplies; the
  weights are stored around 0, not 1). ``GemmaRMSNorm`` is its own class, not a subclass of
  layers.norm.RMSNorm, so the CPU linear backend (pdserve/engine/linear.py) never swaps in
  Llama's fused kernel, whose rounding is not this one;
- four norms a layer: ``input_layernorm`` before attention, ``post_attention_layernorm`` on its
  output, ``pre_feedforward_layernorm`` before the MLP and ``post_feedforward_layernorm`` on its
  output, each sublayer's normalized output added to the residual stream in the model dtype;
- a per-head q and k norm (Gemma's), after the projection and before RoPE, as in other families with q/k norms;
- the embedding scaled by sqrt(hidden_size), that factor first rounded to the model dtype
  (transformers' ``Gemma3TextScaledWordEmbedding``: 55.5 in bfloat16 for hidden 3072, not 55.43);
- the MLP's activation is ``gelu_pytorch_tanh``: ``down(gelu_tanh(gate) * up)``;
- the softmax scale is ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.attention_scale``),
  not ``head_dim ** -0.5`` (the 27B: 168 ** -0.5 with heads of 128);
- local and global layers (``layer_types``, or published configs' ``sliding_window_pattern``:
  every sixth layer global): a local layer attends to the last ``sliding_window`` keys, its own
  included (``ModelConfig.layer_windows``, which every attention backend runs, so the context is
  ``max_position_embeddings`` whole, not capped at the window), with RoPE of base
  ``rope_local_base_freq``; a global layer attends to every key, with RoPE of base
  ``rope_theta`` and the config's scaling (``linear`` in the 4B-27B);
- the LM head is tied to the embedding unless the config says otherwise.

The config as published (rope_theta, rope_local_base_freq, rope_scaling for the global layers,
sliding_window_pattern) and as ``transformers`` 5 writes it (``rope_parameters`` per layer type,
``layer_types``) are both read. Refused, naming the field: ``final_logit_softcapping`` and
``attn_logit_softcapping`` when set (Gemma 2's; null in every Gemma 3 config),
``use_bidirectional_attention`` (EmbeddingGemma), ``attention_bias``, another
``hidden_activation``, RoPE scalings other than linear on the global layers and any on the
local ones, and a quantization other than FP8. Ignored as transformers ignores them at inference:
``attention_dropout``, ``pad_token_id``, ``cache_implementation``.

Tensor parallelism is Llama's split (q|k|v by heads, gate|up by width, o and down by input
columns); the norms, the q/k norms included, act within a row or a head, so every rank holds
them whole. The KV cache holds every token of every layer, the local layers' too. On the CPU in
bfloat16 the linears run the packed batch-invariant kernels; the norms and GELU are torch's
row-local ops, and the layers run one by one (the fused whole-stack call is Llama's layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
import torch.nn.functional as F

from pdserve.engine import progress
from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.config import Get, ModelConfig, dense_fields, quantization_fields
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, QKNormAttention
from pdserve.engine.models.family import Family
from pdserve.engine.parallel import SINGLE, TensorParallel

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """A Gemma 3 model's config: ``ModelConfig`` and the RoPE base of its local layers (the
    global layers' is ``rope_theta``, with ``rope_scaling``)."""

    local_rope_theta: float = 10_000.0


class GemmaRMSNorm(nn.Module):
    """transformers' ``Gemma3RMSNorm``: in float32, times (1 + weight), rounded once at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class GeluTanhAndMul(nn.Module):
    """(T, 2I) gate|up -> (T, I) gelu_tanh(gate) * up (transformers' ``gelu_pytorch_tanh``)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3DecoderLayer(nn.Module):
    """``h + post_ff(mlp(pre_ff(h')))`` after ``h' = h + post_attn(attn(input(h)))``, as
    transformers' ``Gemma3DecoderLayer``: each add in the model dtype."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel):
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.sliding = cfg.window(index) is not None  # a local layer: its window, and the local RoPE
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = QKNormAttention(cfg, tp, cfg.window(index), norm=GemmaRMSNorm)  # Gemma's norm on q, k
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, tp, act=GeluTanhAndMul())
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model, holding ``tp``'s share: its own layers and final norm, the scaled
    embedding, and two RoPE tables (global and local)."""

    packed_stack = False  # the C++ whole-stack call is Llama's layer

    def __init__(self, cfg: Gemma3Config, tp: TensorParallel = SINGLE, layer_indices: Sequence[int] | None = None):
        super().__init__(cfg, tp, layer_indices)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta)
        self._normalizer: dict[torch.dtype, float] = {}

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, index, self.tp)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as transformers multiplies by it: a float32 tensor cast to ``dtype``.
        A Python float here, so a captured CUDA graph holds it as a constant."""
        if dtype not in self._normalizer:
            self._normalizer[dtype] = float(torch.tensor(self.cfg.hidden_size ** 0.5).to(dtype))
        return self._normalizer[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)
        h = h * self.embed_scale(h.dtype)
        ropes = {False: self.rotary.tables(positions, h.dtype)}
        if any(layer.sliding for layer in self.layers):
            ropes[True] = self.local_rotary.tables(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, ropes[layer.sliding], ctx)
            progress.layer_done()
        return self.norm(h)


def _rope(get: Get, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' RoPE, local layers'), each with its ``rope_theta``: from transformers 5's
    ``rope_parameters`` per layer type, or the published ``rope_theta``, ``rope_scaling`` and
    ``rope_local_base_freq``. transformers' defaults: 1e6 global, 1e4 local."""
    params = get("rope_parameters") or {}
    if params and not (FULL in params or SLIDING in params):
        raise ModelLoadError(source, f"rope_parameters: Gemma 3 has one per layer type ({FULL}, {SLIDING}), "
                                     f"got {sorted(params)}")
    full = dict(params.get(FULL) or get("rope_scaling") or {})
    local = dict(params.get(SLIDING) or {})
    full.setdefault("rope_theta", get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", get("rope_local_base_freq", 10_000.0))
    for name, rope, supported in ((FULL, full, ("default", "linear")), (SLIDING, local, ("default",))):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in supported:
            raise ModelLoadError(source, f"rope scaling {rope_type!r} of the {name} layers is not supported; "
                                         f"supported: {', '.join(supported)}")
    return full, local


def _layer_windows(get: Get, source: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: ``sliding_window`` for a local layer, None for a global one."""
    types = get("layer_types")
    if types is None:  # published configs: every pattern-th layer is global
        pattern = get("sliding_window_pattern") or get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelLoadError(source, f"layer_types must give each of the {num_layers} layers {SLIDING!r} or "
                                     f"{FULL!r}, got {list(types)}")
    window = get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise ModelLoadError(source, f"sliding_window must be a positive number of keys for the {SLIDING} "
                                     f"layers, got {window!r}")
    return tuple(window if t == SLIDING else None for t in types)


def read_config(get: Get, source: str) -> Gemma3Config:
    quantization_fields(get, source)  # the method checked before anything else, as for every family
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(field) is not None:
            raise ModelLoadError(source, f"{field} {get(field)}: pdserve does not soft-cap logits (Gemma 2 does; "
                                         "Gemma 3 sets it to null); supported: null")
    if get("use_bidirectional_attention"):
        raise ModelLoadError(source, "use_bidirectional_attention: pdserve generates causally; supported: false")
    if get("attention_bias", False):
        raise ModelLoadError(source, "attention_bias: Gemma 3 models have no attention biases; supported: false")
    act = get("hidden_activation") or get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(source, f"hidden_activation {act!r} is not supported; supported: gelu_pytorch_tanh")
    full, local = _rope(get, source)
    # dense_fields reads the Llama fields; the RoPE fields are Gemma's own, per layer type, above.
    fields = dense_fields(lambda key, default=None: None if key in ("rope_parameters", "rope_scaling")
                          else get(key, default), source)
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    fields.update(rope_theta=float(full["rope_theta"]), rope_scaling=scaling,
                  tie_word_embeddings=bool(get("tie_word_embeddings", True)),  # transformers' default for Gemma 3
                  attention_scale=get("query_pre_attn_scalar", 256) ** -0.5,  # transformers' very expression
                  layer_windows=_layer_windows(get, source, fields["num_layers"]))
    return Gemma3Config(**fields, local_rope_theta=float(local["rope_theta"]))


FAMILY = Family(architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",), model=Gemma3ForCausalLM,
                read_config=read_config)

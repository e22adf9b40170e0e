"""Phi-3 (``Phi3ForCausalLM``, model_type ``phi3``): Phi-3-mini-4k, Phi-3-medium-4k, Phi-4.

The layer is Llama's op for op (transformers' ``Phi3DecoderLayer``: RMSNorm, attention without
biases, RMSNorm, ``down(silu(gate) * up)``, residual adds; its dropouts are the identity at
inference), so the model is decoder.py's ``CausalLM`` as it is, and in bfloat16 the packed CPU
backend runs its whole stack in one call like Llama's. What differs is how a checkpoint holds
it: q|k|v are one tensor (``self_attn.qkv_proj.weight``: the q heads' rows, then k's, then v's)
and gate|up one (``mlp.gate_up_proj.weight``: gate rows, then up, the halves transformers
chunks it into). That is the layout of our fused parameters, so each loads whole as part None:
``QKVParallelLinear`` takes this rank's q heads, k heads and v heads from their three places
in the fused tensor, ``MergedColumnParallelLinear`` this rank's gate rows and up rows
(layers/linear.py). A checkpoint with q, k, v or gate, up apart is not a Phi-3 checkpoint and is
refused at load (the model has no parameter for it).

The config, field by field:
- ``sliding_window``: transformers lets each query attend to the last ``sliding_window`` keys,
  itself included. As for Mistral (llama.py), the window caps the context
  (``ModelConfig.max_model_len``: the smaller of it and ``max_position_embeddings``); a
  sequence that fits the window attends to all of it either way. Phi-3-mini-4k says 2047, so it
  serves 2047 tokens, not 4096. (The backends' windows, ``ModelConfig.layer_windows``, would
  serve all 4096 windowed; this reader does not use them yet.)
- refused, naming the field: RoPE scaling of any type (``longrope``, which old configs spell
  ``su`` or ``yarn``, and transformers reads both as longrope: Phi-3-mini-128k, Phi-3.5-mini);
  ``partial_rotary_factor`` other than 1 (Phi-4-mini rotates 3/4 of each head); a
  ``hidden_act`` other than silu; a quantization other than FP8 (``dense_fields``).
- ignored, as transformers' Phi-3 ignores them at inference: ``resid_pdrop``, ``embd_pdrop``,
  ``attention_dropout`` (dropout), ``pad_token_id`` (the embedding's padding row matters to
  training only), ``original_max_position_embeddings`` (longrope's), ``attention_bias``
  (transformers' Phi-3 has no biases whatever the config says).
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.config import Get, ModelConfig, dense_fields
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.family import Family


class Phi3ForCausalLM(CausalLM):
    """Llama's model over Phi-3's fused checkpoint tensors."""

    # Each fused checkpoint tensor is the whole of our fused parameter (part None): the layer
    # cuts this rank's q, k and v heads (gate and up rows) out of it.
    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}


def _rope(get: Get) -> dict[str, Any]:
    """The RoPE fields as transformers 5 writes them (``rope_parameters``) or as published
    configs do (``rope_scaling``, with ``rope_theta`` and ``partial_rotary_factor`` beside it)."""
    return dict(get("rope_parameters") or get("rope_scaling") or {})


def read_config(get: Get, source: str) -> ModelConfig:
    rope = _rope(get)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_parameters" if get("rope_parameters") else "rope_scaling"
        raise ModelLoadError(source, f"{field} type {rope_type!r} (Phi-3 reads su, yarn and longrope as LongRoPE, "
                                     "the 128k-context models') is not supported; supported: default RoPE")
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ModelLoadError(source, f"partial_rotary_factor {partial}: pdserve rotates every dimension of a head; "
                                     "supported: 1.0")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(source, f"hidden_act {act!r} is not supported; supported: silu")
    fields = dense_fields(get, source, rope_types=("default",))
    fields["qkv_bias"] = False  # transformers' Phi3Attention has none, whatever attention_bias says
    fields["sliding_window"] = get("sliding_window") or None  # caps max_model_len, as Mistral's
    return ModelConfig(**fields)


FAMILY = Family(architectures=("Phi3ForCausalLM",), model_types=("phi3",), model=Phi3ForCausalLM,
                read_config=read_config)

"""IBM Granite 3.x (dense): Llama's decoder (decoder.py) with four scalar multipliers.

What differs from Llama, as ``transformers``' modeling_granite.py computes it, and nothing else:
- ``embedding_multiplier``: the embedded tokens are multiplied by it (in the model dtype)
  before the first layer;
- ``residual_multiplier``: each sublayer's output (attention after o_proj, the MLP after
  down_proj) is multiplied by it, in the model dtype, before it is added to the residual
  stream: ``h = h + sublayer(norm(h)) * residual_multiplier``;
- ``attention_multiplier``: the softmax scale, in place of ``head_dim ** -0.5`` (it defaults
  to 1.0 in transformers, so a config without it scales q.k by one). The attention backend
  takes it from ``ModelConfig.attention_scale`` (pdserve/engine/attention/select.py);
- ``logits_scaling``: the logits are divided by it, in the dtype the LM head computes in (the
  model's for torch's head, as transformers does; float32 for a packed head, which writes
  float32), then cast to float32.

The multipliers multiply where transformers multiplies, so in float32 every op is the same and
rounds the same. Tensor parallelism is Llama's split: a sublayer's output is scaled after its
all-reduce, so every rank scales the same sum. The packed CPU backend runs these layers one by
one: its fused whole-stack call is Llama's layer exactly, which has no residual multiplier
(``packed_stack = False``).

Refused by name (``ModelLoadError``), as computing them needs what this file does not have:
``attention_bias`` (transformers then puts a bias on o_proj too), ``mlp_bias``, a ``hidden_act``
other than silu, a rope scaling other than llama3 (``dense_fields``), a multiplier that is not
a finite number, and ``logits_scaling`` 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.config import Get, ModelConfig, dense_fields
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.models.decoder import CausalLM, DecoderLayer
from pdserve.engine.models.family import Family
from pdserve.engine.parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class GraniteConfig(ModelConfig):
    """A Granite model's ``ModelConfig``: the softmax scale is ``attention_scale`` (the
    checkpoint's ``attention_multiplier``); the other three multipliers are these."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteDecoderLayer(DecoderLayer):
    """Llama's layer with each sublayer's output multiplied by ``residual_multiplier`` before the
    add (which the next norm computes: DecoderLayer's residual stream)."""

    def __init__(self, cfg: GraniteConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, tp=tp)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, ctx) * self.residual_multiplier, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(CausalLM):
    """GraniteForCausalLM, holding ``tp``'s share: the embedding and the logits scaled."""

    packed_stack = False  # the fused C++ stack has no residual multiplier (pdserve/engine/linear.py)
    cfg: GraniteConfig

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return GraniteDecoderLayer(cfg, self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids) * self.cfg.embedding_multiplier
        rope = self.rotary.tables(positions, h.dtype)
        h, residual = self.stack(self.layers, h, rope, ctx)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) float32 on rank 0 (None on the others, as ``CausalLM``'s):
        each rank's logits divided by ``logits_scaling`` in the dtype the head wrote them in,
        then cast (transformers divides the model-dtype logits), then gathered."""
        return self.lm_head.gather((self.lm_head(hidden) / self.cfg.logits_scaling).float())


def _multiplier(get: Get, source: str, name: str) -> float:
    """A multiplier of the config (1.0 where it is absent, as transformers' default), a finite number."""
    value = get(name, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(source, f"{name} ({value!r}) must be a finite number")
    return float(value)


def read_config(get: Get, source: str) -> GraniteConfig:
    if get("attention_bias", False):
        raise ModelLoadError(source, "attention_bias: transformers' Granite then has biases on q, k, v and o_proj, "
                                     "which pdserve does not compute (no o_proj bias); supported: false")
    if get("mlp_bias", False):
        raise ModelLoadError(source, "mlp_bias: biases on the MLP's projections are not supported; supported: false")
    if get("hidden_act", "silu") != "silu":
        raise ModelLoadError(source, f"hidden_act {get('hidden_act')!r} is not supported; supported: silu")
    multipliers = {name: _multiplier(get, source, name) for name in
                   ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}
    if multipliers["logits_scaling"] == 0:
        raise ModelLoadError(source, "logits_scaling must not be 0 (the logits are divided by it)")
    return GraniteConfig(**dense_fields(get, source), attention_scale=multipliers.pop("attention_multiplier"),
                         **multipliers)


FAMILY = Family(architectures=("GraniteForCausalLM",), model_types=("granite",), model=GraniteForCausalLM,
                read_config=read_config)

"""What the cost model needs to know about a model: its shape, from which parameters, FLOPs
per token and the bytes a step streams follow. Read from a HF config (``spec_from_config``: the
model's config.json, through the engine's own family readers) or by name (``get_model``): the
published config.json of a well-known checkpoint, which its family lists
(``Family.published``, pdserve/engine/models/), so the planner names no family itself.

What the engine decides, the planner asks the engine: KV bytes per token come from the cache
layout the engine allocates (``ModelSpec.kv_bytes_per_token``: attention/kv_cache.py), and the
tensor-parallel sizes from the layers themselves (pdserve/planner/tp.py). A shape written by hand
(``SHAPES``: a dense decoder no family reads) is asked about as the engine's shared decoder of
that shape (``ModelSpec.engine_config``).

Two shapes beyond a dense GQA decoder:
- Mixture of experts: a token runs through its ``experts_per_token`` routed experts and the
  shared ones (where a family has any), so its FLOPs follow the *active* parameters, while the
  device holds the *total*. A decode step streams only the experts its batch touches.
- Multi-head latent attention (DeepSeek-V2/V3, "MLA"): the cache holds one compressed latent
  of ``kv_lora_rank`` values and one RoPE key of ``qk_rope_head_dim`` per token and layer, for
  all heads together, instead of a key and a value per KV head.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # the engine (torch) is imported only when a spec is asked for: `pdserve --help` needs neither
    from pdserve.engine.config import ModelConfig


class ModelSpecError(ValueError):
    """A model name is unknown or a value is out of range; ``field`` names it."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # MLA: the number of heads (the latent has no head axis)
    head_dim: int  # MLA: the q/k head dim, qk_nope_head_dim + qk_rope_head_dim
    intermediate_size: int  # the dense MLP's width (an MoE model's dense layers)
    vocab_size: int
    max_model_len: int
    mlp_matrices: int = 3  # gated MLP (Llama: gate, up, down) = 3; OPT's plain fc1/fc2 = 2
    tied_embeddings: bool = False  # the LM head is the embedding (counted once in total_params)
    # Mixture of experts; num_experts 0 is a dense model.
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # k of the top-k routing
    moe_intermediate_size: int = 0  # one routed expert's width (a gated SiLU MLP)
    shared_intermediate_size: int = 0  # the always-on experts' summed width (DeepSeek: n_shared x moe width)
    dense_layers: int = 0  # of an MoE model, layers with a dense MLP instead (DeepSeek's first_k_dense_replace)
    # Multi-head latent attention; kv_lora_rank 0 is GQA/MHA.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q projected from the hidden state directly (DeepSeek-V2-Lite)
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # The engine's config this spec was read from (``spec_from_config``); None for a shape
    # written by hand. Not part of equality: the fields above are what it says of the shape.
    config: "ModelConfig | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "max_model_len"):
            if getattr(self, key) <= 0:
                raise ModelSpecError(key, f"must be > 0, got {getattr(self, key)}")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ModelSpecError("experts_per_token", f"must be within [1, {self.num_experts}] (the "
                                     f"routed experts), got {self.experts_per_token}")
            if self.moe_intermediate_size <= 0:
                raise ModelSpecError("moe_intermediate_size", f"must be > 0, got {self.moe_intermediate_size}")
            if not 0 <= self.dense_layers < self.num_layers:
                raise ModelSpecError("dense_layers", f"must be within [0, {self.num_layers}), got {self.dense_layers}")
        if self.mla:
            for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, key) <= 0:
                    raise ModelSpecError(key, f"must be > 0 with kv_lora_rank, got {getattr(self, key)}")
        if self.config is None and (self.moe or self.mla):
            raise ModelSpecError("config", "a mixture-of-experts or latent-attention model is read from its "
                                           "config.json (spec_from_config), so that the engine's layers say how "
                                           "it splits and caches")
        if self.config is not None:
            said = _fields_of(self.config)
            for f in dataclasses.fields(self):
                if f.name not in ("name", "config") and getattr(self, f.name) != said.get(f.name, f.default):
                    raise ModelSpecError(f.name, f"{self.name}: {getattr(self, f.name)} where its config says "
                                                 f"{said.get(f.name, f.default)} (change the config, not the spec)")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def shape(self) -> tuple[int, ...]:
        """What its step times depend on (not its name or context limit). A dense GQA model's is
        the 8 numbers a CPU profile's measured points name (``HardwareProfile.points_model``)."""
        base = (self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.intermediate_size, self.vocab_size, self.mlp_matrices)
        if not (self.moe or self.mla):
            return base
        return base + (self.num_experts, self.experts_per_token, self.moe_intermediate_size,
                       self.shared_intermediate_size, self.dense_layers, self.kv_lora_rank, self.q_lora_rank,
                       self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)

    # ---- parameters ----------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per head, the length of the q . k dot product (MLA: the no-RoPE part plus the RoPE part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def attention_params(self) -> int:
        """One layer's attention projections."""
        h, heads = self.hidden_size, self.num_heads
        if not self.mla:
            q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
            return h * q + 2 * h * kv + q * h  # q, k, v, o projections
        q_out = heads * self.qk_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out  # q_a, q_b | q_proj
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)  # the latent and the shared RoPE key
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)  # latent -> k_nope, v
        return q + kv_a + kv_b + heads * self.v_head_dim * h  # + o_proj

    @property
    def dense_mlp_params(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.moe else 0

    @property
    def moe_always_params(self) -> int:
        """What every token runs in an MoE layer's MLP besides its routed experts: the shared
        experts and the router's linear."""
        return 3 * self.hidden_size * self.shared_intermediate_size + self.hidden_size * self.num_experts

    @property
    def dense_part_params(self) -> int:
        """The decoder's parameters that every token runs through (all but the routed experts)."""
        dense_mlps = self.num_layers - self.moe_layers
        return (self.num_layers * self.attention_params + dense_mlps * self.dense_mlp_params
                + self.moe_layers * self.moe_always_params)

    @property
    def decoder_params(self) -> int:
        """Every decoder parameter (all layers, every expert, without embedding and LM head): what
        the device holds."""
        return self.dense_part_params + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_decoder_params(self) -> int:
        """The decoder parameters one token runs through: its ``experts_per_token`` routed experts
        of each MoE layer, not all of them. A dense model's are all of them."""
        return self.dense_part_params + self.moe_layers * self.experts_per_token * self.expert_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """As a checkpoint counts them: decoder, LM head and the embedding (once, when tied)."""
        return self.decoder_params + self.lm_head_params * (1 if self.tied_embeddings else 2)

    @property
    def active_params(self) -> int:
        """Per token, as publishers count "activated" parameters: with the embedding and LM head."""
        return self.active_decoder_params + self.lm_head_params * (1 if self.tied_embeddings else 2)

    # ---- work per token and per step -----------------------------------------------
    @property
    def linear_flops_per_token(self) -> float:
        """FLOPs of the decoder's matmuls for one token (2 per multiply-add), over the active parameters."""
        return 2.0 * self.active_decoder_params

    @property
    def lm_head_flops(self) -> float:
        """FLOPs of the LM head for one sampled token (prefill samples only the last one)."""
        return 2.0 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query, key) pair over all layers: QK^T over the q/k head dim and PV over the
        value head dim, 2 FLOPs per multiply-add each. MLA counts its heads at their q/k dim
        (no-RoPE + RoPE parts) and value dim, the attention DeepSeek's layers compute."""
        return 2.0 * self.num_layers * self.num_heads * (self.qk_head_dim + self.value_head_dim)

    def weight_bytes(self, dtype_bytes: int) -> float:
        """Bytes of weights a device holds: the whole decoder (every expert) and the LM head (the
        embedding is a row lookup, and a tied one is the LM head)."""
        return (self.decoder_params + self.lm_head_params) * dtype_bytes

    def expected_experts(self, tokens: float) -> float:
        """Routed experts a step of ``tokens`` tokens touches in one MoE layer, expected under
        uniform routing (each token picks k of E experts, independently of the others):
        E * (1 - (1 - k/E) ** tokens). 1 token touches k; a large batch touches all E."""
        if not self.moe or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def streamed_weight_bytes(self, tokens: float, dtype_bytes: int) -> float:
        """Bytes of weights a step over ``tokens`` tokens reads: the dense part and LM head, and
        the experts those tokens are expected to touch. A dense model's are all its weights."""
        if not self.moe:
            return self.weight_bytes(dtype_bytes)
        experts = self.moe_layers * self.expected_experts(tokens) * self.expert_params
        return (self.dense_part_params + experts + self.lm_head_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> float:
        """One token's cache entry on one of ``tp`` ranks, as the engine lays out the cache it
        allocates (``kv_cache.cache_spec_of``): a key and a value of each of the rank's KV heads
        in every layer (tp 1: all of them, what a transfer moves), or MLA's latent and shared
        RoPE key, which has no head axis, whole on every rank."""
        import torch

        from pdserve.engine.attention.kv_cache import cache_spec_of

        # A block of one token at one byte a value: the values a token takes, times the profile's bytes.
        values = cache_spec_of(self.engine_config, 1, torch.uint8, tp).bytes_per_token
        return float(values * dtype_bytes)

    @property
    def engine_config(self) -> "ModelConfig":
        """The engine's config of this model: the one it was read from, or, for a shape written
        by hand, the engine's shared decoder (pdserve/engine/models/decoder.py) of that shape."""
        if self.config is not None:
            return self.config
        from pdserve.engine.config import ModelConfig

        return ModelConfig(model_type="", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=self.max_model_len,
                           tie_word_embeddings=self.tied_embeddings, qkv_bias=False)


def spec_from_config(hf: Any, name: str = "model") -> ModelSpec:
    """A spec from a HF config (its config.json as a dict, or a ``transformers`` config object).

    The config is read by its family's own reader in the engine (pdserve/engine/models/, the
    one list of families), so the planner models exactly what the engine would build. An
    unknown ``model_type`` is an error: its fields might mean something else (Mixtral's experts
    are ``num_local_experts`` at the MLP's width, for one).
    """
    from pdserve.engine.errors import ModelLoadError
    from pdserve.engine.models.registry import families, model_config_from_hf

    model_type = hf.get("model_type") if isinstance(hf, Mapping) else getattr(hf, "model_type", None)
    if model_type not in families():
        raise ModelSpecError("model_type", f"{model_type!r} is not a family the planner models; expected one of "
                                           f"{sorted(families())}")
    try:
        cfg = model_config_from_hf(hf, name)
    except ModelLoadError as exc:
        raise ModelSpecError("model", str(exc)) from exc
    return _spec_of(cfg, name)


# ModelConfig's field -> config.json's key, to name a missing one as the config names it.
_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}


def _spec_of(cfg: "ModelConfig", name: str) -> ModelSpec:
    """The planner's view of an engine ``ModelConfig``."""
    return ModelSpec(name=name, **_fields_of(cfg), config=cfg)


def _fields_of(cfg: "ModelConfig") -> dict[str, Any]:
    """The shape fields of a ``ModelSpec`` that an engine ``ModelConfig`` says."""
    for field_name, key in _HF_KEYS.items():
        if getattr(cfg, field_name) is None:
            raise ModelSpecError(key, "missing from the model's config")
    fields: dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len, tied_embeddings=cfg.tie_word_embeddings)
    moe = cfg.moe  # the family's ExpertsConfig (pdserve/engine/config.py)
    sparse = sum(1 for i in range(cfg.num_layers) if moe is not None and moe.is_sparse(i))
    if sparse:
        fields.update(num_experts=moe.num_experts, experts_per_token=moe.top_k,
                      moe_intermediate_size=moe.intermediate_size,
                      shared_intermediate_size=moe.shared_intermediate_size, dense_layers=cfg.num_layers - sparse)
    if cfg.mla is not None:
        mla = cfg.mla
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(mla, key) is None:
                raise ModelSpecError(key, "missing from the model's config")
        fields.update(kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank or 0,
                      qk_rope_head_dim=mla.qk_rope_head_dim, qk_nope_head_dim=mla.qk_nope_head_dim,
                      v_head_dim=mla.v_head_dim)
    return fields


# Models no family reads, by their shape alone (planned as the engine's shared decoder of that
# shape: ``ModelSpec.engine_config``). OPT, DistServe's model: multi-head attention, a 2-matrix
# ReLU MLP, a 2048-token context.
SHAPES = {
    "OPT-13B": ModelSpec("OPT-13B", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, head_dim=128,
                         intermediate_size=20480, vocab_size=50272, max_model_len=2048, mlp_matrices=2),
}


@functools.cache
def presets() -> dict[str, ModelSpec]:
    """Every model the planner knows by name: each family's published checkpoints
    (``registry.published_configs``, read by the family's own reader) and ``SHAPES``."""
    from pdserve.engine.models.registry import published_configs

    return {**{name: spec_from_config(hf, name) for name, hf in published_configs().items()}, **SHAPES}


def get_model(name: str) -> ModelSpec:
    """A model by name (``presets``), or a spec read from a HF model directory's config.json."""
    if name in presets():
        return presets()[name]
    from pathlib import Path
    import json

    config_path = Path(name) / "config.json"
    if config_path.exists():
        try:
            hf = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelSpecError("model", f"cannot read {config_path}: {exc}") from exc
        return spec_from_config(hf, Path(name).name)
    raise ModelSpecError("model", f"unknown model {name!r}; expected one of {sorted(presets())} "
                                  "or a directory with a config.json")

"""Reading a DeepSeek-V2 / V2-Lite / V3 ``config.json`` into a ``ModelConfig``.

The attention (MLA) and MoE hyper-parameters go into their own dataclasses (``MLAConfig``,
``MoEConfig``); what the rest of the engine reads keeps its meaning: ``num_heads`` query
heads, ``head_dim`` the q/k head width (nope + rope), ``num_kv_heads`` equal to
``num_heads`` as transformers sets it (the cache does not store per-head K/V: kv_cache.py).

Where DeepSeek's own code and ``transformers`` (the correctness oracle) differ, this follows
``transformers`` 5: V2 scores its experts with a softmax and never renormalises the chosen
weights (``norm_topk_prob`` is read by V3 alone); V3 always routes with sigmoid scores, the
correction bias and group-limited top-k (its ``noaux_tc``), whatever ``topk_method`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import Get, MLAConfig, ModelConfig, common_fields, quantization_fields
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.layers.rotary import yarn_mscale

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with an optional shared expert (DeepSeek's naming). A token's MLP output
    is the sum of its ``top_k`` experts' outputs, each weighted by its gate score, plus the
    shared experts' output."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    shared_intermediate_size: int  # of the shared experts fused into one MLP; 0: none
    first_dense_layers: int  # these first layers keep a dense MLP (first_k_dense_replace)
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, plus a per-expert correction bias for the choice)
    num_groups: int  # experts split in groups; a token picks only from its best ``topk_groups``
    topk_groups: int
    norm_topk_prob: bool  # renormalise the chosen weights to sum to 1 (V3)
    routed_scaling_factor: float

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_dense_layers


def read_config(get: Get, source: str) -> ModelConfig:
    """A DeepSeek config.json's ``ModelConfig``; ``get(key, default)`` reads the HF config,
    ``source`` names the model in errors."""
    model_type = get("model_type")
    if get("hidden_act", "silu") != "silu":
        raise ModelLoadError(source, f"unsupported hidden_act {get('hidden_act')!r}; supported: silu")
    if get("mlp_bias", False):
        raise ModelLoadError(source, "mlp_bias=true is not supported for DeepSeek models")
    quantization = quantization_fields(get, source)  # DeepSeek-V3's own release is FP8 with per-block scales
    num_heads = get("num_attention_heads")
    rope, rope_theta = _rope(get, source)
    mla = _mla(get, rope, model_type)
    return ModelConfig(**common_fields(get), num_heads=num_heads, num_kv_heads=num_heads, head_dim=mla.qk_head_dim,
                       rope_theta=rope_theta,
                       qkv_bias=bool(get("attention_bias", False)),  # q_a_proj, kv_a_proj_with_mqa and o_proj
                       rope_scaling=rope, mla=mla, moe=_moe(get, source, model_type), **quantization)


def _rope(get: Get, source: str) -> tuple[dict[str, Any] | None, float]:
    """(yarn parameters with ``factor`` resolved, or None for plain RoPE; rope_theta)."""
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, theta
    if rope_type != "yarn":
        raise ModelLoadError(source, f"unsupported rope scaling {rope_type!r}; supported: default, yarn")
    max_positions = get("max_position_embeddings", 2048)
    rope.setdefault("original_max_position_embeddings", max_positions)
    if rope.get("factor") is None:  # transformers: the ratio of the two context lengths
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    rope.update(rope_type="yarn", rope_theta=theta)
    return rope, theta


def _mla(get: Get, rope: dict[str, Any] | None, model_type: str) -> MLAConfig:
    nope, rot = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    scale = (nope + rot) ** -0.5
    if rope is not None and rope.get("mscale_all_dim"):
        # Yarn sharpens the softmax as it stretches the context (transformers' yarn_apply_mscale).
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    if model_type == "deepseek_v2":
        layout = "complex"
    else:
        layout = "interleaved" if get("rope_interleave", True) else "halves"
    return MLAConfig(q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=nope,
                     qk_rope_head_dim=rot, v_head_dim=get("v_head_dim"), softmax_scale=scale, rope_layout=layout)


def _moe(get: Get, source: str, model_type: str) -> MoEConfig:
    experts, top_k = get("n_routed_experts"), get("num_experts_per_tok")
    if not experts or not top_k or top_k > experts:
        raise ModelLoadError(source, f"n_routed_experts ({experts}) and num_experts_per_tok ({top_k}) must be "
                                     "positive, with num_experts_per_tok <= n_routed_experts")
    if model_type == "deepseek_v2":
        method = get("topk_method", "greedy")
        if method not in V2_TOPK_METHODS:
            raise ModelLoadError(source, f"unsupported topk_method {method!r}; supported: {', '.join(V2_TOPK_METHODS)}")
        grouped = method == "group_limited_greedy"
        scoring, norm = "softmax", False
    else:
        grouped, scoring, norm = True, "sigmoid", bool(get("norm_topk_prob", True))
    groups, topk_groups = (get("n_group") or 1, get("topk_group") or 1) if grouped else (1, 1)
    if experts % groups or not 1 <= topk_groups <= groups:
        raise ModelLoadError(source, f"n_group ({groups}) must divide n_routed_experts ({experts}) and "
                                     f"topk_group ({topk_groups}) must be between 1 and n_group")
    inter = get("moe_intermediate_size")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                     shared_intermediate_size=inter * (get("n_shared_experts") or 0),
                     first_dense_layers=get("first_k_dense_replace") or 0, scoring=scoring, num_groups=groups,
                     topk_groups=topk_groups, norm_topk_prob=norm,
                     routed_scaling_factor=float(get("routed_scaling_factor", 1.0)))

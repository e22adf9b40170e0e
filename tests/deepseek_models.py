"""Small random-weight DeepSeek models with the family's real layout, built by transformers.

Each variant has MLA (a latent of 32 + an 8-wide RoPE key, 4 heads of 16 + 8 for q/k and 16
for v), a dense first layer, then MoE layers with 8 routed experts, top 2, and shared
experts; yarn rope scaling as the real configs have it. They differ where the checkpoints
do: V2-Lite's plain q_proj and greedy softmax routing, V2's group-limited routing, V3's
low-rank query, sigmoid routing with a correction bias, group limits and renormalised
weights, and the RoPE layouts (V2's complex pairs, V3's interleaved pairs, V3 with
``rope_interleave: false``).
"""

from __future__ import annotations

import torch

from tests.factories import make_hf_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1}

MLA_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2048,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
)

VARIANTS = {
    # DeepSeek-V2-Lite: no q low-rank, greedy softmax routing, 2 shared experts, mscale 0.707 twice.
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                    rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V2: q low-rank, group-limited softmax routing (one group kept: with as many groups
    # kept as experts chosen, a group's best expert is its score and the limit never binds);
    # unequal mscales scale cos/sin too.
    "v2-grouped": ("deepseek_v2", dict(q_lora_rank=48, n_shared_experts=1, topk_method="group_limited_greedy",
                                       n_group=4, topk_group=1,
                                       rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707})),
    # DeepSeek-V3: sigmoid + correction bias, 4 groups keep 2, renormalised, scaled by 2.5.
    "v3": ("deepseek_v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5,
                               rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # V3 without interleaved RoPE, without rope scaling and without renormalising.
    "v3-halves": ("deepseek_v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1,
                                      norm_topk_prob=False, rope_interleave=False, rope_scaling=None)),
}


def make_deepseek(variant: str, seed: int = 0, **overrides):
    """The transformers model of ``variant`` (float32, eval), its V3 correction biases random
    (they start at zero, which would leave the biased choice untested)."""
    model_type, fields = VARIANTS[variant]
    model = make_hf_model(model_type, seed=seed, **{**MLA_SHAPE, **fields, **overrides})
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0, 0.1)
    return model

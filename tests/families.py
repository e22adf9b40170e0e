"""Small random-weight models of the families beyond Llama, each with its family's real head
layout, for the tests that check them against ``transformers`` and serve them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.factories import make_hf_model, save_hf_model

# Per family: (transformers model_type, config overrides of tests.factories.TINY_LLAMA).
FAMILIES = {
    # Qwen3 (dense): head_dim is not hidden / heads (4 x 32 in 64, as Qwen3-0.6B's 16 x 128 in
    # 1024), 2 q heads per kv head and the LM head tied to the embedding (both as Qwen3-0.6B),
    # per-head q/k norm, no biases.
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # Qwen3-MoE: 8 q heads per 2 kv heads (Qwen3-30B-A3B has 32 per 4), 8 experts with 2 per
    # token, renormalized as the published checkpoints say, and a dense MLP on layer 1
    # (mlp_only_layers) between two MoE layers.
    "qwen3-moe": ("qwen3_moe", {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                                "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Phi-3: q|k|v and gate|up fused in the checkpoint. 4 q heads per kv head (Phi-3-medium has
    # 40 per 10), head_dim = hidden / heads, the context and sliding window of Phi-3-mini-4k and
    # -medium-4k (4096, 2047: the window caps the context), pad = eos as Phi-3's (its default,
    # 32000, is outside the tiny vocabulary).
    "phi3": ("phi3", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "max_position_embeddings": 4096, "sliding_window": 2047,
                      "pad_token_id": 2}),
    # Granite 3.x (dense): Llama's layout and four multipliers far from one and from each other
    # (granite-3.0-2b: 12, 0.22, 1/64, 8). The LM head is untied, unlike the 3.x releases: with
    # random embeddings 12 times larger than the layers' outputs, a tied head answers the last
    # token again whatever the layers compute; untied, setting any one of the embedding,
    # residual or attention multipliers to one changes the greedy tokens of every test prompt.
    # (logits_scaling keeps the argmax: tests/engine/test_granite.py compares logits, tied too.)
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.0078, "logits_scaling": 8.0}),
    # Gemma 3 (text): two local layers then a global one (the real ones have five to one), a
    # window of 8 keys so that every prompt of the tests outgrows it, the local layers' own RoPE
    # base and the global ones' linear scaling (the 4B-27B's, factor 8 there), a softmax scale
    # of query_pre_attn_scalar ** -0.5 that is not head_dim ** -0.5 (as the 27B's), head_dim
    # not hidden / heads and the LM head tied (as every Gemma 3).
    "gemma3": ("gemma3_text", {"head_dim": 32, "num_hidden_layers": 3, "sliding_window_pattern": 3,
                               "sliding_window": 8, "rope_local_base_freq": 500.0, "query_pre_attn_scalar": 24,
                               "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                               "tie_word_embeddings": True}),
}


def make_family_model(family: str, seed: int = 0, **overrides):
    """A float32 transformers model of ``family``; where the family has q/k norms (Qwen3), their
    weights are drawn around one (transformers initializes them to exactly one, which would
    hide a norm we skipped). Gemma's norms multiply by (1 + weight) and start at zero: every one
    of them (four a layer, q/k and the final norm) is drawn around zero instead."""
    model_type, family_overrides = FAMILIES[family]
    hf = make_hf_model(model_type, seed=seed, **{**family_overrides, **overrides})
    with torch.no_grad():
        if model_type.startswith("gemma"):
            for name, weight in hf.named_parameters():
                if "norm" in name:
                    weight.normal_(0.0, 0.5)
            return hf
        for layer in hf.model.layers:
            if not hasattr(layer.self_attn, "q_norm"):
                continue
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    return hf


def save_family_model(family: str, directory: Path, seed: int = 0, real_tokenizer: bool = False, **overrides):
    """Save ``family``'s model in ``directory``; returns (directory, the transformers model).
    ``real_tokenizer``: a 49,152-token vocabulary and the default model's tokenizer, for
    grammars (structured output needs real token strings)."""
    from pdserve.engine.loader import materialize

    if real_tokenizer:
        overrides = {"vocab_size": 49152, **overrides}
    hf = make_family_model(family, seed=seed, **overrides)
    save_hf_model(hf, directory)
    if real_tokenizer:
        source = materialize("default", progress=False)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (source / name).exists():
                shutil.copy(source / name, directory / name)
    return directory, hf

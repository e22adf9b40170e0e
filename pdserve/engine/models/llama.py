"""Llama, Mistral and Qwen2 (SmolLM is a Llama): the shared decoder (decoder.py) as it is.

What the three configs differ in, read here: Qwen2 has biases on q, k and v; Mistral's
``sliding_window`` caps the context (within the window it is full attention; the backends'
windows, ``ModelConfig.layer_windows``, are not used for it yet); Llama 3.1+ scales RoPE
(``llama3``).
"""

from __future__ import annotations

from pdserve.engine.config import Get, ModelConfig, dense_fields
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.family import Family


def read_config(get: Get, source: str) -> ModelConfig:
    model_type = get("model_type")
    fields = dense_fields(get, source)
    if model_type == "qwen2":
        fields["qkv_bias"] = True
    if get("use_sliding_window", model_type == "mistral"):
        fields["sliding_window"] = get("sliding_window") or None
    return ModelConfig(**fields)


_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
_LLAMA_31 = dict(_LLAMA, vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192))
_LLAMA_70B = dict(_LLAMA_31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)

FAMILY = Family(architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
                model_types=("llama", "mistral", "qwen2"), model=CausalLM, read_config=read_config,
                published={
                    "SmolLM2-135M": dict(_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                         tie_word_embeddings=True),
                    "Llama-3.1-8B": dict(_LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32),
                    "Llama-3.1-70B": _LLAMA_70B,
                    "Llama-3.3-70B": _LLAMA_70B,
                })

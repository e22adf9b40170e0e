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


FAMILY = Family(architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
                model_types=("llama", "mistral", "qwen2"), model=CausalLM, read_config=read_config)

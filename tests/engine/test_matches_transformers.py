"""Greedy output equals transformers' generate, token for token, on small random models of
each supported architecture in float32; in bfloat16 (pdserve's own CPU kernels) it is close
to transformers in float32 by vLLM's standard (fast; the default model's checks are in
test_default_model.py)."""

import pytest
import torch

from tests.factories import hf_greedy, make_engine, make_hf_model, random_prompts, save_hf_model
from tests.logprobs import check_logprobs_close, engine_generation, hf_generation
from pdserve.engine.sampling.params import SamplingParams

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
}


def variant_model(variant: str):
    model_type, overrides = VARIANTS[variant]
    hf = make_hf_model(model_type, **overrides)
    if model_type == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return hf


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, tmp_path):
    hf = variant_model(variant)
    engine = make_engine(save_hf_model(hf, tmp_path))
    prompts = random_prompts(4, [1, 9, 40, 130], seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24), f"prompt of {len(prompt)} tokens"
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_stops_at_eos_like_transformers(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    engine = make_engine(directory)
    prompt = random_prompts(1, [12], seed=3)[0]
    reference = hf_greedy(hf, prompt, 40)
    eos = reference[5]  # pretend the 6th generated token is EOS
    ours = engine.generate([prompt], SamplingParams(max_tokens=40, stop_token_ids=(eos,)))[0]
    assert ours.token_ids == reference[: reference.index(eos) + 1]
    assert ours.finish_reason == "stop"


def test_greedy_matches_transformers_on_every_kernel_path(tmp_path, kernel_path):
    """float32 weights take the FMA chain on every path (the same bits as AVX2)."""
    hf = variant_model("qwen2-qkv-bias")
    engine = make_engine(save_hf_model(hf, tmp_path))
    assert engine.runner.model.kernel_path == kernel_path
    prompts = random_prompts(3, [1, 40, 130], seed=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24), f"{kernel_path}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bfloat16_is_close_to_transformers_in_float32(variant, tmp_path, kernel_path):
    hf = variant_model(variant)
    engine = make_engine(save_hf_model(hf, tmp_path), dtype="bfloat16")
    assert engine.runner.model.linear_backend == "packed-cpu"
    assert engine.runner.model.kernel_path == kernel_path
    prompts = random_prompts(3, [5, 33, 100], seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = [engine_generation(engine, p, params) for p in prompts]
    check_logprobs_close(ours, [hf_generation(hf, p, 16) for p in prompts], "pdserve bfloat16", "transformers float32")

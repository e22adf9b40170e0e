"""Greedy output equals transformers' generate, token for token, on small random models of
each supported architecture (fast; the default model's check is in test_default_model.py)."""

import pytest
import torch

from tests.factories import hf_greedy, load_reference, make_engine, make_hf_model, random_prompts, save_hf_model
from engine.sampling import SamplingParams

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, tmp_path):
    model_type, overrides = VARIANTS[variant]
    hf = make_hf_model(model_type, **overrides)
    if model_type == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
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


def test_bfloat16_greedy_matches_transformers_in_bfloat16(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    hf16 = load_reference(directory, torch.bfloat16)
    # Exact equality in bfloat16 needs transformers' own attention kernel (SDPA); pdserve's
    # paged kernel rounds differently (its float32 results still match token for token).
    engine = make_engine(directory, dtype="bfloat16", attention_backend="sdpa")
    prompts = random_prompts(3, [5, 33, 100], seed=2)
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))):
        assert out.token_ids == hf_greedy(hf16, prompt, 16)

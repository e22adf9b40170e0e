"""Tensor parallelism of the DeepSeek family, on the TP runtime (rank 0 here, rank 1 its child
process, gloo): each rank loads its share of the same checkpoint (half the heads of q /
kv_b_proj / o_proj, half of every MLP's and expert's width, the latent projections whole), rank
0 alone samples, and the latent cache, which has no head axis, is whole on every rank.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.loader import load_model
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling.params import SamplingParams
from tests.deepseek_models import MLA_SHAPE, make_deepseek
from tests.factories import (assert_greedy_matches, engine_config, make_engine, make_tp_engine, random_prompts,
                             save_hf_model)

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def with_biases(hf):
    """attention_bias=True leaves q_a_proj, kv_a_proj_with_mqa and o_proj biases at zero: make
    them count (o_proj's is the one a row-split linear must add once, not once per rank)."""
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj):
                proj.bias.normal_(0, 0.5)
    return hf


@pytest.mark.parametrize("variant", ["v2-lite", "v3", "v3-bias"])
def test_two_ranks_generate_what_transformers_does(variant, tmp_path):
    hf = with_biases(make_deepseek("v3", attention_bias=True)) if variant == "v3-bias" else make_deepseek(variant)
    directory = save_hf_model(hf, tmp_path)
    engine = make_tp_engine(directory, 2)
    try:
        prompts = random_prompts(3, [1, 20, 70], seed=6)
        outs = engine.generate(prompts, GREEDY)
    finally:
        engine.close()
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(hf, prompt, out.token_ids, GREEDY.max_tokens, what=f"{variant} at TP 2, {len(prompt)} tokens")


def test_each_rank_holds_half_the_heads_and_widths_and_the_whole_latent(tmp_path):
    directory = save_hf_model(make_deepseek("v3"), tmp_path)
    cfg = engine_config(directory)
    rank1, _, _ = load_model(cfg.model, cfg.torch_dtype(), cfg.torch_device(), progress=False, tp=TensorParallel(1, 2))
    attn, moe = rank1.layers[1].self_attn, rank1.layers[1].mlp
    heads = MLA_SHAPE["num_attention_heads"] // 2
    assert attn.nh == heads and attn.kv_b_proj.weight.shape[0] == heads * (16 + 16)
    assert attn.o_proj.in_features == heads * 16
    assert moe.experts[0].down_proj.in_features == MLA_SHAPE["moe_intermediate_size"] // 2
    prompt = random_prompts(1, [40], seed=7)[0]
    engine, whole = make_tp_engine(directory, 2), make_engine(directory)
    try:
        engine.generate([prompt], GREEDY)
        caches = [c.clone() for c in engine.rank_caches]
    finally:
        engine.close()
    whole.generate([prompt], GREEDY)
    # The latent has no head axis: each rank caches all of it, the same bytes on both ranks
    # (they sum the same partials in the same order), and the unsharded engine's up to rounding.
    assert caches[0].shape == whole.kv_cache.shape  # not divided by the ranks
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(caches[0], whole.kv_cache, rtol=1e-4, atol=1e-5)
    assert caches[0].abs().sum() > 0

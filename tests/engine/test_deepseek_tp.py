"""Tensor parallelism of the DeepSeek family, emulated in one process.

Two engines, rank 0 and rank 1 of a TP group of 2, each load their share of the same
checkpoint (half the heads of q / kv_b_proj / o_proj, half of every MLP's and expert's
width, the latent projections whole) and run the same requests in two threads. Their
all-reduce is emulated, not gloo's: ``EmulatedRank.all_reduce`` hands each rank's partial to
an ``Exchange``, and both ranks continue with the sum of the two partials, rank 0's first (what
an all-reduce of two ranks computes). The TP runtime (one process per rank, gloo or NCCL) is
tested where it is built; this tests the sharding: that the two halves add up to the model.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling import SamplingParams
from tests.deepseek_models import MLA_SHAPE, make_deepseek
from tests.factories import assert_greedy_matches, engine_config, make_engine, random_prompts, save_hf_model

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


class Exchange:
    """Where two rank threads meet at each all-reduce: both deposit, both read the sum."""

    def __init__(self, size: int = 2):
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)  # a rank that stops fails the test, not hangs it

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()  # every part is in
        total = self.parts[0]
        for part in self.parts[1:]:
            total = total + part
        self.barrier.wait()  # every rank has read its sum before any deposits the next part
        return x.copy_(total)


@dataclass(frozen=True)
class EmulatedRank(TensorParallel):
    """A rank whose all-reduce goes through an ``Exchange`` (in this process) instead of gloo."""

    exchange: Exchange | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.exchange.all_reduce(self.rank, x)


def rank_engines(directory, **config) -> list[LLMEngine]:
    exchange, engines = Exchange(), []
    cfg = engine_config(directory, **config)
    for rank in range(2):
        model, model_cfg, _ = load_model(cfg.model, cfg.torch_dtype(), cfg.torch_device(), progress=False,
                                         tp=EmulatedRank(rank=rank, size=2, exchange=exchange))
        engines.append(LLMEngine(model, model_cfg, cfg))
    return engines


def on_both_ranks(engines: list[LLMEngine], prompts: list[list[int]]) -> list[list[list[int]]]:
    """Each rank's generated tokens for ``prompts``, the ranks running side by side."""
    with ThreadPoolExecutor(len(engines)) as pool:
        runs = [pool.submit(e.generate, prompts, GREEDY) for e in engines]
        return [[out.token_ids for out in run.result()] for run in runs]


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
    engines = rank_engines(directory)
    prompts = random_prompts(3, [1, 20, 70], seed=6)
    rank0, rank1 = on_both_ranks(engines, prompts)
    assert rank0 == rank1
    for prompt, tokens in zip(prompts, rank0):
        assert_greedy_matches(hf, prompt, tokens, GREEDY.max_tokens, what=f"{variant} at TP 2, {len(prompt)} tokens")


def test_each_rank_holds_half_the_heads_and_widths_and_the_whole_latent(tmp_path):
    directory = save_hf_model(make_deepseek("v3"), tmp_path)
    engines = rank_engines(directory)
    whole = make_engine(directory)
    attn, moe = engines[1].runner.model.layers[1].self_attn, engines[1].runner.model.layers[1].mlp
    heads = MLA_SHAPE["num_attention_heads"] // 2
    assert attn.nh == heads and attn.kv_b_proj.weight.shape[0] == heads * (16 + 16)
    assert attn.o_proj.in_features == heads * 16
    assert moe.experts[0].down_proj.in_features == MLA_SHAPE["moe_intermediate_size"] // 2
    prompt = random_prompts(1, [40], seed=7)[0]
    on_both_ranks(engines, [prompt])
    whole.generate([prompt], GREEDY)
    # The latent has no head axis: each rank caches all of it, the same bytes on both ranks
    # (they sum the same partials in the same order), and the unsharded engine's up to rounding.
    assert torch.equal(engines[0].kv_cache, engines[1].kv_cache)
    torch.testing.assert_close(engines[0].kv_cache, whole.kv_cache, rtol=1e-4, atol=1e-5)
    assert engines[0].kv_cache.abs().sum() > 0

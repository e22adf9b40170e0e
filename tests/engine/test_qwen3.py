"""The Qwen3 families (pdserve/engine/models/qwen3.py, layers/moe.py), Phi-3 (phi3.py) and Gemma 3
(gemma3.py), every family of tests/families.py, through the engine: float32 greedy tokens equal transformers'
generate; bfloat16 (pdserve's packed kernels, experts included) is close to it by vLLM's
standard; a request's tokens do not depend on its batch; prefix caching keeps the output; the
checkpoint's config is read, and refused, field by field."""

import json

import pytest
import torch

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.models.registry import model_config_from_hf
from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.layers.moe import SparseMoe
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import hf_greedy, make_engine, random_prompts
from tests.families import FAMILIES, save_family_model
from tests.helpers.engine_runs import run_staggered
from tests.logprobs import check_logprobs_close, engine_generation, hf_generation


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory, transformers model) of each family."""
    directory, hf = save_family_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, directory, hf


def test_greedy_matches_transformers(family):
    name, directory, hf = family
    engine = make_engine(directory)
    prompts = random_prompts(4, [1, 9, 40, 130], seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24), f"{name}: prompt of {len(prompt)} tokens"
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_the_model_has_the_family_layout(family):
    """What the equality above rests on: the q/k norms are there and not all ones, and the
    MoE model routes on layers 0 and 2 and runs a dense MLP on layer 1 (mlp_only_layers).
    Phi-3's layout (Llama's layer over fused checkpoint tensors) is tests/engine/test_phi3.py's,
    Gemma 3's (its norms, windows and RoPE bases) tests/engine/test_gemma3.py's; Granite's layer
    is Llama's (no q/k norms, head_dim hidden / heads) with its multipliers."""
    name, directory, _ = family
    if name in ("phi3", "gemma3"):
        pytest.skip(f"{name}'s layout is tests/engine/test_{name}.py's")
    runner = make_engine(directory).runner
    model = runner.model
    attn = model.layers[0].self_attn
    if name == "granite":  # its multipliers, each checked against transformers in tests/engine/test_granite.py
        assert not hasattr(attn, "q_norm") and attn.hd * attn.nh == model.cfg.hidden_size
        assert (runner.backend.scale, model.layers[0].residual_multiplier) == (0.0078, 0.22)
        return
    assert attn.hd * attn.nh != model.cfg.hidden_size  # head_dim from the config, not hidden / heads
    assert not torch.all(attn.q_norm.weight == 1)
    sparse = [isinstance(layer.mlp, SparseMoe) for layer in model.layers]
    assert sparse == ([True, False, True] if name == "qwen3-moe" else [False] * len(model.layers))


def test_bfloat16_is_close_to_transformers_in_float32(family, kernel_path):
    name, directory, hf = family
    engine = make_engine(directory, dtype="bfloat16")
    model = engine.runner.model
    assert (model.linear_backend, model.kernel_path) == ("packed-cpu", kernel_path)
    # The fused stack is Llama's layer only, which Phi-3's is; Qwen3's run one by one.
    assert isinstance(model.stack, PackedDecoderStack) == (name == "phi3")
    prompts = random_prompts(3, [5, 33, 100], seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = [engine_generation(engine, p, params) for p in prompts]
    check_logprobs_close(ours, [hf_generation(hf, p, 16) for p in prompts], f"pdserve {name} bfloat16",
                         "transformers float32")


def test_bfloat16_tokens_do_not_depend_on_the_batch(family):
    """Staggered requests under preemption equal their solo runs, bit for bit: the experts
    group tokens by expert, and a token's sum never depends on who else was routed there."""
    _, directory, _ = family
    lengths = [1, 7, 17, 40, 90, 130]
    prompts = random_prompts(len(lengths), lengths, seed=5)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    solo_engine = make_engine(directory, num_blocks=64, dtype="bfloat16")
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    engine = make_engine(directory, num_blocks=16, dtype="bfloat16")  # too few for all: preempts
    assert run_staggered(engine, prompts, params, join_every=2) == solo
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_keeps_the_output(family):
    _, directory, hf = family
    engine = make_engine(directory)
    shared = random_prompts(1, [48], seed=9)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.generate([shared + [5, 6]], params)
    before = engine.runner.num_forward_tokens
    out = engine.generate([shared + [7, 8, 9]], params)[0]
    assert engine.runner.num_forward_tokens - before == 3 + 7  # the uncached tail, then 7 decode steps
    assert out.token_ids == hf_greedy(hf, shared + [7, 8, 9], 8)


MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2}


def test_moe_fields_are_read_as_published_checkpoints_and_transformers_5_write_them():
    cfg = model_config_from_hf({**MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}, "m")
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.norm_topk_prob) == (8, 2, 16, True)
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    renamed = {k: v for k, v in MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert model_config_from_hf(renamed, "m").moe.num_experts == 8
    dense = model_config_from_hf({**MOE, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "m")
    assert dense.moe is None and dense.head_dim == 16 and not dense.qkv_bias


@pytest.mark.parametrize("change,field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_bad_moe_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ModelLoadError, match=field):
        model_config_from_hf({**MOE, **change}, "m")


def test_an_unsupported_architecture_names_the_qwen3_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next",
                                                      "architectures": ["Qwen3NextForCausalLM"]}))
    from pdserve.engine.loader import read_model_config

    with pytest.raises(ModelLoadError, match="Qwen3MoeForCausalLM") as err:
        read_model_config(tmp_path)
    assert "Qwen3NextForCausalLM" in str(err.value)

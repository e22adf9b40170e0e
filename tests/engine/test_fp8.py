"""FP8 checkpoints (pdserve/engine/checkpoint.py ``with_scales``): float8 e4m3 weights with a
scale per tensor, per output row or per block, as H100 checkpoints ship, dequantized as they
load. The oracle is transformers in float32 on the same dequantized weights, for every family;
other quantization methods are refused by name (tests/engine/test_weight_loading.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.models import registry
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling.params import SamplingParams
from tests.deepseek_models import make_deepseek
from tests.factories import hf_greedy, make_engine, make_hf_model, random_prompts
from tests.families import make_family_model
from tests.gpu.smol import teacher_forced_logprobs
from tests.helpers.fp8 import save_fp8

# |engine - transformers| of a token's log-probability, both float32 on the same weights: only
# the order of their sums differs. Measured: at most 3.6e-6 over every family and layout here.
FLOAT32_LOGPROB_TOL = 5e-5

MODELS = {  # name: (builder, scale layout)
    "llama": (lambda: make_hf_model("llama", seed=11), "tensor"),
    "llama-per-row": (lambda: make_hf_model("llama", seed=12), "row"),
    "qwen2": (lambda: make_hf_model("qwen2", seed=13, attention_bias=True), "tensor"),
    "qwen3": (lambda: make_family_model("qwen3", seed=14), "tensor"),
    "qwen3-moe": (lambda: make_family_model("qwen3-moe", seed=15), "row"),
    "phi3": (lambda: make_family_model("phi3", seed=16), "tensor"),
    "granite": (lambda: make_family_model("granite", seed=17), "row"),
    "deepseek-v2": (lambda: make_deepseek("v2-lite", seed=18), "tensor"),
    "deepseek-v3-blocks": (lambda: make_deepseek("v3", seed=19), "block"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def fp8_model(request, tmp_path_factory):
    build, layout = MODELS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf, count = save_fp8(build(), directory, layout)
    assert count >= 4
    return request.param, directory, hf


def test_float32_greedy_equals_transformers_on_the_dequantized_weights(fp8_model):
    """The tokens are transformers' own, and so is each token's log-probability, to float32's
    rounding (the two sum in different orders): a scale off by one e4m3 step moves it by far more."""
    name, directory, hf = fp8_model
    engine = make_engine(directory)
    prompts = random_prompts(3, [5, 17, 33], vocab=hf.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    errors = []
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        assert out.token_ids == hf_greedy(hf, prompt, 8), name
        truth = teacher_forced_logprobs(hf, prompt, out.token_ids)
        errors += [abs(ours - float(truth[i, token])) for i, (token, ours) in enumerate(zip(out.token_ids, out.logprobs))]
    assert max(errors) < FLOAT32_LOGPROB_TOL, (name, max(errors))


def test_each_rank_dequantizes_only_its_share(tmp_path):
    """Two ranks' q|k|v and down_proj from a per-row FP8 checkpoint equal the slices of the
    dequantized whole."""
    from pdserve.engine.checkpoint import safetensors_tensors, with_scales
    from pdserve.engine.weights import load_checkpoint

    hf, _ = save_fp8(make_hf_model("llama", seed=21), tmp_path, "row")
    cfg = registry.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()), "fp8")
    whole = hf.state_dict()
    for rank in (0, 1):
        with torch.device("meta"):
            net = registry.build_model(cfg, TensorParallel(rank, 2))
        net = net.to_empty(device="cpu")
        tensors = with_scales(list(safetensors_tensors([tmp_path / "model.safetensors"])), cfg.weight_block_size)
        assert load_checkpoint(net, tensors) == []
        down = whole["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(net.layers[0].mlp.down_proj.weight, down.chunk(2, dim=1)[rank])
        q = whole["model.layers.0.self_attn.q_proj.weight"].chunk(2)[rank]
        assert torch.equal(net.layers[0].self_attn.qkv_proj.weight[:q.shape[0]], q)


def test_a_float8_weight_without_its_scale_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file

    save_fp8(make_hf_model("llama", seed=22), tmp_path, "tensor")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="layers.1.mlp.up_proj.weight.*without its weight_scale"):
        make_engine(tmp_path)

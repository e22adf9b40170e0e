"""The DeepSeek family (pdserve/engine/models/deepseek/) against transformers on small random
models of each layout (tests/deepseek_models.py): float32 greedy tokens equal transformers'
``generate``, bfloat16 is logprob-close by vLLM's standard, a prefix-cache hit and chunked
prefill give the same tokens, and the cache holds one latent row per token and layer."""

import json

import pytest
import torch

from pdserve.engine.models.registry import model_config_from_hf
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.loader import load_model
from pdserve.engine.sampling.params import SamplingParams
from tests.deepseek_models import MLA_SHAPE, VARIANTS, make_deepseek
from tests.factories import assert_greedy_matches, make_engine, random_prompts, save_hf_model
from tests.logprobs import check_logprobs_close, engine_generation, hf_generation

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    """(variant, saved directory, transformers model)."""
    hf = make_deepseek(request.param)
    return request.param, save_hf_model(hf, tmp_path_factory.mktemp(request.param)), hf


def test_greedy_matches_transformers(deepseek):
    variant, directory, hf = deepseek
    engine = make_engine(directory)
    prompts = random_prompts(4, [1, 9, 40, 130], seed=1)
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY)):
        assert_greedy_matches(hf, prompt, out.token_ids, 24, what=f"{variant}, a {len(prompt)}-token prompt")
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_hit_and_chunked_prefill_give_the_same_tokens(deepseek):
    """A second request sharing a 48-token prefix attends over cached latents (the prefill
    path with earlier context); a 16-token step budget cuts a prompt into chunks."""
    variant, directory, hf = deepseek
    prefix = random_prompts(1, [48], seed=5)[0]
    first, second = prefix + [7, 8, 9], prefix + [10, 11]
    engine = make_engine(directory)
    engine.generate([first], GREEDY)
    hits_before = engine.blocks.prefix_hits
    second_out = engine.generate([second], GREEDY)[0].token_ids
    assert engine.blocks.prefix_hits - hits_before == 3 * engine.blocks.block_size  # three full blocks of the prefix
    assert second_out == make_engine(directory, enable_prefix_cache=False).generate([second], GREEDY)[0].token_ids
    assert_greedy_matches(hf, second, second_out, 24, what=f"{variant}, after a prefix hit")
    chunked = make_engine(directory, max_num_batched_tokens=16).generate([first], GREEDY)[0].token_ids
    assert_greedy_matches(hf, first, chunked, 24, what=f"{variant}, chunked prefill")


def test_bfloat16_is_close_to_transformers_in_float32(deepseek, tmp_path):
    """On the variant's model with its routed experts' outputs scaled down 10 times. Routing is
    a discontinuous function: a bfloat16 rounding that swaps a token's expert changes every
    later token's hidden states through attention, and on these random models that moved
    transformers' own bfloat16 outside vLLM's standard against its float32 for V3 in 4 of 6
    prompt sets (dense Llama and Qwen2 pass 8 of 8). Scaled, a swap moves the logits by about
    a near tie (8 of 8 prompt sets pass for every variant); the float32 tests above check the
    routing itself at full scale."""
    variant = deepseek[0]
    hf = make_deepseek(variant)
    with torch.no_grad():
        for layer in hf.model.layers[MLA_SHAPE["first_k_dense_replace"]:]:
            layer.mlp.experts.down_proj.mul_(0.1)
    engine = make_engine(save_hf_model(hf, tmp_path), dtype="bfloat16")
    prompts = random_prompts(3, [5, 33, 100], seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = [engine_generation(engine, p, params) for p in prompts]
    check_logprobs_close(ours, [hf_generation(hf, p, 16) for p in prompts], f"pdserve {variant} bfloat16",
                         "transformers float32")


def test_the_cache_holds_one_latent_row_per_token_and_layer(deepseek):
    _, directory, _ = deepseek
    engine = make_engine(directory, num_blocks=8)
    latent = MLA_SHAPE["kv_lora_rank"] + MLA_SHAPE["qk_rope_head_dim"]
    layers = MLA_SHAPE["num_hidden_layers"]
    assert engine.kv_cache.shape == (8, layers, 16, latent)  # block-first, layer-major
    assert engine.cache_spec.bytes_per_token == layers * latent * 4  # float32
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=1))  # 20 tokens: blocks 0 and 1
    written = engine.kv_cache.abs().sum(dim=(1, 3)) != 0  # (blocks, tokens): layer-major blocks
    assert int(written.sum()) == 20


def test_the_mtp_layer_of_a_v3_checkpoint_is_skipped(tmp_path):
    """DeepSeek-V3's checkpoints carry its multi-token-prediction module as one more layer
    (model.layers.<num_hidden_layers>.*); the engine loads without it."""
    from safetensors.torch import load_file, save_file

    hf = make_deepseek("v3")
    directory = save_hf_model(hf, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    n = MLA_SHAPE["num_hidden_layers"]
    extra = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in tensors.items()
             if f"layers.{n - 1}." in k}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model, cfg, _ = load_model(str(directory), torch.float32, torch.device("cpu"), progress=False)
    assert len(model.layers) == n
    prompt = random_prompts(1, [20], seed=3)[0]
    out = make_engine(directory).generate([prompt], GREEDY)[0].token_ids
    assert_greedy_matches(hf, prompt, out, 24, what="with an MTP layer in the checkpoint")


def test_a_per_head_attention_backend_is_refused_by_name(deepseek):
    """The paged kernel and flash-attn read per-head K/V, which a latent cache does not hold."""
    _, directory, _ = deepseek
    with pytest.raises(ValueError, match="attention_backend=paged"):
        make_engine(directory, attention_backend="paged")
    assert make_engine(directory, attention_backend="sdpa").runner.backend.name == "mla-torch"


def config_of(variant: str, **changes) -> dict:
    model_type, fields = VARIANTS[variant]
    return {"model_type": model_type, "vocab_size": 512, **MLA_SHAPE, **fields, **changes}


@pytest.mark.parametrize("changes, named", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),  # FP8 is served (test_fp8.py)
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"n_group": 3}, "n_group"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
])
def test_an_unsupported_config_is_a_clear_error(changes, named):
    with pytest.raises(ModelLoadError, match=named):
        model_config_from_hf(config_of("v2-grouped", **changes), "cfg.json")


def test_real_config_fields_are_read_as_transformers_reads_them():
    """What a DeepSeek-V3 config.json says (rope_scaling, no rope_parameters) becomes the
    softmax scale transformers uses: yarn's mscale(40, 1.0) squared times 192 ** -0.5."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale

    raw = json.loads(json.dumps(config_of("v3", qk_nope_head_dim=128, qk_rope_head_dim=64, rope_scaling={
        "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1})))
    cfg = model_config_from_hf(raw, "cfg.json")
    assert cfg.mla.softmax_scale == pytest.approx(192 ** -0.5 * yarn_get_mscale(40, 1.0) ** 2)
    assert (cfg.mla.latent_dim, cfg.mla.rope_layout, cfg.moe.scoring) == (32 + 64, "interleaved", "sigmoid")
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.shared_intermediate_size) == (4, 2, 32)

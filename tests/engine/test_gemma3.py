"""Gemma 3, text (pdserve/engine/models/gemma3.py). What is Gemma 3's own is checked here: the
config read and refused field by field (as published and as transformers 5 writes it), the
layout (local layers with their window and RoPE base, Gemma's norms that the packed CPU
backend leaves alone, the softmax scale), that the window decides the tokens and caps no
context, float32 greedy equal to transformers on every attention backend with prompts and
chunks longer than the window, and two tensor-parallel ranks equal to transformers. The rest
runs on the same tiny model through tests.families: float32 greedy and bfloat16 closeness,
bfloat16 batch invariance under preemption and prefix caching (tests/engine/test_qwen3.py), two
ranks against one (tests/engine/test_qwen3_tp.py) and served disaggregated
(tests/serving/test_qwen3_served.py)."""

import json

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.layers.norm import RMSNorm
from pdserve.engine.linear import PackedLinear
from pdserve.engine.models.gemma3 import GemmaRMSNorm
from pdserve.engine.models.registry import model_config_from_hf
from pdserve.engine.sampling.params import SamplingParams
from tests.helpers.thread_ranks import NEW_TOKENS, run_ranks
from tests.factories import (assert_greedy_matches, hf_greedy, make_engine, make_tp_engine, random_prompts,
                             save_hf_model)
from tests.families import make_family_model, save_family_model

# google/gemma-3-1b-it's config.json, as published (transformers 4.50's format).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
# The text_config of google/gemma-3-12b-it (with the 27B's head geometry for its scale: 168 ** -0.5
# with heads of 128).
GEMMA3_12B_TEXT = {
    **{k: v for k, v in GEMMA3_1B.items() if k not in ("architectures", "eos_token_id")},
    "hidden_size": 3840, "intermediate_size": 15360, "max_position_embeddings": 131072, "num_attention_heads": 16,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024, "vocab_size": 262208}
GEMMA3_27B_HEADS = {"hidden_size": 5376, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                    "query_pre_attn_scalar": 168, "num_hidden_layers": 62}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(directory, transformers model) of the tiny Gemma 3 of tests.families."""
    return save_family_model("gemma3", tmp_path_factory.mktemp("gemma3"))


def test_a_published_config_is_read():
    cfg = model_config_from_hf(GEMMA3_1B, "gemma-3-1b-it")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (4, 1, 256, 6912)
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))  # 5 local : 1 global
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.attention_scale == 256 ** -0.5 == 0.0625
    assert cfg.tie_word_embeddings  # the config does not say; transformers' Gemma 3 default
    assert cfg.eos_token_ids == (1, 106) and cfg.rms_norm_eps == 1e-6
    assert cfg.max_model_len == 32768 and cfg.sliding_window is None  # the local layers run windowed: no cap
    big = model_config_from_hf(GEMMA3_12B_TEXT, "gemma-3-12b-it")
    assert big.rope_scaling == {"factor": 8.0, "rope_type": "linear", "rope_theta": 1000000}
    assert big.window(0) == 1024 and big.window(5) is None and big.max_model_len == 131072
    heads = model_config_from_hf({**GEMMA3_12B_TEXT, **GEMMA3_27B_HEADS}, "gemma-3-27b-it")
    assert heads.attention_scale == 168 ** -0.5 and heads.head_dim == 128


def test_the_transformers_5_config_reads_as_its_object_does(gemma3):
    """transformers 5 writes rope_parameters per layer type and layer_types; the config object
    and the file it saved give the same ModelConfig."""
    directory, hf = gemma3
    saved = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in saved and "layer_types" in saved
    from_file, from_object = model_config_from_hf(saved, "f"), model_config_from_hf(hf.config, "o")
    assert from_file == from_object
    assert from_file.layer_windows == (8, 8, None)
    assert (from_file.local_rope_theta, from_file.rope_theta) == (500.0, 10000.0)
    assert from_file.rope_scaling["rope_type"] == "linear" and from_file.rope_scaling["factor"] == 4.0
    assert from_file.attention_scale == 24 ** -0.5


@pytest.mark.parametrize("change,field", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),  # Gemma 2's
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),  # EmbeddingGemma
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' of the full_attention layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope scaling 'linear' of the sliding_attention layers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"layer_types": ["sliding_attention"] * 25}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 25 + ["chunked_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_what_the_engine_cannot_compute_is_refused_naming_the_field(change, field):
    with pytest.raises(ModelLoadError, match=field):
        model_config_from_hf({**GEMMA3_1B, **change}, "m")


def test_the_model_has_gemma_layers_and_the_packed_backend_keeps_gemmas_norms(gemma3):
    """Local layers hold their window, every norm is Gemma's (weights drawn away from their init
    of zero), and in bfloat16 the packed CPU backend swaps the linears but none of the norms:
    its RMSNorm kernel rounds as Llama's does."""
    directory, _ = gemma3
    for dtype in ("float32", "bfloat16"):
        engine = make_engine(directory, dtype=dtype)
        model = engine.runner.model
        assert [layer.self_attn.window for layer in model.layers] == [8, 8, None]
        assert [layer.sliding for layer in model.layers] == [True, True, False]
        assert engine.runner.backend.scale == 24 ** -0.5
        norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
        assert len(norms) == 3 * 6 + 1 and not any(isinstance(m, RMSNorm) for m in model.modules())
        assert all(not torch.all(n.weight == 0) for n in norms)
        assert engine.max_model_len == 2048  # not the window of 8
        if dtype == "bfloat16" and cpu_kernels.cpu_supported():
            assert model.linear_backend == "packed-cpu"
            assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
            assert type(model.stack).__name__ == "DecoderStack"  # unused: the layers run one by one


def test_the_window_decides_the_tokens_and_ours_are_transformers(gemma3, tmp_path):
    """The same weights with a window of 2048 (every layer attends to everything) give other
    tokens for a prompt much longer than 8: the window is doing something, and what the
    engine does with it is what transformers does."""
    directory, hf = gemma3
    wide = make_family_model("gemma3", sliding_window=2048)
    wide.load_state_dict(hf.state_dict())
    prompt = random_prompts(1, [60], seed=21)[0]
    assert hf_greedy(hf, prompt, 16) != hf_greedy(wide, prompt, 16)
    engine = make_engine(directory)
    assert engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids == \
        hf_greedy(hf, prompt, 16)
    wide_engine = make_engine(save_hf_model(wide, tmp_path / "wide"))
    assert wide_engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids == \
        hf_greedy(wide, prompt, 16)


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
def test_float32_greedy_equals_transformers_in_chunks_across_the_window(gemma3, backend):
    """Prompts of 1 to 70 tokens prefilled in chunks of 16 (each chunk's local layers reaching
    back into the one before) beside decoding sequences, then decoded far past the window."""
    if backend == "paged" and not cpu_kernels.cpu_supported():
        pytest.skip("the paged kernel needs an x86-64 CPU with AVX2 and FMA")
    directory, hf = gemma3
    engine = make_engine(directory, attention_backend=backend, max_num_batched_tokens=16, policy="mixed")
    assert engine.runner.backend.name == backend
    prompts = random_prompts(4, [1, 9, 30, 70], seed=13)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(hf, prompt, out.token_ids, 24, what=f"{backend}, a {len(prompt)}-token prompt")


def test_float32_greedy_on_the_triton_backend_equals_transformers(gemma3):
    """Triton's kernels (in its interpreter without CUDA): chunks of 16 past the window."""
    pytest.importorskip("triton")
    directory, hf = gemma3
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = make_engine(directory, device=device, attention_backend="triton", max_num_batched_tokens=16)
    assert engine.runner.backend.name == "triton"
    prompts = random_prompts(2, [9, 37], seed=5)
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))):
        assert_greedy_matches(hf, prompt, out.token_ids, 6, what=f"triton, a {len(prompt)}-token prompt")


def test_two_ranks_give_transformers_greedy_tokens(gemma3):
    """Both ranks in this process (tests/engine/test_qwen3_tp.py's threads and all-reduce), each
    with its one KV head, Gemma's norms whole on both."""
    directory, hf = gemma3
    prompt = random_prompts(1, [37], seed=3)[0]
    for rank, out in enumerate(run_ranks(directory, 2, prompt)):
        assert out["tokens"] == hf_greedy(hf, prompt, NEW_TOKENS), f"rank {rank}"


@pytest.mark.slow
def test_a_tp2_engine_gives_transformers_greedy_tokens(gemma3):
    """The TP runtime: rank 1 a child process, gloo between the ranks, each loading its share."""
    directory, hf = gemma3
    prompts = random_prompts(3, [5, 40, 90], seed=11)
    engine = make_tp_engine(directory, 2, num_blocks=64)
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        engine.close()
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(hf, prompt, out.token_ids, 16, what=f"tp 2, a {len(prompt)}-token prompt")

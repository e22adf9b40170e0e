"""Granite (pdserve/engine/models/granite.py) against transformers' GraniteForCausalLM: Llama's
layer with an embedding multiplier, a residual multiplier, its own softmax scale and divided
logits (tests/families.py: 12, 0.22, 0.0078 and 8, far from one).

Here: float32 logits equal transformers' at every generated position (the argmax would not
see ``logits_scaling``), with the LM head untied and tied, on the packed CPU kernels (the
engine) and on torch's at one and two tensor-parallel ranks; the logits move far outside that
tolerance when any one multiplier is read as one, so the equality is what shows each is
applied; llama3 RoPE; the config's fields, read and refused by name.

Granite also runs in the family-parametrized tests: tests/engine/test_qwen3.py (float32 greedy
tokens equal transformers' at TP 1, bfloat16 close to it and batch-invariant under
preemption, the prefix cache), tests/engine/test_qwen3_tp.py (two ranks equal one) and
tests/serving/test_qwen3_served.py (served disaggregated, the KV over NIXL).
"""

import json
import shutil

import pytest
import torch

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.models.granite import GraniteDecoderLayer
from pdserve.engine.models.registry import model_config_from_hf
from pdserve.engine.sampling.params import SamplingParams
from tests.helpers.thread_ranks import NEW_TOKENS, run_ranks
from tests.factories import hf_greedy, make_engine, random_prompts, save_hf_model
from tests.families import make_family_model, save_family_model

PROMPTS = random_prompts(3, [1, 17, 70], seed=11)
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# pdserve's float32 sums in other orders than transformers' (its packed kernels, its paged
# attention): logits differ in the last bits, 2e-7 at most here. A multiplier read as one moves
# them by 0.1 or more.
ATOL = 2e-5


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(directory, transformers model) of tests/families.py's Granite (LM head untied)."""
    return save_family_model("granite", tmp_path_factory.mktemp("granite"))


@pytest.fixture(scope="module")
def granite_tied(tmp_path_factory):
    """The same with the LM head tied to the embedding, as the Granite 3.x releases."""
    return save_family_model("granite", tmp_path_factory.mktemp("granite-tied"), tie_word_embeddings=True)


def engine_logits(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The engine's greedy tokens for ``prompt`` and the float32 logits it sampled each from."""
    model = engine.runner.model
    rows: list[torch.Tensor] = []
    original = model.compute_logits

    def compute_logits(hidden):
        logits = original(hidden)
        rows.extend(logits.clone())
        return logits

    model.compute_logits = compute_logits
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    finally:
        del model.compute_logits
    return out.token_ids, torch.stack(rows[:len(out.token_ids)])


def hf_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits at each position that produced ``tokens`` (teacher-forced)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1:].float()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_float32_logits_equal_transformers(granite, granite_tied, tied):
    directory, hf = granite_tied if tied else granite
    engine = make_engine(directory)
    model = engine.runner.model
    assert (model.linear_backend, model.cfg.tie_word_embeddings) == ("packed-cpu-f32", tied)
    assert all(type(layer) is GraniteDecoderLayer for layer in model.layers)
    for prompt in PROMPTS:
        tokens, logits = engine_logits(engine, prompt, 8)
        if not tied:  # tied, the tiny random model repeats a token: the logits are the check there
            assert tokens == hf_greedy(hf, prompt, 8), f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(logits, hf_logits(hf, prompt, tokens), rtol=0, atol=ATOL)
    assert engine.runner.backend.scale == 0.0078  # attention_multiplier, not head_dim ** -0.5 (0.25)


@pytest.mark.parametrize("multiplier", MULTIPLIERS)
def test_a_multiplier_read_as_one_fails_the_equality(granite, multiplier, tmp_path):
    """What the test above rests on: each multiplier changes the logits by far more than its
    tolerance, so skipping one (here: the same weights with that field set to one) fails it."""
    directory, hf = granite
    changed = shutil.copytree(directory, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    assert config[multiplier] not in (1, 1.0)
    (changed / "config.json").write_text(json.dumps({**config, multiplier: 1.0}))
    prompt = PROMPTS[1]
    tokens, logits = engine_logits(make_engine(changed), prompt, 4)
    assert (logits - hf_logits(hf, prompt, tokens)).abs().max() > 100 * ATOL


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_two_ranks_equal_transformers(granite, granite_tied, tied):
    """Megatron's split at two ranks (tests/engine/test_qwen3_tp.py's threads), torch's float32
    kernels and SDPA at the model's scale: the tokens and rank 0's logits are transformers'."""
    directory, hf = granite_tied if tied else granite
    prompt = random_prompts(1, [37], seed=3)[0]
    outs = run_ranks(directory, 2, prompt)
    tokens = outs[0]["tokens"]
    assert all(out["tokens"] == tokens for out in outs)
    if not tied:
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
    torch.testing.assert_close(outs[0]["logits"], hf_logits(hf, prompt, tokens), rtol=0, atol=ATOL)


def test_bfloat16_runs_the_layers_one_by_one(granite):
    """The fused C++ stack is Llama's layer (no residual multiplier): Granite must not get it."""
    model = make_engine(granite[0], dtype="bfloat16").runner.model
    assert model.linear_backend == "packed-cpu" and not model.packed_stack
    assert not isinstance(model.stack, PackedDecoderStack)


def test_llama3_rope_scaling_equals_transformers(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_family_model("granite", rope_parameters=rope)
    engine = make_engine(save_hf_model(hf, tmp_path))
    assert engine.runner.model.cfg.rope_scaling["rope_type"] == "llama3"
    prompt = random_prompts(1, [130], seed=12)[0]
    tokens, logits = engine_logits(engine, prompt, 8)
    assert tokens == hf_greedy(hf, prompt, 8)
    torch.testing.assert_close(logits, hf_logits(hf, prompt, tokens), rtol=0, atol=ATOL)


GRANITE = {"model_type": "granite", "architectures": ["GraniteForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
GRANITE_3_0_2B = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                  "logits_scaling": 8.0, "tie_word_embeddings": True}


def test_the_multipliers_are_read():
    cfg = model_config_from_hf({**GRANITE, **GRANITE_3_0_2B}, "g")
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (12.0, 0.22, 8.0)
    assert (cfg.attention_scale, cfg.head_dim, cfg.tie_word_embeddings, cfg.qkv_bias) == (0.015625, 8, True, False)


def test_absent_multipliers_are_transformers_defaults():
    """transformers' GraniteConfig defaults each to one; the softmax scale too (not head_dim ** -0.5)."""
    from transformers import GraniteConfig

    cfg = model_config_from_hf(GRANITE, "g")
    theirs = GraniteConfig()
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (
        theirs.embedding_multiplier, theirs.residual_multiplier, theirs.attention_multiplier, theirs.logits_scaling)
    assert cfg.attention_scale == 1.0


@pytest.mark.parametrize("change,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling"),
    ({"logits_scaling": 0}, "logits_scaling"),
    ({"residual_multiplier": None}, "residual_multiplier"),
    ({"embedding_multiplier": "12"}, "embedding_multiplier"),
    ({"attention_multiplier": float("nan")}, "attention_multiplier"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_what_is_not_computed_is_refused_naming_the_field(change, field):
    with pytest.raises(ModelLoadError, match=field):
        model_config_from_hf({**GRANITE, **change}, "g")


def test_an_unsupported_architecture_names_granite():
    with pytest.raises(ModelLoadError, match="GraniteForCausalLM"):
        model_config_from_hf({"model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"]}, "g")

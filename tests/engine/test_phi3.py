"""Phi-3 (pdserve/engine/models/phi3.py): Llama's layer over checkpoints that hold q|k|v and
gate|up fused. What is Phi-3's own is checked here: the config read and refused field by field,
each tensor-parallel rank's q, k and v heads (gate and up rows) cut out of the fused tensors,
two ranks giving transformers' greedy tokens, the sliding window capping the context, and the
bfloat16 model running the packed Llama stack. The rest runs on the same tiny model through
tests.families: float32 greedy equal to transformers, bfloat16 close to it and independent of
the batch, prefix caching (tests/engine/test_qwen3.py), two ranks against one
(tests/engine/test_qwen3_tp.py) and served disaggregated (tests/serving/test_qwen3_served.py)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.checkpoint import safetensors_tensors
from pdserve.engine.errors import InvalidRequestError, ModelLoadError
from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.loader import read_model_config
from pdserve.engine.models.registry import build_model, model_config_from_hf
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.weights import load_checkpoint
from tests.helpers.thread_ranks import NEW_TOKENS, run_ranks
from tests.factories import assert_greedy_matches, hf_greedy, make_engine, make_tp_engine, random_prompts, save_hf_model
from tests.families import make_family_model, save_family_model

# microsoft/Phi-3-mini-4k-instruct's config.json, as published (the fields pdserve reads, and
# the ones it must not trip on).
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064}
LONGROPE = {"long_factor": [1.0] * 48, "short_factor": [1.0] * 48}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(directory, transformers model) of the tiny Phi-3 of tests.families."""
    return save_family_model("phi3", tmp_path_factory.mktemp("phi3"))


def test_a_published_config_is_read():
    cfg = model_config_from_hf(PHI3_MINI_4K, "phi-3-mini")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (32, 32, 96, 8192)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.qkv_bias, cfg.tie_word_embeddings) == (10000.0, None, False, False)
    assert cfg.eos_token_ids == (32000,)
    assert cfg.max_model_len == 2047  # the sliding window caps the 4096 positions
    assert model_config_from_hf({**PHI3_MINI_4K, "sliding_window": None}, "m").max_model_len == 4096
    # transformers' Phi-3 has no attention biases whatever the config says; nor does ours.
    assert not model_config_from_hf({**PHI3_MINI_4K, "attention_bias": True}, "m").qkv_bias
    # transformers 5 writes rope_theta and partial_rotary_factor inside rope_parameters.
    new = {k: v for k, v in PHI3_MINI_4K.items() if k not in ("rope_scaling", "rope_theta")}
    cfg = model_config_from_hf({**new, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0,
                                                          "partial_rotary_factor": 1.0}}, "m")
    assert (cfg.rope_theta, cfg.rope_scaling) == (250000.0, None)


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"type": "longrope", **LONGROPE}}, "rope_scaling type 'longrope'"),  # Phi-3-mini-128k
    ({"rope_scaling": {"type": "su", **LONGROPE}}, "rope_scaling type 'su'"),  # its first config
    ({"rope_scaling": {"type": "yarn", **LONGROPE}}, "rope_scaling type 'yarn'"),  # LongRoPE to transformers
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, **LONGROPE}}, "rope_parameters type 'longrope'"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),  # Phi-4-mini
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_what_the_engine_cannot_compute_is_refused_naming_the_field(change, field):
    with pytest.raises(ModelLoadError, match=field):
        model_config_from_hf({**PHI3_MINI_4K, **change}, "m")


def rank_weights(directory, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """``tp``'s share of the model, loaded by the engine's loader from the safetensors file."""
    model = build_model(read_model_config(directory), tp)
    assert not load_checkpoint(model, safetensors_tensors(sorted(directory.glob("*.safetensors"))))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_each_rank_cuts_its_q_k_v_heads_and_gate_up_rows_from_the_fused_tensors(phi3):
    directory, _ = phi3
    cfg = read_model_config(directory)
    whole = load_file(str(directory / "model.safetensors"))
    assert rank_weights(directory, TensorParallel(0, 1))["layers.0.self_attn.qkv_proj.weight"].equal(
        whole["model.layers.0.self_attn.qkv_proj.weight"])
    hd, nh, nkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size  # 16, 8, 2, 256
    for rank in range(2):
        ours = rank_weights(directory, TensorParallel(rank, 2))
        for layer in range(cfg.num_layers):
            qkv = whole[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd])
            q_heads, kv_heads = slice(rank * nh // 2 * hd, (rank + 1) * nh // 2 * hd), slice(rank * hd, (rank + 1) * hd)
            assert ours[f"layers.{layer}.self_attn.qkv_proj.weight"].equal(
                torch.cat([q[q_heads], k[kv_heads], v[kv_heads]])), f"rank {rank}, layer {layer}"
            gate, up = whole[f"model.layers.{layer}.mlp.gate_up_proj.weight"].chunk(2)  # transformers' order
            rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
            assert ours[f"layers.{layer}.mlp.gate_up_proj.weight"].equal(torch.cat([gate[rows], up[rows]]))
            o, down = (whole[f"model.layers.{layer}.{n}.weight"] for n in ("self_attn.o_proj", "mlp.down_proj"))
            assert ours[f"layers.{layer}.self_attn.o_proj.weight"].equal(o[:, q_heads])
            assert ours[f"layers.{layer}.mlp.down_proj.weight"].equal(down[:, rows])


def test_a_checkpoint_with_q_k_v_apart_is_refused_naming_the_tensor(phi3, tmp_path):
    """Phi-3's checkpoints hold q|k|v fused; one that splits them is another model's."""
    directory, _ = phi3
    cfg = read_model_config(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    qkv = tensors.pop("model.layers.0.self_attn.qkv_proj.weight")
    for name, part in zip("qkv", qkv.split([cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2)):
        tensors[f"model.layers.0.self_attn.{name}_proj.weight"] = part.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.[qkv]_proj.weight: the model has no parameter"):
        load_checkpoint(build_model(cfg), safetensors_tensors([tmp_path / "model.safetensors"]))


def test_two_ranks_give_transformers_greedy_tokens(phi3):
    """Both ranks in this process (tests/engine/test_qwen3_tp.py's threads and all-reduce)."""
    directory, hf = phi3
    prompt = random_prompts(1, [37], seed=3)[0]
    for rank, out in enumerate(run_ranks(directory, 2, prompt)):
        assert out["tokens"] == hf_greedy(hf, prompt, NEW_TOKENS), f"rank {rank}"


@pytest.mark.slow
def test_a_tp2_engine_gives_transformers_greedy_tokens(phi3):
    """The TP runtime: rank 1 a child process, gloo between the ranks, each loading its share."""
    directory, hf = phi3
    prompts = random_prompts(3, [5, 40, 90], seed=11)
    engine = make_tp_engine(directory, 2, num_blocks=64)
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    finally:
        engine.close()
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(hf, prompt, out.token_ids, 16, what=f"tp 2, a {len(prompt)}-token prompt")


def test_the_sliding_window_caps_the_context(tmp_path):
    """transformers masks each query to the last ``sliding_window`` keys; a sequence that fits
    the window attends to all of it, so up to the cap ours equals transformers'; past it a
    request is refused, not computed with full attention."""
    hf = make_family_model("phi3", sliding_window=48)
    directory = save_hf_model(hf, tmp_path / "phi3-window")
    engine = make_engine(directory)
    assert engine.max_model_len == 48
    prompt = random_prompts(1, [40], seed=4)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)
    with pytest.raises(InvalidRequestError, match="context length 48"):
        engine.add_request("long", prompt, SamplingParams(max_tokens=9, ignore_eos=True))


def test_bfloat16_runs_the_packed_llama_stack(phi3):
    """Phi-3's layer is Llama's, so in bfloat16 the whole stack is one packed call."""
    directory, _ = phi3
    model = make_engine(directory, dtype="bfloat16").runner.model
    assert isinstance(model.stack, PackedDecoderStack)
    attn = model.layers[0].self_attn
    assert (attn.nh, attn.nkv, attn.hd) == (8, 2, 16) and not hasattr(attn, "q_norm")

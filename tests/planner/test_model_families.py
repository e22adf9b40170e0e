"""The planner's model of MoE and MLA: parameter counts against the published figures and
against ``transformers``' own models, the config reader, MLA's KV bytes against GQA's (the
engine's cache layout's), the weights a MoE decode step streams, and which TP degrees the
engine's layers admit."""

import dataclasses

import pytest

from pdserve.planner.cost import CostError, CostModel
from pdserve.planner.hardware import GPU_PROFILES
from pdserve.planner.model_spec import ModelSpec, ModelSpecError, get_model, spec_from_config
from pdserve.planner.tp import pair_refusal, tp_refusal
from tests.planner.helpers import DEVICE

V3, LLAMA, QWEN_MOE = get_model("DeepSeek-V3"), get_model("Llama-3.3-70B"), get_model("Qwen3-30B-A3B")

# config.json of each model as published (the fields the planner reads).
DEEPSEEK_V3_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
    first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840, tie_word_embeddings=False,
    n_group=8, topk_group=4, num_nextn_predict_layers=1)
QWEN3_30B_A3B_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, tie_word_embeddings=False)
DEEPSEEK_V2_LITE_CONFIG = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, max_position_embeddings=163840, tie_word_embeddings=False)


@pytest.mark.parametrize("name, total, active", [
    ("Llama-3.3-70B", 70.6, 70.6), ("Qwen3-8B", 8.2, 8.2),
    ("Qwen3-30B-A3B", 30.5, 3.3),  # Qwen's model card: 30.5B total, 3.3B activated
    ("DeepSeek-V3", 671, 37),  # DeepSeek-V3 report: 671B total, 37B activated (the 61 main layers)
])
def test_presets_have_the_published_total_and_active_counts(name, total, active):
    spec = get_model(name)
    assert spec.total_params / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.active_params / 1e9 == pytest.approx(active, rel=0.02)


def test_flops_follow_the_active_parameters_and_memory_the_total():
    assert QWEN_MOE.linear_flops_per_token == 2.0 * QWEN_MOE.active_decoder_params
    assert QWEN_MOE.linear_flops_per_token < 0.12 * 2.0 * QWEN_MOE.decoder_params  # 8 of 128 experts
    assert V3.weight_bytes(2) == (V3.decoder_params + V3.lm_head_params) * 2  # every expert held
    assert V3.weight_bytes(2) / 1e9 == pytest.approx(1340, rel=0.01)


@pytest.mark.parametrize("config, preset", [(DEEPSEEK_V3_CONFIG, "DeepSeek-V3"),
                                            (QWEN3_30B_A3B_CONFIG, "Qwen3-30B-A3B")])
def test_the_config_reader_gives_the_preset(config, preset):
    assert spec_from_config(config, preset) == get_model(preset)


def test_deepseek_v2_lite_reads_a_plain_q_projection():
    spec = spec_from_config(DEEPSEEK_V2_LITE_CONFIG, "DeepSeek-V2-Lite")
    assert (spec.q_lora_rank, spec.shared_intermediate_size, spec.dense_layers) == (0, 2 * 1408, 1)
    assert spec.total_params / 1e9 == pytest.approx(15.7, rel=0.02)  # DeepSeek-V2 report: 15.7B


def test_qwen3_moe_dense_layers_follow_sparse_step_and_mlp_only_layers():
    config = {**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert spec_from_config(config).dense_layers == 5  # sparse: layers 1, 5, 7 ((i + 1) % 2 == 0, not 3)
    assert not spec_from_config({**config, "mlp_only_layers": list(range(8))}).moe


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ModelSpecError, match="model_type: 'mixtral' is not a family the planner models"):
        spec_from_config({**QWEN3_30B_A3B_CONFIG, "model_type": "mixtral"})
    with pytest.raises(ModelSpecError, match="kv_lora_rank: missing"):
        spec_from_config({k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "kv_lora_rank"})


def test_a_spec_says_what_its_config_says():
    """The engine answers for a spec from its config, so the two cannot drift apart: a spec
    changed without its config is refused naming the field, and experts or a latent come from
    a config alone."""
    with pytest.raises(ModelSpecError, match="moe_intermediate_size: Qwen3-30B-A3B: 6 where its config says 768"):
        dataclasses.replace(QWEN_MOE, moe_intermediate_size=6)
    with pytest.raises(ModelSpecError, match="config: a mixture-of-experts or latent-attention model is read"):
        ModelSpec("moe", 2, 64, 4, 2, 16, 128, 512, 4096, num_experts=8, experts_per_token=2, moe_intermediate_size=32)


def _hf_model(family: str):
    """A small random-weight model of the family, built by transformers from its config."""
    import transformers

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=24,
                 num_hidden_layers=4, num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=256)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**shape, num_key_value_heads=2, head_dim=16, num_experts=8,
                                             decoder_sparse_step=2, mlp_only_layers=[3])
    else:
        mla = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
                   n_routed_experts=8, first_k_dense_replace=1)
        config = (transformers.DeepseekV3Config(**shape, **mla, q_lora_rank=32, n_shared_experts=1, n_group=2,
                                                topk_group=1) if family == "deepseek_v3" else
                  transformers.DeepseekV2Config(**shape, **mla, q_lora_rank=None, n_shared_experts=2))
    return config, transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_parameter_counts_equal_transformers_models(family):
    """Every matrix transformers builds (norms aside, which the cost model leaves out), for a
    config object and for its config.json alike."""
    config, model = _hf_model(family)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    spec = spec_from_config(config)
    assert spec.total_params == matrices
    assert spec_from_config(config.to_dict()) == spec


def test_mla_holds_a_latent_per_token_where_gqa_holds_keys_and_values_per_kv_head():
    assert V3.kv_bytes_per_token(2) == 61 * (512 + 64) * 2  # 70,272 bytes
    assert LLAMA.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2  # 327,680 bytes
    # a rank's cache: its share of the KV heads, or the whole latent
    assert LLAMA.kv_bytes_per_token(2, tp=8) == LLAMA.kv_bytes_per_token(2) / 8
    assert V3.kv_bytes_per_token(2, tp=32) == V3.kv_bytes_per_token(2)
    h100 = GPU_PROFILES["H100"]
    # GQA splits its heads over the ranks; MLA's latent has no head axis: every rank holds it whole
    assert CostModel(LLAMA, h100, 8).worker_kv_bytes_per_token == LLAMA.kv_bytes_per_token(2)
    assert CostModel(V3, h100, 32).worker_kv_bytes_per_token == 32 * V3.kv_bytes_per_token(2)


def test_attention_flops_use_mla_q_k_and_value_dims():
    assert V3.attention_flops_per_pair == 2.0 * 61 * 128 * ((128 + 64) + 128)
    assert LLAMA.attention_flops_per_pair == 4.0 * 80 * 64 * 128


def test_a_moe_decode_step_streams_the_experts_its_batch_touches():
    e, k = V3.num_experts, V3.experts_per_token
    assert V3.expected_experts(1) == pytest.approx(k)
    assert V3.expected_experts(2) == pytest.approx(2 * k - k * k / e)  # two tokens share k^2 / E on average
    assert V3.expected_experts(4096) == pytest.approx(e)
    one, many = V3.streamed_weight_bytes(1, 2), V3.streamed_weight_bytes(4096, 2)
    # batch 1: the active parameters but the embedding (a row lookup); a large batch: nearly everything
    assert one == (V3.active_params - V3.lm_head_params) * 2
    assert one < 0.06 * V3.weight_bytes(2) and many == pytest.approx(V3.weight_bytes(2), rel=1e-6)


def test_the_cost_model_times_a_moe_decode_step_by_the_bytes_it_streams():
    tiny_moe = spec_from_config(dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32), "tiny-moe")
    c = CostModel(tiny_moe, DEVICE)  # 1 GB/s, 1e11 FLOP/s, 1 ms a step; compute and memory overlap
    for batch in (1, 64):
        memory = (tiny_moe.streamed_weight_bytes(batch, 2) + batch * 100 * c.kv_bytes_per_token) / 1e9
        compute = (batch * (tiny_moe.linear_flops_per_token + tiny_moe.lm_head_flops)
                   + batch * 100 * tiny_moe.attention_flops_per_pair) / 1e11
        assert c.decode_s(batch, batch * 100) == pytest.approx(1e-3 + max(memory, compute))
    assert tiny_moe.streamed_weight_bytes(1, 2) < tiny_moe.streamed_weight_bytes(64, 2) < tiny_moe.weight_bytes(2) + 1
    assert c.kv_capacity_tokens() == int((1e9 * 0.9 - tiny_moe.weight_bytes(2)) / c.kv_bytes_per_token)


def test_tp_degrees_are_the_engines_own_rule():
    """What the engine's layers refuse, built at the size: heads, KV heads, expert widths, and
    the dense MLP of DeepSeek's first 3 layers of 61 (one layer of each kind is built)."""
    assert tp_refusal(LLAMA, 16) == "num_key_value_heads (8) is not divisible by tensor_parallel_size (16)"
    assert tp_refusal(LLAMA, 3) == "num_attention_heads (64) is not divisible by tensor_parallel_size (3)"
    assert tp_refusal(QWEN_MOE, 8) == "num_key_value_heads (4) is not divisible by tensor_parallel_size (8)"
    assert tp_refusal(V3, 32) is None  # 128 heads, and MLA's latent is held whole
    assert [tp for tp in (1, 2, 3, 4, 8, 16, 32) if tp_refusal(LLAMA, tp) is None] == [1, 2, 4, 8]
    odd_experts = spec_from_config({**QWEN3_30B_A3B_CONFIG, "moe_intermediate_size": 6})
    assert tp_refusal(odd_experts, 4) == "moe_intermediate_size (6) is not divisible by tensor_parallel_size (4)"
    odd_dense = spec_from_config({**DEEPSEEK_V3_CONFIG, "intermediate_size": 18430})
    assert tp_refusal(odd_dense, 4) == "intermediate_size (18430) is not divisible by tensor_parallel_size (4)"
    odd_routed = spec_from_config({**DEEPSEEK_V3_CONFIG, "moe_intermediate_size": 2050})
    assert tp_refusal(odd_routed, 4) == "moe_intermediate_size (2050) is not divisible by tensor_parallel_size (4)"
    opt = get_model("OPT-13B")  # no family reads OPT: asked as the engine's shared decoder of its shape
    assert tp_refusal(opt, 16) == "num_attention_heads (40) is not divisible by tensor_parallel_size (16)"
    assert tp_refusal(opt, 8) is None
    with pytest.raises(CostError, match=r"tp: num_key_value_heads \(8\)"):
        CostModel(LLAMA, GPU_PROFILES["H100"], 16)


def test_pools_of_different_tp_pair_where_one_divides_the_other():
    assert pair_refusal(8, 2) is None and pair_refusal(1, 4) is None
    assert "one divides the other" in pair_refusal(4, 6)


def test_kv_transfers_between_pools_of_different_tp():
    h100 = GPU_PROFILES["H100"]
    link, fixed = h100.kv_link_bw, h100.kv_transfer_overhead_s
    gqa = CostModel(LLAMA, h100, 8)
    # by head, over as many links as the pool with fewer ranks has
    assert gqa.transfer_s(1000, decode_tp=2) == pytest.approx(fixed + 1000 * LLAMA.kv_bytes_per_token(2) / (2 * link))
    assert gqa.transfer_s(1000) == pytest.approx(fixed + 1000 * LLAMA.kv_bytes_per_token(2) / (8 * link))
    # MLA: each decode rank reads the whole latent over its own link
    mla = CostModel(V3, h100, 32)
    assert mla.transfer_s(1000, decode_tp=32) == pytest.approx(fixed + 1000 * V3.kv_bytes_per_token(2) / link)


def test_a_tp_group_wider_than_a_node_all_reduces_over_the_nics():
    h100 = GPU_PROFILES["H100"]
    in_node = dataclasses.replace(h100, devices_per_node=32)
    assert CostModel(V3, h100, 32)._allreduce_s(64) > 2 * CostModel(V3, in_node, 32)._allreduce_s(64)

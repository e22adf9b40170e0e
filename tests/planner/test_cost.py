import pytest

from pdserve.planner.cost import CostError, CostModel
from pdserve.planner.hardware import GPU_PROFILES, HardwareProfile, ProfileError, get_profile
from pdserve.planner.model_spec import ModelSpecError, get_model, spec_from_config
from tests.factories import TINY_LLAMA
from tests.planner.helpers import DEVICE, TINY, cost


@pytest.mark.parametrize("name, billions", [("Llama-3.1-8B", 8.03), ("Llama-3.1-70B", 70.6), ("OPT-13B", 12.9),
                                            ("SmolLM2-135M", 0.135)])
def test_presets_have_the_published_parameter_counts(name, billions):
    assert get_model(name).total_params / 1e9 == pytest.approx(billions, rel=0.04)


def test_spec_from_a_hf_config():
    spec = spec_from_config({**TINY_LLAMA, "model_type": "llama"}, "tiny")
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads, spec.head_dim) == (2, 64, 2, 16)
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_unknown_model_names_the_field():
    with pytest.raises(ModelSpecError, match="model: unknown model 'nope'"):
        get_model("nope")


def test_decode_at_batch_one_is_weights_over_bandwidth():
    c = cost()
    memory = (TINY.weight_bytes(2) + 100 * c.kv_bytes_per_token) / 1e9
    assert c.decode_s(1, 100) == pytest.approx(1e-3 + memory)


def test_decode_turns_compute_bound_at_large_batches():
    c = cost()
    per_token = [c.decode_s(b, 0) / b for b in (1, 8, 64, 4096, 8192)]
    assert per_token[0] > per_token[1] > per_token[2]  # weights are shared by the batch
    compute = 8192 * (TINY.linear_flops_per_token + TINY.lm_head_flops) / 1e11
    assert c.decode_s(8192, 0) == pytest.approx(1e-3 + compute)  # the compute bound wins
    assert per_token[3] == pytest.approx(per_token[4], rel=0.1)


def test_prefill_has_attention_s_quadratic_term():
    c = cost()
    body = lambda n, ctx=0: c.prefill_s([(n, ctx)]) - 1e-3
    assert body(2000) > 2 * body(1000)
    pairs = 1000 * 1000 + 1000 * 1001 / 2
    assert body(1000, 1000) - body(1000) == pytest.approx((pairs - 1000 * 1001 / 2) * TINY.attention_flops_per_pair / 1e11)


def test_transfer_is_a_fixed_cost_plus_bytes_over_the_link():
    c = cost()
    assert c.transfer_s(1000) == pytest.approx(1e-3 + 1000 * c.kv_bytes_per_token / 1e8)


def test_cpu_profile_adds_compute_and_memory():
    cpu = HardwareProfile(**{**DEVICE.__dict__, "overlap": False})
    gpu_like = cost().decode_s(64, 1000)
    assert CostModel(TINY, cpu).decode_s(64, 1000) > gpu_like


def test_tensor_parallelism_splits_the_work_and_adds_all_reduces():
    h100 = GPU_PROFILES["H100"]
    with pytest.raises(CostError, match="tp: .*do not fit 1 x H100"):
        CostModel(get_model("Llama-3.1-70B"), h100, 1).kv_capacity_tokens()
    tp4, tp8 = CostModel(get_model("Llama-3.1-70B"), h100, 4), CostModel(get_model("Llama-3.1-70B"), h100, 8)
    assert tp8.kv_capacity_tokens() > 2 * tp4.kv_capacity_tokens()
    assert tp8.decode_s(1, 1000) < tp4.decode_s(1, 1000)
    assert tp8._allreduce_s(1) > 0 == CostModel(get_model("Llama-3.1-8B"), h100, 1)._allreduce_s(1)
    with pytest.raises(CostError, match=r"tp: num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        CostModel(TINY, DEVICE, 3)


def test_profile_round_trips_and_rejects_unknown_keys(tmp_path):
    path = tmp_path / "p.json"
    DEVICE.save(path)
    assert HardwareProfile.load(path) == DEVICE
    path.write_text('{"name": "x", "bogus": 1}')
    with pytest.raises(ProfileError, match="bogus: unknown key"):
        HardwareProfile.load(path)
    with pytest.raises(ProfileError, match="hardware: unknown profile 'TPU'"):
        get_profile("TPU")
    assert get_profile("h100") is GPU_PROFILES["H100"]
    for hw in GPU_PROFILES.values():
        assert hw.source and 0 < hw.flops_efficiency < 1 and 0 < hw.mem_bw_efficiency < 1


def test_memory_utilization_sets_the_kv_capacity():
    a100 = GPU_PROFILES["A100"]
    at90, at95 = CostModel(get_model("OPT-13B"), a100, 1), CostModel(get_model("OPT-13B"), a100, 1, mem_util=0.95)
    assert at95.kv_capacity_tokens() - at90.kv_capacity_tokens() == pytest.approx(
        0.05 * a100.mem_bytes / at90.kv_bytes_per_token, abs=2)
    with pytest.raises(CostError) as err:
        CostModel(TINY, DEVICE, 1, mem_util=1.5)
    assert err.value.field == "mem_util"


def test_fitted_step_cost_applies_the_published_form_in_ms():
    from pdserve.planner.cost import FittedStepCost

    fit = FittedStepCost(cost(), prefill_ms=(10.0, 0.1, 1e-4), decode_small_ms=(20.0, 0.001, 0.5),
                         decode_large_ms=(5.0, 0.002, 1.0), large_batch=4)
    # prefill: a + b * tokens + c * sum(len^2), over the prompts of the batch
    assert fit.prefill_s([(100, 0), (200, 0)]) == pytest.approx((10 + 0.1 * 300 + 1e-4 * (100**2 + 200**2)) / 1e3)
    # decode: a + b * context + c * batch; the large-batch fit from ``large_batch`` sequences on
    assert fit.decode_s(3, 1000) == pytest.approx((20 + 1 + 1.5) / 1e3)
    assert fit.decode_s(4, 1000) == pytest.approx((5 + 2 + 4) / 1e3)
    assert fit.decode_s(0, 0) == 0.0
    # capacity and transfers are the base model's
    assert fit.kv_capacity_tokens() == cost().kv_capacity_tokens()
    assert fit.transfer_s(100) == cost().transfer_s(100)


def test_measured_decode_points_correct_the_formula_for_the_model_they_ran():
    import dataclasses

    smol = get_model("SmolLM2-135M")
    base = dataclasses.replace(DEVICE, overlap=False, dtype_bytes=2)
    plain = CostModel(smol, base)
    f = plain.decode_s
    # measured: 10% over the formula at batch 2, context 100; 30% over at context 300; 20% under at batch 4
    points = ((2, 100, 1.1 * f(2, 200)), (2, 300, 1.3 * f(2, 600)), (4, 100, 0.8 * f(4, 400)))
    hw = dataclasses.replace(base, decode_points=points, points_model=smol.shape)
    measured = CostModel(smol, hw)
    assert measured.decode_s(2, 200) == pytest.approx(points[0][2], rel=1e-12)  # the measured points themselves
    assert measured.decode_s(2, 600) == pytest.approx(points[1][2], rel=1e-12)
    assert measured.decode_s(2, 400) == pytest.approx(1.2 * f(2, 400), rel=1e-12)  # linear between contexts
    assert measured.decode_s(2, 2000) == pytest.approx(1.3 * f(2, 2000), rel=1e-12)  # held past the last
    assert measured.decode_s(3, 300) == pytest.approx(1.1 * f(3, 300), rel=1e-12)  # nearest batch (ties: smaller)
    assert measured.decode_s(64, 64 * 100) == pytest.approx(0.8 * f(64, 6400), rel=1e-12)
    assert measured.formula_decode_s(2, 200) == f(2, 200)
    # measured on another model, or at another tensor parallelism: the formula alone
    assert CostModel(TINY, dataclasses.replace(hw, dtype_bytes=2)).decode_s(2, 200) == CostModel(TINY, base).decode_s(2, 200)
    on_tiny = dataclasses.replace(hw, points_model=TINY.shape)
    assert CostModel(TINY, on_tiny).decode_s(2, 200) != CostModel(TINY, base).decode_s(2, 200)
    assert CostModel(TINY, on_tiny, 2).decode_s(2, 200) == CostModel(TINY, base, 2).decode_s(2, 200)


def test_a_profile_with_decode_points_round_trips_through_json(tmp_path):
    import dataclasses

    smol = get_model("SmolLM2-135M")
    hw = dataclasses.replace(DEVICE, decode_points=((1, 128, 0.015), (1, 512, 0.017)), points_model=smol.shape,
                             prefill_attention_flops=5e10, decode_attention_flops=2e10)
    hw.save(tmp_path / "p.json")
    back = HardwareProfile.load(tmp_path / "p.json")
    assert back == hw and hash(back) == hash(hw)


def test_what_serving_adds_comes_on_top_of_the_measured_step():
    import dataclasses

    smol = get_model("SmolLM2-135M")
    base = dataclasses.replace(DEVICE, overlap=False, dtype_bytes=2)
    f = CostModel(smol, base).decode_s
    hw = dataclasses.replace(base, decode_points=((4, 100, 1.5 * f(4, 400)),), points_model=smol.shape,
                             served_step_s=2e-3, served_seq_s=1e-4)
    assert CostModel(smol, hw).decode_s(4, 400) == pytest.approx(1.5 * f(4, 400) + 2e-3 + 4e-4, rel=1e-12)


def test_a_served_prefill_factor_scales_the_prefill_step():
    import dataclasses

    base = dataclasses.replace(DEVICE, overlap=False)
    served = CostModel(TINY, dataclasses.replace(base, served_prefill_factor=1.07))
    assert served.prefill_s([(256, 0), (256, 0)]) == pytest.approx(1.07 * CostModel(TINY, base).prefill_s([(256, 0), (256, 0)]))


def test_a_served_decode_factor_scales_the_engine_step_not_what_serving_adds():
    import dataclasses

    smol = get_model("SmolLM2-135M")
    base = dataclasses.replace(DEVICE, overlap=False, dtype_bytes=2, served_step_s=2e-3, served_seq_s=1e-4)
    engine = CostModel(smol, dataclasses.replace(base, served_step_s=0.0, served_seq_s=0.0)).decode_s(4, 400)
    slower = CostModel(smol, dataclasses.replace(base, served_decode_factor=1.2))
    assert slower.decode_s(4, 400) == pytest.approx(1.2 * engine + 2e-3 + 4e-4, rel=1e-12)
    assert CostModel(smol, base).decode_s(4, 400) == engine + 2e-3 + 4e-4  # 1.0 leaves it as it was

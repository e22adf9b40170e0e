"""The CPU profile's fit recovers the costs that generated the step times, and the
measurement takes the points the fit needs from a real engine."""

import dataclasses

import pytest

from pdserve.planner.cost import CostModel
from pdserve.planner.model_spec import get_model
from pdserve.planner.profile import CALIBRATION, QUICK, Point, fit, measure, profile_engine
from tests.planner.helpers import DEVICE

SMOL = get_model("SmolLM2-135M")


def _points(cost: CostModel) -> list[Point]:
    points = [Point("prefill", 1, n, cost.prefill_s([(n, 0)])) for n in (64, 256, 512, 1024)]
    return points + [Point("decode", b, c, cost.decode_s(b, b * c)) for b in range(1, 17) for c in (128, 512)]


def test_fit_recovers_a_known_profile_with_attention_at_its_own_rates():
    truth = dataclasses.replace(DEVICE, name="cpu", peak_flops=2e10, peak_mem_bw=5e9, step_overhead_s=4e-3,
                                seq_overhead_s=6e-3, overlap=False, dtype_bytes=4,
                                prefill_attention_flops=8e9, decode_attention_flops=1e9)
    f = fit(SMOL, 4, _points(CostModel(SMOL, truth)), mem_bw=5e9)
    assert f.overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert f.seq_overhead_s == pytest.approx(6e-3, rel=1e-3)
    assert f.mem_bw == 5e9
    assert f.flops == pytest.approx(2e10, rel=1e-3)
    assert f.prefill_attention_flops == pytest.approx(8e9, rel=1e-3)
    assert f.decode_attention_flops == pytest.approx(1e9, rel=1e-3)


def test_fit_without_attention_rates_is_the_four_term_fit():
    truth = dataclasses.replace(DEVICE, name="cpu", peak_flops=2e10, peak_mem_bw=5e9, step_overhead_s=4e-3,
                                seq_overhead_s=6e-3, overlap=False, dtype_bytes=4)
    f = fit(SMOL, 4, _points(CostModel(SMOL, truth)), attention=False)
    assert f.overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert f.mem_bw == pytest.approx(5e9, rel=1e-3)
    assert f.flops == pytest.approx(2e10, rel=1e-3)
    assert f.prefill_attention_flops is None and f.decode_attention_flops is None


def test_a_profile_with_attention_rates_charges_attention_at_them():
    base = dataclasses.replace(DEVICE, overlap=False, dtype_bytes=2)
    slow = dataclasses.replace(base, prefill_attention_flops=base.flops / 10, decode_attention_flops=base.flops / 10)
    plain, attn = CostModel(SMOL, base), CostModel(SMOL, slow)
    pairs = 512 * 513 / 2
    assert attn.prefill_s([(512, 0)]) - plain.prefill_s([(512, 0)]) == pytest.approx(
        9 * pairs * SMOL.attention_flops_per_pair / base.flops, rel=1e-9)
    assert attn.decode_s(4, 4 * 300) - plain.decode_s(4, 4 * 300) == pytest.approx(
        9 * 1200 * SMOL.attention_flops_per_pair / base.flops, rel=1e-9)


def test_fit_keeps_every_term_non_negative():
    points = [Point("prefill", 1, n, 0.01) for n in (64, 512)] + [Point("decode", 4, 128, 0.02)]
    f = fit(SMOL, 4, points)
    assert f.overhead_s >= 0 and f.seq_overhead_s >= 0 and f.mem_bw > 0 and f.flops > 0
    assert f.prefill_attention_flops > 0 and f.decode_attention_flops > 0


def test_measure_times_every_decode_batch_of_a_real_engine(tiny_llama_dir):
    """The quick measurement of a real (tiny, random) engine: prefill at each length, and
    decode at every batch from 4 down to 1 at each context, each holding at least that
    context, all from one prefill per context; nothing left running after."""
    from tests.factories import make_engine

    engine = make_engine(tiny_llama_dir[0])
    points = measure(engine, dataclasses.replace(QUICK, cpu_time=True), progress=False)  # as the calibration times
    assert [(p.kind, p.tokens) for p in points if p.kind == "prefill"] == [("prefill", n) for n in (32, 128, 256)]
    decode = [(p.batch, p.tokens) for p in points if p.kind == "decode"]
    assert [b for b, _ in decode] == [4, 3, 2, 1] * 2
    assert all(64 < c < 64 + 32 for _, c in decode[:4]) and all(256 < c < 256 + 32 for _, c in decode[4:])
    assert all(p.seconds > 0 for p in points)
    assert not engine.has_unfinished() and engine.blocks.usage == 0


def test_a_sweep_on_cpu_time_takes_one_thread():
    """The calibration times the measuring thread's CPU clock: with more threads it would miss their work."""
    with pytest.raises(ValueError, match="threads: a sweep on CPU time times one thread, got 2"):
        profile_engine(threads=2, sweep=CALIBRATION)

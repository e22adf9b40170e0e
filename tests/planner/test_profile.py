"""The CPU profile's fit recovers the costs that generated the step times."""

import dataclasses

import pytest

from planner.cost import CostModel
from planner.model_spec import PRESETS
from planner.profile import Point, fit
from tests.planner.helpers import DEVICE

SMOL = PRESETS["SmolLM2-135M"]


def test_fit_recovers_a_known_profile():
    truth = dataclasses.replace(DEVICE, name="cpu", peak_flops=2e10, peak_mem_bw=5e9, step_overhead_s=4e-3,
                                seq_overhead_s=6e-3, overlap=False, dtype_bytes=4)
    cost = CostModel(SMOL, truth)
    points = [Point("prefill", 1, n, cost.prefill_s([(n, 0)])) for n in (64, 256, 512, 1024)]
    points += [Point("decode", b, c, cost.decode_s(b, b * c)) for b in (1, 4, 16) for c in (128, 512)]
    f = fit(SMOL, 4, points)
    assert f.overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert f.seq_overhead_s == pytest.approx(6e-3, rel=1e-3)
    assert f.mem_bw == pytest.approx(5e9, rel=1e-3)
    assert f.flops == pytest.approx(2e10, rel=1e-3)


def test_fit_keeps_every_term_non_negative():
    points = [Point("prefill", 1, n, 0.01) for n in (64, 512)] + [Point("decode", 4, 128, 0.02)]
    f = fit(SMOL, 4, points)
    assert f.overhead_s >= 0 and f.seq_overhead_s >= 0 and f.mem_bw > 0 and f.flops > 0

"""Elastic roles in the simulator (pdserve/planner/elastic.py): the real budget policy replayed
over a workload whose mix shifts, and ``pdserve plan --elastic``."""

from __future__ import annotations

import numpy as np
import pytest
from pdserve.cli import main
from pdserve.planner.elastic import ElasticDriver, compare_layouts
from pdserve.planner.hardware import get_profile
from pdserve.planner.metrics import Slo
from pdserve.planner.model_spec import get_model
from pdserve.planner.search import PlanRequest
from pdserve.planner.layout import Layout
from pdserve.planner.synthetic import LengthMix, shifting
from tests.planner.helpers import simulate

LONG_PROMPTS = LengthMix(3000, 60, 0.5, 8192)
LONG_ANSWERS = LengthMix(200, 900, 0.5, 8192)
REQ = PlanRequest(get_model("Llama-3.1-8B"), get_profile("H100"), 1.0, LONG_PROMPTS, Slo(1.0, 0.05))


def phases(rate_prompts: float = 25, rate_answers: float = 40, seconds: float = 150):
    return shifting([(seconds, rate_prompts, LONG_PROMPTS), (seconds, rate_answers, LONG_ANSWERS),
                     (seconds, rate_prompts, LONG_PROMPTS)])


def test_shifting_phases_are_back_to_back_poisson_runs():
    trace = phases(seconds=100)
    t = np.array([r.t for r in trace])
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 300
    middle = [r for r in trace if 100 <= r.t < 200]
    assert np.mean([r.output_tokens for r in middle]) > 5 * np.mean([r.output_tokens for r in trace if r.t < 100])


def test_the_budget_policy_follows_the_mix_and_loses_no_request():
    """Four H100 workers from 2P:2D: long prompts pull a worker to prefill, long answers pull
    workers back to decode, and the long prompts again to prefill. Every request finishes, and
    the worker count never changes."""
    from pdserve.planner.cost import CostModel
    from pdserve.planner.layout import ClusterSpec
    from pdserve.planner.simulator import Simulator

    driver = ElasticDriver()
    spec = ClusterSpec(Layout(2, 2), CostModel(REQ.model, REQ.hw, 1), CostModel(REQ.model, REQ.hw, 1), REQ.limits)
    trace = phases()
    result = Simulator(spec, trace, autoscaler=driver).run()
    assert result.failed == 0 and np.isfinite(result.finish).all()
    takers = [(decided, taker) for decided, _, _, taker in driver.switches]
    assert any(t < 150 and taker == "prefill" for t, taker in takers), takers
    assert any(150 <= t < 300 and taker == "decode" for t, taker in takers), takers
    assert any(t >= 300 and taker == "prefill" for t, taker in takers), takers
    serving = [s for _, s, _, _ in driver.switches]
    assert all(b - a >= driver.config.dwell_s for a, b in zip(serving, serving[1:])), driver.switches
    for t, ready_p, _, _ in driver.history["prefill"]:
        ready_d = next(r for tt, r, _, _ in driver.history["decode"] if tt == t)
        assert 3 <= ready_p + ready_d <= 4  # one worker at most is between roles
    assert all(d <= s for d, s, _, _ in driver.switches)


def test_a_fixed_layout_is_unchanged_by_the_driver_when_nothing_presses():
    from tests.planner.helpers import requests
    driver = ElasticDriver()
    r = simulate(Layout(prefill=1, decode=1), requests(*[(i * 0.5, 100, 5) for i in range(40)]), autoscaler=driver)
    assert r.failed == 0 and driver.switches == []


def test_the_comparison_runs_every_fixed_split_then_elastic():
    """The goodputs themselves are the benchmark's (benchmarks/elastic_plan.py, BENCHMARKS.md)."""
    rows = compare_layouts(REQ, phases(seconds=20), Layout(2, 2))
    assert [name for name, _ in rows] == ["1P (TP1) : 3D (TP1)", "2P (TP1) : 2D (TP1)", "3P (TP1) : 1D (TP1)",
                                          "4 colocated worker(s) x TP1", "elastic from 2P (TP1) : 2D (TP1)"]
    assert all(r.failed == 0 for _, r in rows)


def test_cli_compares_fixed_and_elastic_layouts(capsys):
    assert main(["plan", "--model", "Llama-3.1-8B", "--hardware", "H100", "--rate", "5", "--requests", "100",
                 "--layout", "1P:2D", "--elastic"]) == 0
    out = capsys.readouterr().out
    for name in ("1P (TP1) : 2D (TP1)", "2P (TP1) : 1D (TP1)", "3 colocated worker(s) x TP1",
                 "elastic from 1P (TP1) : 2D (TP1)"):
        assert name in out
    assert main(["plan", "--elastic"]) == 2
    assert "--elastic: needs --layout" in capsys.readouterr().err
    assert main(["plan", "--layout", "3C", "--elastic"]) == 2
    assert "elastic roles start from a disaggregated layout" in capsys.readouterr().err
    assert main(["plan", "--layout", "0P:2D", "--elastic"]) == 2


def test_two_workers_under_long_prompts_make_the_decode_worker_mixed_in_place():
    """1P:1D: both pools at their minimum, so no whole move. Long prompts press the prefill pool
    while decode idles: the decode worker becomes mixed at once (no drain), prompts then prefill
    on it too, and every request finishes."""
    from pdserve.planner.cost import CostModel
    from pdserve.planner.layout import ClusterSpec
    from pdserve.planner.simulator import Simulator

    driver = ElasticDriver()
    spec = ClusterSpec(Layout(1, 1), CostModel(REQ.model, REQ.hw, 1), CostModel(REQ.model, REQ.hw, 1), REQ.limits)
    sim = Simulator(spec, phases(12, 20, seconds=60), autoscaler=driver)
    result = sim.run()
    assert result.failed == 0 and np.isfinite(result.finish).all()
    assert driver.switches and driver.switches[0][2:] == ("decode", "mixed"), driver.switches
    decided, serving, _, _ = driver.switches[0]
    assert serving - decided == pytest.approx(driver.switch_s)  # nothing drained
    assert max(n for _, n in driver.mixed_history) == 1
    assert all(r + d == 2 for (_, r, _, _), (_, d, _, _) in zip(driver.history["prefill"], driver.history["decode"]))
    (mixed,) = [w for w in sim.pools["decode"] if w.wid in sim.mixed] or [None]
    assert mixed is not None and mixed.role == "colocated"  # its prefills stall its streams, as served


def test_a_decode_worker_changing_role_moves_its_streams_with_their_kv_past_the_grace():
    """The same shifting mix over 2P:2D. Where a decode worker goes to prefill, a patient policy
    (a grace longer than any answer) waits for its streams to end; the default hands them over
    with their KV at the grace (``Simulator.hand_over``), so the switch is served within a tick
    or two of it, and every moved stream still finishes, with all its tokens."""
    from pdserve.cluster.autoscaling.budget import BudgetConfig
    from pdserve.planner.cost import CostModel
    from pdserve.planner.layout import ClusterSpec
    from pdserve.planner.simulator import Simulator

    spec = ClusterSpec(Layout(2, 2), CostModel(REQ.model, REQ.hw, 1), CostModel(REQ.model, REQ.hw, 1), REQ.limits)
    waits = {}
    for grace_s in (BudgetConfig().grace_s, 1e6):
        driver = ElasticDriver(BudgetConfig(grace_s=grace_s))
        result = Simulator(spec, phases(), autoscaler=driver).run()
        assert result.failed == 0 and np.isfinite(result.finish).all()
        assert (result.output_tokens > 0).all()
        waits[grace_s] = [serving - decided for decided, serving, donor, taker in driver.switches
                          if (donor, taker) == ("decode", "prefill")]
    quick, patient = waits[BudgetConfig().grace_s], waits[1e6]
    assert quick and patient, waits
    assert max(quick) <= BudgetConfig().grace_s + 2 * driver.interval_s + driver.switch_s, waits
    assert max(patient) > 5.0, waits  # the long answers' streams ran to their end first

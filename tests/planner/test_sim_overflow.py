"""The simulator's two serving rules beyond prefill first: prefill that keeps up (a decode
worker prefills a prompt the prefill pool is too far behind for) and time-sized chunks (a
worker with streams takes a prompt in chunks that fit its step target). Simulated time only."""

import numpy as np

import pdserve.planner.simulator as simulator_module
from pdserve.engine.core.step_budget import StepBudget
from pdserve.planner import auto_layout
from pdserve.planner.cost import CostModel
from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.mixed_step import chunk_s
from pdserve.planner.simulator import Simulator
from pdserve.planner.trace import TraceRequest
from pdserve.planner.worker import EngineLimits, SimSeq, SimWorker
from tests.helpers.planner_profiles import CORE, SMOL

COST = CostModel(SMOL, CORE, 1)  # one CPU core: a 256-token prompt takes about 0.7 s
TARGET = 0.05


def burst() -> list[TraceRequest]:
    """One prompt alone (the router learns the prefill pace from its answer), then ten at once."""
    return [TraceRequest(0.0, 256, 16)] + [TraceRequest(3.0 + 0.01 * i, 256, 16) for i in range(10)]


class Counting(Simulator):
    """Counts the prompts its decode workers took because the prefill pool was behind."""

    overflowed = 0

    def _place_behind(self, seq):
        taken = super()._place_behind(seq)
        self.overflowed += taken
        return taken


def run(reqs, **spec_kw):
    sim = Counting(ClusterSpec(Layout(prefill=1, decode=1), COST, COST, **spec_kw), reqs)
    return sim, sim.run()


def test_a_burst_overflows_to_the_decode_worker_and_the_ttft_tail_falls():
    off_sim, off = run(burst())
    on_sim, on = run(burst(), overflow_ttft_s=1.0, step_target_s=TARGET)
    assert off_sim.overflowed == 0 and 0 < on_sim.overflowed < 10
    assert on.completed == off.completed == 11
    assert np.max(on.ttft) < 0.8 * np.max(off.ttft)
    assert np.percentile(on.ttft, 90) < np.percentile(off.ttft, 90)


def test_overflow_without_a_pace_yet_sends_nothing_to_the_decode_worker():
    sim, _ = run([TraceRequest(0.01 * i, 256, 16) for i in range(6)], overflow_ttft_s=1.0)
    assert sim.overflowed == 0  # no prefill answer yet when the burst arrives: the router has no pace


def test_with_both_off_the_result_is_the_one_without_the_settings():
    reqs = burst() + [TraceRequest(5.0 + 0.3 * i, 200 + 7 * i, 30) for i in range(20)]
    _, plain = run(reqs)
    _, off = run(reqs, overflow_ttft_s=0.0, step_target_s=0.0)
    for name in ("arrival", "first_token", "finish", "itl_values", "itl_weights"):
        assert np.array_equal(getattr(plain, name), getattr(off, name), equal_nan=True), name


def streams_with_a_local_prompt(role: str, target: float) -> tuple[list[float], int]:
    """A worker decoding four streams takes a 1024-token prompt: every step's ITL until the
    prompt's first token, and the prompt tokens the steps carried."""
    w = SimWorker("w", role, COST, EngineLimits(), step_target_s=target)
    for rid in range(4):
        s = SimSeq(rid, rid, 64, 500)
        s.tokens = 64
        w.join(s)
    w.add_prompt(SimSeq(9, 9, 1024, 10))
    now, itls, carried = 0.0, [], 0
    while w.queued_tokens:
        now = w.start(now)
        carried += sum(n for _, n in w._batch)
        out = w.finish()
        if out.itl is not None:
            itls.append(out.itl[0])
    return itls, carried


def test_a_mixed_step_keeps_the_streams_near_the_target():
    itls, carried = streams_with_a_local_prompt("decode", TARGET)
    slack = chunk_s(COST, [(StepBudget.start_tokens, 1024)], 1)  # one start-size chunk before the budget knows
    assert carried == 1024
    assert max(itls) <= TARGET + slack
    assert len(itls) >= 1024 // StepBudget.start_tokens  # the prompt went in many chunks
    stalled, _ = streams_with_a_local_prompt("colocated", 0.0)  # prefill first: one step, the whole prompt
    assert max(stalled) > 10 * TARGET


def test_the_chunk_follows_the_budget_arithmetic_once_it_has_samples():
    w = SimWorker("w", "decode", COST, EngineLimits(), step_target_s=TARGET)
    w.budget.decode_s, w.budget.token_s = 0.02, 0.001
    s = SimSeq(0, 0, 64, 100)
    s.tokens = 64
    w.join(s)
    w.add_prompt(SimSeq(1, 1, 1024, 10))
    w.start(0.0)
    assert w._kind == "mixed" and [n for _, n in w._batch] == [30]  # (0.05 - 0.02) / 0.001


def test_simulate_runs_what_serve_would_for_each_candidate(monkeypatch):
    specs = {}

    class Recorder:
        def __init__(self, spec, trace, autoscaler=None):
            self.spec = spec

        def run(self):
            specs[name] = self.spec

    monkeypatch.setattr(simulator_module, "Simulator", Recorder)
    objective = auto_layout.Objective(auto_layout.Slo(ttft_s=3.0, tpot_s=0.08), requests=10)
    for c in auto_layout.candidates(2):
        name = c.name
        auto_layout.simulate(SMOL, CORE, c, 1.0, objective)
    split, colocated, elastic = (specs[n] for n in ("1P:1D", "2C", "elastic from 1P:1D"))
    assert (split.overflow_ttft_s, split.step_target_s) == (1.5, 0.04)  # half of each objective
    assert (elastic.overflow_ttft_s, elastic.step_target_s) == (1.5, 0.04)
    assert colocated.step_target_s == 0.0  # colocated workers keep the whole token budget
    assert colocated.layout.prefill == 0  # ... and have no prefill pool to be behind
    assert split.overflow_slowdown == 2.0

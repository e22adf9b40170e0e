"""A decode worker lends its core to a prefill in progress (pdserve/shell/core_lending.py): the
prefill worker marks the cores it borrows while it has work, and a decode worker pinned there
paces its steps while the mark is live, and only then."""

import math
import time

import pytest

from pdserve.engine.core.step_trace import StepShape
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.sampling.params import SamplingParams
from pdserve.shell.core_lending import MIN_MARK_S, BorrowerMark, CoreSlots, LenderPace
from tests.factories import make_engine


def test_a_mark_written_by_one_process_view_is_read_by_another_and_expires(tmp_path):
    borrower, lender = CoreSlots([1, 3], tmp_path), CoreSlots([3], tmp_path)
    assert lender.latest() == 0.0  # a fresh slot: nobody borrows
    work = [True]
    mark = BorrowerMark(borrower, lambda: work[0], lambda: 0.0)
    before = time.monotonic()
    assert mark() is None
    assert lender.latest() >= before + MIN_MARK_S  # its last step's length, at least MIN_MARK_S
    work[0] = False
    mark()
    assert lender.latest() == 0.0  # nothing left to run: cleared at once
    borrower.mark(time.monotonic() - 1.0)  # a borrower that died mid-step: its moment passes
    pace = LenderPace(lender, 0.05, lambda: time.monotonic())
    assert pace() is None


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir[0])


def run_decode(engine, pace: LenderPace) -> list[float]:
    """Twelve greedy tokens of one request on an engine thread held by ``pace``; each step's
    start."""
    starts: list[float] = []
    thread = EngineThread(engine, lambda outputs: starts.append(thread.last_step_started), holds=[pace])
    pace._last_step_started = lambda: thread.last_step_started
    thread.start()
    try:
        thread.call(engine.add_request, f"r{len(starts)}{time.monotonic()}", [1, 2, 3, 4],
                    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).result(timeout=30)
        deadline = time.monotonic() + 60
        while len(starts) < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        thread.stop()
    return starts


def test_a_decode_engine_paces_its_steps_only_while_its_core_is_marked(engine, tmp_path):
    period = 0.04
    quiet = LenderPace(CoreSlots([0], tmp_path), period, lambda: 0.0)
    run_decode(engine, quiet)
    assert quiet.paced_steps == 0  # no borrower: no step waits

    CoreSlots([0], tmp_path).mark(time.monotonic() + 600)  # a borrower prefilling all along
    lent = LenderPace(CoreSlots([0], tmp_path), period, lambda: 0.0)
    starts = run_decode(engine, lent)
    assert len(starts) == 12 and lent.paced_steps >= 10
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]  # from the second step on, each waited
    assert min(gaps) >= period * 0.99, gaps

    busy = LenderPace(CoreSlots([0], tmp_path), period, lambda: 0.0, lambda: period / 2)
    run_decode(engine, busy)
    assert busy.paced_steps == 0  # steps of half the period or more: a loaded decode worker lends nothing


def test_the_period_and_the_load_rule_follow_the_workers_own_one_sequence_steps(tmp_path):
    """Where a one-sequence decode step takes 17-23 ms (the AVX2-only EPYC), a fixed 40 ms period
    is under two steps and the loaded-worker rule lent nothing; the period (6 steps) and the load
    rule (1.5 steps) follow the worker's own steps. A 13 ms processor keeps its load rule (20
    ms: half of 40), and its period grows to 78 ms."""
    CoreSlots([0], tmp_path).mark(time.monotonic() + 600)
    step = {"s": 0.0, "shape": None}
    pace = LenderPace(CoreSlots([0], tmp_path), 0.04, lambda: time.monotonic(), lambda: step["s"],
                      lambda: step["shape"])
    assert (pace.period, pace.loaded_s) == (0.04, 0.02)  # nothing seen yet
    step.update(s=0.5, shape=StepShape(((256, 0),), 1, 300, 2))  # a mixed step: not a decode step's length
    pace()
    step.update(s=0.012, shape=StepShape((), 2, 600, 2))  # two sequences: not the floor either
    pace()
    assert pace.fastest_step_s == math.inf and pace.period == 0.04
    step.update(s=0.02, shape=StepShape((), 1, 300, 1))
    until = pace()
    assert pace.period == pytest.approx(0.12) and pace.loaded_s == pytest.approx(0.03)
    assert until is not None and until - time.monotonic() > 0.1  # lent: 20 ms is under 30
    step.update(s=0.034, shape=StepShape((), 1, 300, 1))  # slowed beside the borrower's prefill:
    assert pace() is not None  # it counts as its batch's fastest step, 20 ms, and lending goes on
    step.update(s=0.034, shape=StepShape((), 3, 900, 3))  # three sequences, never faster: loaded
    assert pace() is None
    step.update(s=0.013, shape=StepShape((), 1, 300, 1))  # the AVX-512 EPYC's steps: as before
    pace()
    assert pace.period == pytest.approx(0.078) and pace.loaded_s == 0.02


def test_colocated_workers_lend_to_each_other_and_never_while_their_own_prompts_wait(tmp_path):
    """Two colocated workers (2C) each mark the other's core while prompts of their own wait,
    for twice their last prompt step (not their last decode step), and each lends while the
    other marks, unless it has prompts of its own."""
    a_waiting, b_waiting = [False], [True]
    b_step = {"s": 0.7, "shape": StepShape(((256, 0),), 0, 0, 1)}
    b_mark = BorrowerMark(CoreSlots([0], tmp_path), lambda: b_waiting[0], lambda: b_step["s"],
                          lambda: b_step["shape"])
    b_mark()  # its last step ran a prompt: marked 1.4 s ahead
    b_step.update(s=0.02, shape=StepShape((), 1, 300, 1))  # then a decode step: the prompt's length still rules
    before = time.monotonic()
    b_mark()
    assert CoreSlots([0], tmp_path).latest() >= before + 1.3
    a_pace = LenderPace(CoreSlots([0], tmp_path), 0.04, lambda: time.monotonic(), lambda: 0.01,
                        own_prompts=lambda: a_waiting[0])
    assert a_pace() is not None  # A decodes and lends to B's prompt
    a_waiting[0] = True
    assert a_pace() is None  # A's own prompt comes first
    b_waiting[0] = False
    b_mark()
    assert CoreSlots([0], tmp_path).latest() == 0.0


def test_a_colocated_decode_worker_wires_both_its_mark_and_its_pace(tiny_llama_dir, tmp_path, monkeypatch):
    """The shell as ``pdserve serve`` pins a colocated worker (2C): a prompt in its own engine
    marks the core it borrows, and while its own core is marked it paces only with no prompt
    of its own waiting."""
    from pdserve.decode_worker.worker import DecodeWorker
    from tests.factories import decode_worker_config

    monkeypatch.setenv("PDSERVE_LEND_DIR", str(tmp_path))
    engine = make_engine(tiny_llama_dir[0])
    worker = DecodeWorker(decode_worker_config(worker_id="decode-lend", kv_transfer_backend="tcp", cpus=(0,),
                                               borrow_cpus=(1,), lend_tpot_s=0.04), engine=engine)
    try:
        worker._lend_cores([0])  # start() without pinning this test's process
        assert worker.lender is not None and engine.keep_step_shape
        engine.add_request("own", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0))
        before = time.monotonic()
        worker.thread._run_hooks()
        assert CoreSlots([1]).latest() >= before + MIN_MARK_S * 0.99  # its prompt marks the other core
        CoreSlots([0]).mark(time.monotonic() + 600)  # the other worker prefills on this one
        assert worker.lender() is None  # its own prompt comes first
        engine.step()  # the prompt runs: nothing waits any more
        assert worker.lender() is not None
        worker.thread._run_hooks()
        assert CoreSlots([1]).latest() == 0.0
    finally:
        worker.agent.close()

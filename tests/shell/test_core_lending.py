"""A decode worker lends its core to a prefill in progress (pdserve/shell/core_lending.py): the
prefill worker marks the cores it borrows while it has work, and a decode worker pinned there
paces its steps while the mark is live, and only then."""

import time

import pytest

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

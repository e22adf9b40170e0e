"""The time-sized prompt chunk (pdserve/engine/core/step_budget.py): its arithmetic on hand-made
step timings, and the mixed scheduler taking it. No test here times anything."""

import pytest

from pdserve.engine.config import MIXED, SchedulerConfig
from pdserve.engine.core.step_budget import MIN_SAMPLE_TOKENS, PROBE_EVERY, StepBudget
from tests.helpers.scheduler import feed, make, seq


def test_the_chunk_is_the_start_value_until_both_costs_are_seen():
    b = StepBudget(0.05, start_tokens=32)
    assert b.chunk() == 32
    b.observe(decode_rows=4, prompt_tokens=0, seconds=0.02)
    assert b.chunk() == 32  # a decode cost, no token cost yet
    b.observe(decode_rows=4, prompt_tokens=40, seconds=0.06)
    # (0.06 - 0.02) / 40 = 1 ms a token; (0.05 - 0.02) / 0.001 = 30 tokens
    assert b.chunk() == 30


def test_a_prompt_only_step_seeds_the_token_cost_once():
    b = StepBudget(0.05)
    b.observe(0, 100, 0.2)  # 2 ms a token, weight read included
    b.observe(3, 0, 0.01)
    assert b.token_s == pytest.approx(0.002) and b.chunk() == 20
    b.observe(0, 100, 0.1)  # a known token cost is moved by mixed steps only
    assert b.token_s == pytest.approx(0.002)
    late = StepBudget(0.05)
    late.observe(3, 0, 0.01)
    late.observe(0, 100, 0.2)  # after a decode step too
    assert late.token_s == pytest.approx(0.002) and late.chunk() == 20


def test_the_means_follow_the_newest_steps_by_their_weight():
    b = StepBudget(0.1, weight=0.5)
    b.observe(2, 0, 0.02)
    b.observe(2, 0, 0.04)
    assert b.decode_s == pytest.approx(0.03)
    b.observe(2, 20, 0.05)  # (0.05 - 0.03) / 20 = 1 ms
    b.observe(2, 20, 0.07)  # 2 ms: the mean 1.5 ms
    assert b.token_s == pytest.approx(0.0015)
    assert b.chunk() == int((0.1 - 0.03) / 0.0015)


def test_the_chunk_grows_as_tokens_get_cheaper():
    """The same target on a slow core and on a fast device: the chunk is what fits the time,
    not a constant (a GPU's token costs microseconds)."""
    slow, fast = StepBudget(0.05), StepBudget(0.05)
    for b, decode, per_token in ((slow, 0.015, 0.0013), (fast, 0.004, 0.00002)):
        b.observe(8, 0, decode)
        b.observe(8, 100, decode + 100 * per_token)
    assert slow.chunk() == 26
    assert fast.chunk() == 2300


def test_the_floor_holds_when_decode_alone_takes_the_target():
    b = StepBudget(0.05, floor_tokens=16)
    b.observe(64, 0, 0.08)
    b.observe(64, 32, 0.12)
    assert b.chunk() == 16


def test_tiny_chunks_and_bad_timings_move_nothing():
    b = StepBudget(0.05)
    b.observe(4, 0, 0.02)
    b.observe(4, MIN_SAMPLE_TOKENS - 1, 5.0)  # too few tokens to say what one costs
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        b.observe(4, 40, bad)
    b.observe(0, 0, 0.3)  # an empty step
    assert b.token_s is None and b.decode_s == pytest.approx(0.02)


def test_a_step_faster_than_its_decode_mean_costs_a_token_nothing():
    b = StepBudget(0.05)
    b.observe(4, 0, 0.03)
    b.observe(4, 40, 0.02)
    assert b.token_s == 0 and b.chunk() == 1 << 30


def test_a_fixed_cost_of_carrying_a_prompt_is_fitted_apart_and_amortized():
    """A GPU decode worker (about as the H200 ran 8B, BENCHMARKS.md run 8): decode steps replay a
    graph (8 ms), a step with prompt tokens runs eagerly (22 ms more, whatever its size, plus
    0.03 ms a token). Charged to 32 tokens, the fixed part looked like 0.7 ms a token; the fitted
    line sees it as what it is, and the chunk grows until the fixed part costs no more than its
    tokens (733 tokens: 22 ms of them)."""
    b = StepBudget(0.05)
    b.observe(8, 0, 0.008)
    chunks = []
    for _ in range(12):
        chunks.append(b.chunk())
        b.observe(8, chunks[-1], 0.008 + 0.022 + 0.00003 * chunks[-1])
    assert chunks[0] == 32 and chunks[-1] == 733
    assert b.fixed_s == pytest.approx(0.022) and b.token_s == pytest.approx(0.00003)


def test_without_a_fixed_part_the_line_gives_the_chunk_the_ratio_gave():
    """A CPU worker: every step eager, a prompt token 1.3 ms, no fixed part."""
    b = StepBudget(0.05)
    b.observe(4, 0, 0.017)
    for tokens in (32, 16, 25, 40):
        b.observe(4, tokens, 0.017 + 0.0013 * tokens)
    assert b.fixed_s == pytest.approx(0.0, abs=1e-9) and b.token_s == pytest.approx(0.0013)
    assert b.chunk() == 25


def test_steps_all_of_one_size_get_a_doubled_chunk_now_and_then_so_the_line_can_be_fitted():
    b = StepBudget(0.05)
    b.observe(4, 0, 0.01)
    seen = []
    for _ in range(PROBE_EVERY):
        b.observe(4, 20, 0.01 + 0.02 + 0.0005 * 20)  # 20 ms fixed, 0.5 ms a token: 1.5 ms "a token"
        seen.append(b.chunk())
    assert b.fixed_s == 0 and seen == [26] * (PROBE_EVERY - 1) + [52]  # (0.05 - 0.01) / 0.0015, then doubled
    b.observe(4, 40, 0.01 + 0.02 + 0.0005 * 40)
    assert b.fixed_s == pytest.approx(0.02) and b.token_s == pytest.approx(0.0005)
    assert b.chunk() == 40  # both 20 ms: what fits the target and what amortizes the fixed part
    for _ in range(3 * PROBE_EVERY):  # all one size again: the fit is kept, and no chunk is doubled
        b.observe(4, 40, 0.01 + 0.02 + 0.0005 * 40)
        assert b.chunk() == 40 and b.fixed_s == pytest.approx(0.02)


@pytest.mark.parametrize("kw, field", [({"target_s": 0}, "mixed_step_target_s"),
                                       ({"target_s": 0.05, "floor_tokens": 0}, "floor_tokens"),
                                       ({"target_s": 0.05, "floor_tokens": 40, "start_tokens": 32}, "floor_tokens"),
                                       ({"target_s": 0.05, "weight": 0}, "weight")])
def test_impossible_settings_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        StepBudget(**kw)


def test_a_negative_target_is_refused_in_the_config():
    with pytest.raises(ValueError, match="mixed_step_target_s"):
        SchedulerConfig(mixed_step_target_s=-0.1)


def test_the_mixed_scheduler_takes_the_time_sized_chunk_beside_streams():
    """A stream decoding; the engine's timings say a decode step costs 10 ms and a prompt
    token 2 ms, so a 50 ms target leaves 20 tokens a step for the next prompt; with nothing
    decoding, a prompt still takes the whole budget."""
    sched, _ = make(policy=MIXED, max_num_batched_tokens=64, mixed_step_target_s=0.05, mixed_prefill_tokens=6,
                    num_blocks=64)
    assert sched.step_budget.chunk() == 16  # the start: mixed_prefill_tokens, raised to the floor
    sched.add(seq("alone", 20, max_tokens=30))
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.seqs] == [20]  # no stream yet: whole
    sched.observe_step(out, 0.04)  # 2 ms a token, prompt-only: seeds the token cost
    feed(sched, out)
    out = sched.schedule()
    sched.observe_step(out, 0.01)  # one decode row: 10 ms
    feed(sched, out)
    assert sched.step_budget.chunk() == 20
    sched.add(seq("next", 50))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks += [s.num_new_tokens for s in out.seqs if s.seq.seq_id == "next"]
        assert [s.num_new_tokens for s in out.seqs if s.seq.seq_id == "alone"] == [1]
        sched.observe_step(out, 0.01 + 0.002 * chunks[-1])  # as the costs said: the chunk holds
        feed(sched, out)
    assert chunks == [20, 20, 10]


def test_a_prefill_worker_has_no_step_budget():
    sched, _ = make(mixed_step_target_s=0.05)  # prefill_first: a step never carries streams
    assert sched.step_budget is None


def test_prompts_a_step_computes_stay_visible_as_work_to_do_until_it_ends():
    """A prefill worker packs waiting prompts into one step: they leave ``waiting`` at once,
    but the worker's stats must still count them (``stepping``) until the step is fed back."""
    sched, _ = make(max_num_batched_tokens=64)
    sched.add(seq("a", 20))
    sched.add(seq("b", 20))
    sched.add(seq("c", 40))  # 24 tokens fit after a and b: chunked, stays at the head of waiting
    out = sched.schedule()
    assert [s.seq_id for s in sched.stepping] == ["a", "b"] and [s.seq_id for s in sched.waiting] == ["c"]
    feed(sched, out)
    assert sched.stepping == []


def test_a_prompt_tokens_wall_time_is_its_steps_time_over_the_chunk():
    """The slow AVX2 path's shape: a 17 ms decode step and 1.3 ms a token leave a 25-token chunk
    in a 50 ms step, so a prompt token costs about 2 ms of wall time there, 1.5 times its compute."""
    b = StepBudget(0.05)
    assert b.prompt_token_s() is None  # nothing seen
    b.observe(4, 0, 0.017)
    assert b.prompt_token_s() is None  # a decode cost, no token cost yet
    b.observe(4, 100, 0.017 + 100 * 0.0013)
    assert b.chunk() == 25 and b.prompt_token_s() == pytest.approx((0.017 + 25 * 0.0013) / 25)


def test_a_prompt_tokens_wall_time_grows_with_the_floor_when_decode_takes_the_target():
    """Decode alone (80 ms) passes the 50 ms target: the chunk sits at its floor, and each of its
    16 tokens carries a sixteenth of the whole 100 ms step, not of the target (6.25 ms, not 3.1)."""
    b = StepBudget(0.05, floor_tokens=16)
    b.observe(64, 0, 0.08)
    b.observe(64, 32, 0.12)
    assert b.chunk() == 16 and b.prompt_token_s() == pytest.approx((0.08 + 16 * 0.04 / 32) / 16)

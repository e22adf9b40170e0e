"""The simulated worker applies the engine scheduler's rules to counts."""

from pdserve.planner.worker import EngineLimits, SimSeq, SimWorker
from tests.planner.helpers import cost


def worker(role="colocated", num_blocks=None, **limits) -> SimWorker:
    return SimWorker("w", role, cost(), EngineLimits(**limits), num_blocks=num_blocks)


def seq(rid, prompt, output):
    return SimSeq(rid, rid, prompt, output)


def run_step(w: SimWorker, now: float = 0.0):
    end = w.start(now)
    return end, w.finish()


def test_long_prompt_is_chunked_by_the_token_budget():
    w = worker(max_num_batched_tokens=2048)
    w.add_prompt(seq(0, 5000, 2))
    chunks = []
    for _ in range(3):
        w.start(0.0)
        chunks.append([n for _, n in w._batch])
        out = w.finish()
    assert chunks == [[2048], [2048], [904]]
    assert [s.rid for s in out.prefilled] == [0]


def test_prompts_are_packed_and_the_last_one_chunked():
    w = worker(max_num_batched_tokens=2048)
    w.add_prompt(seq(0, 1000, 2))
    w.add_prompt(seq(1, 1500, 2))
    w.start(0.0)
    assert [(s.rid, n) for s, n in w._batch] == [(0, 1000), (1, 1048)]


def test_without_chunking_a_lone_long_prompt_runs_whole():
    w = worker(max_num_batched_tokens=2048, enable_chunked_prefill=False)
    w.add_prompt(seq(0, 3000, 2))
    w.add_prompt(seq(1, 10, 2))
    w.start(0.0)
    assert [(s.rid, n) for s, n in w._batch] == [(0, 3000)]


def test_a_decode_epoch_lasts_until_the_first_finish():
    w = worker()
    w.add_prompt(seq(0, 10, 6))
    w.add_prompt(seq(1, 10, 11))
    run_step(w)  # prefill both: one token each
    end, out = run_step(w, 1.0)
    assert w._k == 5 and [s.rid for s in out.finished] == [0]
    step = cost().decode_s(2, 2 * 11 + 2 * 4 / 2)
    assert end == 1.0 + 5 * step and out.itl == (step, 10)
    run_step(w, end)
    assert w._k == 5 and not w.running


def test_new_work_cuts_the_epoch_after_the_step_in_flight():
    w = worker()
    w.add_prompt(seq(0, 10, 100))
    run_step(w)
    end = w.start(0.0)
    dt = w._dt
    new_end = w.interrupt(2.5 * dt)
    assert new_end == 3 * dt and w._k == 3 and end > new_end
    w.finish()
    assert w.running[0].finish_step - w.step == 96  # 99 tokens after the first, 3 done


def test_when_blocks_run_out_the_youngest_is_preempted_and_recomputed():
    w = worker(num_blocks=8, block_size=16)
    for rid in range(3):
        w.add_prompt(seq(rid, 30, 40))  # 2 blocks each; growing to 70 tokens needs 5 each
    run_step(w)
    assert len(w.running) == 3
    while not w.preemptions:
        run_step(w)
    assert w.waiting[0].rid == 2 and w.waiting[0].recompute
    done = set()
    for _ in range(100):
        if w.idle():
            break
        done |= {s.rid for s in run_step(w)[1].finished}
    assert done == {0, 1, 2}


def test_admission_leaves_a_block_per_running_sequence():
    w = worker(num_blocks=6, block_size=16)
    w.add_prompt(seq(0, 16 * 3, 50))
    run_step(w)
    w.add_prompt(seq(1, 16 * 2, 5))  # 2 blocks + 1 kept for seq 0's next block fit the 3 free
    assert w._schedule_prefill()
    w2 = worker(num_blocks=6, block_size=16)
    w2.add_prompt(seq(0, 16 * 3, 50))
    run_step(w2)
    w2.add_prompt(seq(1, 16 * 3, 5))  # 3 blocks + 1 reserved > 3 free: waits for decode
    assert not w2._schedule_prefill()


def test_prefill_role_holds_blocks_until_freed_and_decode_role_reserves():
    p = worker("prefill")
    s = seq(0, 40, 5)
    p.add_prompt(s)
    run_step(p)
    assert p.fixed_blocks == 3
    p.free(s)
    assert p.fixed_blocks == 0
    d = worker("decode")
    d.reserve(s)
    assert d.fixed_blocks == 3  # the prompt's 40 tokens
    s.tokens = s.prompt
    d.join(s)
    assert d.fixed_blocks == 0 and d.run_tokens == 41


def test_a_cached_shared_prefix_is_not_recomputed():
    w = worker()
    a, b = SimSeq(0, 0, 100, 2, "p", 64), SimSeq(1, 1, 100, 2, "p", 64)
    w.add_prompt(a)
    run_step(w)
    w.add_prompt(b)
    w.start(0.0)
    assert w._batch[0][1] == 100 - 64

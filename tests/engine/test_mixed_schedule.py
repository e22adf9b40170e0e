"""The ``mixed`` scheduling policy: decode rows and prompt chunks in one step.

Pure scheduler tests with hand-built outputs, then the tiny model: a mixed engine's greedy
output equals transformers' and its solo runs, with preemption, and frees every block.
"""

import pytest

from pdserve.engine.config import MIXED, SchedulerConfig
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import assert_greedy_matches, make_engine, random_prompts
from tests.helpers.engine_runs import LENGTHS, run_staggered
from tests.helpers.scheduler import feed, make, seq


def mixed(**kw):
    return make(policy=MIXED, **kw)


def decode_and_prefill(out):
    return ([s.seq.seq_id for s in out.seqs if s.num_new_tokens == 1 and s.seq.num_computed_tokens],
            [(s.seq.seq_id, s.num_new_tokens) for s in out.seqs if not s.seq.num_computed_tokens or
             s.num_new_tokens > 1])


def test_a_long_prompt_is_chunked_beside_the_running_decodes():
    sched, _ = mixed(max_num_batched_tokens=8)
    for i in range(3):
        sched.add(seq(f"d{i}", 3, max_tokens=20))
    feed(sched, sched.schedule())  # the three short prompts: 9 > 8 tokens, so two steps
    feed(sched, sched.schedule())
    assert len(sched.running) == 3
    sched.add(seq("long", 20))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        decoded = [s for s in out.seqs if s.seq.seq_id.startswith("d")]
        long = [s for s in out.seqs if s.seq.seq_id == "long"]
        assert len(decoded) == 3 and all(s.num_new_tokens == 1 and s.sample for s in decoded)
        assert sum(s.num_new_tokens for s in out.seqs) <= 8
        if long and long[0].num_new_tokens > 1:
            assert out.is_prefill
            chunks.append(long[0].num_new_tokens)
        feed(sched, out)
    # 5 tokens of budget per step beside 3 decodes: 20 prompt tokens take four steps
    assert chunks == [5, 5, 5, 5]
    assert sched.running[-1].seq_id == "long" and sched.running[-1].num_output_tokens == 1
    out = sched.schedule()
    assert not out.is_prefill and len(out.seqs) == 4


def test_a_prompt_beside_running_decodes_takes_at_most_the_mixed_cap():
    """``mixed_prefill_tokens``: a prompt shares a step with running streams for at most that
    many tokens (a decode worker's local prefill, kept short for the streams' gaps), and takes
    the whole budget when nothing decodes."""
    sched, _ = mixed(max_num_batched_tokens=64, mixed_prefill_tokens=6)
    sched.add(seq("alone", 20, max_tokens=20))
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.seqs] == [("alone", 20)]  # no stream yet: whole
    feed(sched, out)
    sched.add(seq("next", 20))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        chunks += [s.num_new_tokens for s in out.seqs if s.seq.seq_id == "next"]
        assert [s.num_new_tokens for s in out.seqs if s.seq.seq_id == "alone"] == [1]
        feed(sched, out)
    assert chunks == [6, 6, 6, 2]


def test_a_negative_mixed_cap_is_refused():
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        SchedulerConfig(mixed_prefill_tokens=-1)


def test_prefill_first_stops_the_decodes_while_a_prompt_runs():
    """The behaviour the mixed policy exists to avoid, kept for prefill workers."""
    sched, _ = make(max_num_batched_tokens=8)
    sched.add(seq("d", 3, max_tokens=20))
    feed(sched, sched.schedule())
    sched.add(seq("long", 20))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.seqs] == ["long"] and out.seqs[0].num_new_tokens == 8


def test_a_step_that_preempts_admits_no_prompt():
    sched, _ = mixed(num_blocks=4, block_size=4)
    old, young = seq("old", 4, max_tokens=20), seq("young", 4, max_tokens=20)
    sched.add(old)
    sched.add(young)
    feed(sched, sched.schedule())
    out = sched.schedule()
    for _ in range(4):
        feed(sched, out)
        out = sched.schedule()
    assert out.preempted == ["young"] and [s.seq.seq_id for s in out.seqs] == ["old"]
    assert not out.is_prefill
    feed(sched, out)
    sched.finish(old, None)
    out = sched.schedule()  # the room is back: young recomputes prompt + outputs
    assert out.is_prefill and out.seqs[0].seq is young and out.seqs[0].num_new_tokens == young.num_tokens


def test_decodes_beyond_the_budget_leave_no_room_for_prompts():
    sched, _ = mixed(max_num_batched_tokens=2)
    for i in range(2):
        sched.add(seq(f"d{i}", 1, max_tokens=20))
    feed(sched, sched.schedule())
    sched.add(seq("new", 3))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.seqs] == ["d0", "d1"] and not out.is_prefill


def test_max_num_seqs_caps_prompts_admitted_beside_decodes():
    sched, _ = mixed(max_num_seqs=2)
    sched.add(seq("a", 3))
    feed(sched, sched.schedule())
    for name in ("b", "c"):
        sched.add(seq(name, 3))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.seqs] == ["a", "b"]


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="prefill_first, mixed.*'fifo'"):
        SchedulerConfig(policy="fifo")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batches_with_preemption_equal_solo_runs_and_free_every_block(tiny_llama_dir, dtype):
    directory, hf = tiny_llama_dir
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    solo_engine = make_engine(directory, num_blocks=64, dtype=dtype)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    # A small budget chunks the longer prompts across steps that also decode; 40 blocks of
    # 16 cannot hold 9 sequences of up to 240 tokens: preemption and recompute, mixed too.
    engine = make_engine(directory, num_blocks=40, dtype=dtype, policy=MIXED, max_num_batched_tokens=48)
    together = run_staggered(engine, prompts, params, join_every=2)
    assert engine.scheduler.num_preemptions > 0
    assert together == solo
    assert engine.num_free_blocks == 40
    if dtype == "float32":
        for p, ours in zip(prompts[:4], together):
            assert_greedy_matches(hf, p, ours, 40, what=f"mixed, {len(p)}-token prompt")

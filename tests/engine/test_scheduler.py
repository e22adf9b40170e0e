"""Scheduling policy on CPU with hand-built outputs: no model, no torch."""

from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import SampledTokens
from pdserve.engine.core.sequence import FinishReason, Sequence, SeqStatus
from tests.helpers.scheduler import feed, make, seq


def test_prefill_packs_several_prompts_then_decodes_them_together():
    sched, _ = make()
    for i, n in enumerate((3, 7, 5)):
        sched.add(seq(f"s{i}", n))
    out = sched.schedule()
    assert out.is_prefill and [s.num_new_tokens for s in out.seqs] == [3, 7, 5]
    feed(sched, out)
    out = sched.schedule()
    assert not out.is_prefill and len(out.seqs) == 3 and all(s.num_new_tokens == 1 for s in out.seqs)


def test_long_prompt_is_chunked_under_the_token_budget():
    sched, _ = make(max_num_batched_tokens=8)
    s = seq("long", 20)
    sched.add(s)
    chunks = []
    while True:
        out = sched.schedule()
        assert out.is_prefill
        chunks.append(out.seqs[0].num_new_tokens)
        sampled = out.seqs[0].sample
        feed(sched, out)
        if sampled:
            break
    assert chunks == [8, 8, 4]
    assert s.num_computed_tokens == 20 and s.num_output_tokens == 1


def test_chunking_disabled_runs_a_lone_long_prompt_whole():
    sched, _ = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(seq("long", 20))
    out = sched.schedule()
    assert out.seqs[0].num_new_tokens == 20 and out.seqs[0].sample


def test_stops_on_eos_max_tokens_and_stop_ids():
    sched, bm = make()
    a, b, c = seq("a", 3), seq("b", 3, max_tokens=1), seq("c", 3, stop_token_ids=(9,))
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    done = sched.update_from_output(out, SampledTokens({"a": 2, "b": 5, "c": 9}))
    assert {s.seq_id: s.finish_reason for s in done} == {
        "a": FinishReason.STOP, "b": FinishReason.LENGTH, "c": FinishReason.STOP}
    assert bm.num_free_blocks == bm.num_blocks


def test_ignore_eos_keeps_going():
    sched, _ = make()
    s = seq("a", 3, ignore_eos=True)
    sched.add(s)
    assert not feed(sched, sched.schedule(), token=2)


def test_decode_preempts_the_youngest_when_blocks_run_out_and_resumes_it():
    sched, bm = make(num_blocks=4, block_size=4)
    old, young = seq("old", 4, max_tokens=20), seq("young", 4, max_tokens=20)
    sched.add(old)
    sched.add(young)
    feed(sched, sched.schedule())  # both prefilled: 2 blocks used, 5 tokens each
    out = sched.schedule()  # both need a second block: 4 blocks used
    assert len(out.seqs) == 2
    for _ in range(4):  # tokens 6, 7, 8 fit in two blocks each
        feed(sched, out)
        out = sched.schedule()
    # 9 tokens each now need a third block; only the old one can have it
    assert out.preempted == ["young"]
    assert [s.seq.seq_id for s in out.seqs] == ["old"]
    assert young.status is SeqStatus.WAITING and young.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.finish(old, FinishReason.ABORT)
    out = sched.schedule()  # young resumes by recomputing prompt + its outputs so far
    assert out.is_prefill and out.seqs[0].seq is young and out.seqs[0].num_new_tokens == young.num_tokens


def test_a_sequence_without_a_limit_is_preempted_before_a_limited_one():
    """Issue 25: requests that run to the end of the context (no max_tokens) grew and pushed
    out the younger, limited streams beside them. The victim is the sequence that may still
    grow the most: here the older one, whose limit is the rest of the context."""
    sched, bm = make(num_blocks=4, block_size=4, max_len=1000)
    unlimited, limited = seq("unlimited", 4, max_tokens=996), seq("limited", 4, max_tokens=8)
    sched.add(unlimited)
    sched.add(limited)
    feed(sched, sched.schedule())
    out = sched.schedule()
    for _ in range(4):
        feed(sched, out)
        out = sched.schedule()
    assert out.preempted == ["unlimited"]
    assert [s.seq.seq_id for s in out.seqs] == ["limited"] and unlimited.status is SeqStatus.WAITING
    while limited.status is not SeqStatus.FINISHED:  # the limited one runs to its end ...
        assert "limited" not in out.preempted
        feed(sched, out)
        out = sched.schedule()
    assert limited.num_output_tokens == 8
    assert [s.seq for s in out.seqs] == [unlimited]  # ... and the unlimited one resumes after


def test_a_lone_sequence_that_cannot_grow_is_preempted_not_crashed():
    sched, bm = make(num_blocks=2, block_size=2)
    s = seq("a", 3, max_tokens=10)
    sched.add(s)
    feed(sched, sched.schedule())  # 4 tokens in 2 blocks
    out = sched.schedule()
    assert out.seqs  # the 4th token fits
    feed(sched, out)
    out = sched.schedule()  # the 5th needs a third block: none
    assert out.preempted == ["a"] and not out.seqs


def test_admission_leaves_room_for_running_sequences_to_grow():
    sched, bm = make(num_blocks=4, block_size=4)
    sched.add(seq("a", 8))  # 2 blocks
    feed(sched, sched.schedule())
    sched.add(seq("b", 7))  # would take the last 2 blocks and leave "a" none to grow into
    out = sched.schedule()
    assert not out.is_prefill


def test_max_num_seqs_caps_the_batch():
    sched, _ = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(f"s{i}", 2))
    assert len(sched.schedule().seqs) == 2


def test_abort_frees_blocks_in_every_state():
    sched, bm = make(max_num_batched_tokens=4)
    running, chunking, waiting = seq("r", 3), seq("c", 9), seq("w", 3)
    sched.add(running)
    feed(sched, sched.schedule())
    sched.add(chunking)
    sched.add(waiting)
    feed(sched, sched.schedule())  # chunking has blocks and a partial prefill
    for s in (running, chunking, waiting):
        sched.finish(s, FinishReason.ABORT)
    assert bm.num_free_blocks == bm.num_blocks and sched.num_unfinished == 0


def test_prefill_only_sequence_holds_its_blocks():
    sched, bm = make()
    s = seq("p", 6)
    s.hold_kv = True
    sched.add(s)
    done = feed(sched, sched.schedule())
    assert done == [s] and s.finish_reason is None
    assert bm.has("p") and bm.num_free_blocks == bm.num_blocks - 2
    bm.free("p")
    assert bm.num_free_blocks == bm.num_blocks


def test_remote_prefilled_sequence_waits_for_kv_then_decodes():
    sched, bm = make()
    s = Sequence("d", list(range(10, 16)) + [7], SamplingParams(max_tokens=4), num_prompt_tokens=6)
    blocks = sched.add_remote_prefilled(s)
    assert len(blocks) == 2 and sched.schedule().empty
    sched.kv_ready("d")
    out = sched.schedule()
    assert not out.is_prefill and out.seqs[0].seq is s
    assert s.num_computed_tokens == 6  # the first token is the one to compute now


def test_a_limited_request_arriving_at_a_worker_full_of_unlimited_ones_preempts_them():
    """Issue 25: decode workers full of requests without a limit (each may run to the end of
    the context) kept a limited request out: its KV had no blocks to land in. The router
    counts those requests' blocks as room for a limited one, and here the room is made, by
    the preemption rule (most growth first); the unlimited one resumes after."""
    sched, bm = make(num_blocks=4, block_size=4, max_len=1000)
    unlimited = []
    for i in range(2):  # two unlimited streams, each holding two blocks: the cache is full
        s = Sequence(f"u{i}", list(range(10, 17)) + [7], SamplingParams(max_tokens=993), num_prompt_tokens=7)
        sched.add_remote_prefilled(s)
        sched.kv_ready(s.seq_id)
        unlimited.append(s)
    assert bm.num_free_blocks == 0
    limited = Sequence("limited", list(range(10, 17)) + [7], SamplingParams(max_tokens=4), num_prompt_tokens=7)
    assert len(sched.add_remote_prefilled(limited)) == 2
    assert [s.status for s in unlimited] == [SeqStatus.RUNNING, SeqStatus.WAITING]  # the youngest went
    sched.kv_ready("limited")
    out = sched.schedule()
    while limited.status is not SeqStatus.FINISHED:
        assert "limited" not in out.preempted
        feed(sched, out)
        out = sched.schedule()
    assert limited.num_output_tokens == 4


def test_a_request_arriving_at_a_full_worker_preempts_nobody_that_grows_less():
    """The room is made only from sequences ranked above the newcomer: one without a limit
    arriving at a worker full of limited ones is refused, as before, and nothing is preempted."""
    import pytest

    from pdserve.engine.errors import CacheCapacityError

    sched, bm = make(num_blocks=3, block_size=4, max_len=1000)
    held = Sequence("limited", list(range(10, 17)) + [7], SamplingParams(max_tokens=4), num_prompt_tokens=7)
    sched.add_remote_prefilled(held)
    sched.kv_ready("limited")
    with pytest.raises(CacheCapacityError):
        sched.add_remote_prefilled(Sequence("u", list(range(10, 17)) + [7], SamplingParams(max_tokens=993),
                                            num_prompt_tokens=7))
    assert held.status is SeqStatus.RUNNING and sched.num_preemptions == 0

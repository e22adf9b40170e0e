"""The scheduler's side of speculation, with hand-built outputs (no model): a sequence with
guesses is scheduled with them and slots for them, what verification kept is appended up to the
first token that ends it, KV counts as final only up to the kept guesses, and no block holding
a rejected guess is ever shared."""

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.scheduler import SampledTokens, Scheduler
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.sequence import FinishReason, SeqStatus
from pdserve.engine.spec.proposer import Proposal
from tests.helpers.scheduler import feed, make, seq


def running(sched, s):
    """``s`` prefilled and decoding (its first token 5 sampled)."""
    sched.add(s)
    feed(sched, sched.schedule())
    assert s.status is SeqStatus.RUNNING and s.num_computed_tokens == s.num_tokens - 1


def guesses(*drafts):
    """A proposer's hook that gives the sequences these guesses, in order."""
    return lambda seqs: {s.seq_id: Proposal(list(d)) for s, d in zip(seqs, drafts) if d}


def test_a_speculating_row_runs_its_guesses_in_slots_of_its_own():
    sched, bm = make(num_blocks=16, block_size=4)
    s = seq("a", 3, max_tokens=20)
    running(sched, s)  # 4 tokens, 3 computed, 1 block
    out = sched.schedule(guesses([7, 8, 9]))
    [item] = out.seqs
    assert item.num_new_tokens == 4 and item.draft_token_ids == [7, 8, 9]
    assert len(bm.block_table("a")) == 2  # slots for positions 3..6
    # Two guesses kept, then the target's own token: the third guess's KV is dead.
    sched.update_from_output(out, SampledTokens({"a": 11}, accepted={"a": [7, 8]}))
    assert s.token_ids[-3:] == [7, 8, 11] and s.num_computed_tokens == s.num_tokens - 1 == 6
    bm.check_invariants()


def test_a_stop_token_inside_the_kept_guesses_ends_the_sequence_there():
    sched, bm = make(num_blocks=16, block_size=4)
    s = seq("a", 3, max_tokens=20, stop_token_ids=(8,))
    running(sched, s)
    out = sched.schedule(guesses([7, 8, 9]))
    finished = sched.update_from_output(out, SampledTokens({"a": 11}, accepted={"a": [7, 8, 9]}))
    assert finished == [s] and s.finish_reason is FinishReason.STOP
    assert s.output_token_ids == [5, 7, 8]  # nothing past the stop token
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_max_tokens_inside_the_kept_guesses_cuts_them():
    sched, bm = make(num_blocks=16, block_size=4)
    s = seq("a", 3, max_tokens=3)
    running(sched, s)
    out = sched.schedule(guesses([7, 8, 9]))
    sched.update_from_output(out, SampledTokens({"a": 11}, accepted={"a": [7, 8, 9]}))
    assert s.output_token_ids == [5, 7, 8] and s.finish_reason is FinishReason.LENGTH
    assert bm.num_free_blocks == 16


def test_eos_as_the_targets_own_token_ends_it_after_the_kept_guesses():
    sched, _ = make(num_blocks=16, block_size=4)
    s = seq("a", 3, max_tokens=20)
    running(sched, s)
    out = sched.schedule(guesses([7, 8]))
    sched.update_from_output(out, SampledTokens({"a": 2}, accepted={"a": [7, 8]}))  # 2: EOS
    assert s.output_token_ids == [5, 7, 8, 2] and s.finish_reason is FinishReason.STOP


def test_guesses_without_a_free_block_are_dropped_not_paid_for_by_a_preemption():
    sched, bm = make(num_blocks=2, block_size=4)
    a = seq("a", 3, max_tokens=20)
    running(sched, a)  # 4 tokens in its one block
    bm.allocate("other", [1, 2])  # the last free block
    out = sched.schedule(guesses([7, 8]))
    assert [(i.num_new_tokens, i.draft) for i in out.seqs] == [(1, None)] and not out.preempted
    bm.check_invariants()


def test_no_block_holding_a_rejected_guess_is_shared():
    """Prefix cache on: a block filled by guesses that were rejected is never hashed; the block
    of the kept ones is, once they are final."""
    bm = BlockManager(16, 4, enable_prefix_cache=True)
    sched = Scheduler(SchedulerConfig(), bm, 1000, eos_token_ids=(2,))
    s = seq("a", 3, max_tokens=20)
    running(sched, s)  # tokens 10, 11, 12, 5: one full block, its last token not computed
    out = sched.schedule(guesses([20, 21, 22, 23, 24]))  # positions 3..8: blocks 1 and 2
    sched.update_from_output(out, SampledTokens({"a": 30}, accepted={"a": [20]}))
    # Final: 10 11 12 5 | 20 (then 30, not computed). Nothing past position 4 is final.
    assert len(bm.cached_hashes()) == 1  # the first block only; the second holds rejected guesses
    table = list(bm.block_table("a"))
    sched.finish(s, FinishReason.STOP)
    other = seq("b", 0)
    other.token_ids = [10, 11, 12, 5, 20, 21, 22, 23, 9]  # the rejected guesses as a real prompt
    alloc = bm.allocate("b", other.token_ids)
    assert alloc.num_cached_tokens == 4 and alloc.block_ids[0] == table[0]
    bm.check_invariants()

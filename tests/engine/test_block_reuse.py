"""A prompt whose KV another worker computed (``Scheduler.add_remote_prefilled``), allocated with
``reuse_cached``: the leading blocks this worker's prefix cache holds under the same salt are
taken as they are (final already), and only the rest are fresh, PENDING until the pull lands.
Pure Python: a block manager and a scheduler, no model."""

from pdserve.engine.core.block_manager import BlockManager, prompt_block_hashes
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence
from tests.factories import computed_blocks

BS = 4
PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks and a last one of 2


def make() -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks=32, block_size=BS)
    return Scheduler(SchedulerConfig(), bm, max_model_len=1000), bm


def arriving(sid: str, prompt: list[int], salt: str = "") -> Sequence:
    return Sequence(sid, prompt + [7], SamplingParams(max_tokens=8, cache_salt=salt), num_prompt_tokens=len(prompt))


def test_a_pull_reuses_the_cached_leading_blocks_of_its_salt_and_reads_only_the_rest():
    sched, bm = make()
    cached = computed_blocks(bm, "turn-1", PROMPT[:9], cache_salt="t")  # 2 full blocks final, 1 partial
    bm.free("turn-1")
    seq = arriving("turn-2", PROMPT, salt="t")
    ids = sched.add_remote_prefilled(seq, reuse_cached=True)
    assert seq.num_cached_tokens == 2 * BS and ids[:2] == list(cached.block_ids[:2])
    assert len(ids) == 4 and not set(ids[2:]) & set(cached.block_ids[:2])
    bm.check_invariants()
    # The fresh blocks become findable only once the pull has landed.
    hashes = prompt_block_hashes(PROMPT, BS, "t")
    assert set(bm.cached_hashes()) == set(hashes[:2])
    sched.kv_ready("turn-2")
    assert set(hashes) <= set(bm.cached_hashes())
    bm.check_invariants()


def test_without_reuse_or_under_another_salt_every_block_is_fresh():
    sched, bm = make()
    computed_blocks(bm, "turn-1", PROMPT[:9], cache_salt="t")
    bm.free("turn-1")
    plain = arriving("plain", PROMPT, salt="t")
    other = arriving("other", PROMPT, salt="u")
    assert not set(sched.add_remote_prefilled(plain)) & set(sched.add_remote_prefilled(other, reuse_cached=True))
    assert plain.num_cached_tokens == other.num_cached_tokens == 0


def test_the_block_of_the_prompts_last_token_is_never_reused_so_a_read_always_moves_one():
    """Even a prompt whose every block is cached leaves its last one to read: its read's notice
    is what ends the holder's lease."""
    sched, bm = make()
    prompt = PROMPT[:12]  # 3 full blocks
    computed_blocks(bm, "before", prompt + [1, 2])
    bm.free("before")
    seq = arriving("again", prompt)
    ids = sched.add_remote_prefilled(seq, reuse_cached=True)
    assert len(ids) == 3 and seq.num_cached_tokens == 2 * BS

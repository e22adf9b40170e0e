"""The KV tier reads a queued prompt's blocks ahead (``KVTier.prefetch``, docs/kv_tier.md): the
copies are verified off the engine thread and ``load`` takes them from memory; the chain stops
at the first block the tier lacks; copies read ahead give their buffers up to offloads; and the
scheduler holds a prompt back while its reads go on and other sequences run, never when it
would run alone. By default only a tier next to a GPU reads ahead (a CPU host's cores are the
step's). No model: small CPU caches (read-ahead turned on) and hand-fed scheduler outputs."""

from __future__ import annotations

import os
import threading
import time

import torch

from pdserve.engine.config import MIXED, SchedulerConfig
from pdserve.engine.core.block_hashes import full_block_hashes
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.kv_tier.tier import KVTier
from tests.factories import computed_blocks
from tests.helpers.scheduler import feed, seq


def wait_done(tier: KVTier, key: str) -> None:
    deadline = time.monotonic() + 10
    while tier.fetching(key):
        assert time.monotonic() < deadline, f"read-ahead {key!r} never finished"
        time.sleep(0.002)


def stored_tier(tmp_path, blocks: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor, KVTier, list]:
    """A tier holding ``blocks`` files of a (blocks + 2, 16) float32 cache's rows, the rows then zeroed."""
    cache = torch.randn(blocks + 2, 16)
    saved = cache.clone()
    tier = KVTier(cache, str(tmp_path), 1 << 20, read_ahead_wait_s=60, read_ahead=True, **kwargs)
    chain = [(h, (2 * b, 2 * b + 1)) for b, h in enumerate(full_block_hashes(list(range(2 * blocks)), 2))]
    for b, (h, tokens) in enumerate(chain):
        tier.offload(b, h, tokens)
    tier.flush()
    cache.zero_()
    return cache, saved, tier, chain


def test_blocks_read_ahead_load_from_memory_up_to_the_first_the_tier_lacks(tmp_path):
    cache, saved, tier, chain = stored_tier(tmp_path, 4)
    missing = (b"\x07" * 16, (99, 99))
    tier.prefetch("p", chain[:2] + [missing] + chain[2:])
    wait_done(tier, "p")
    for b, (h, tokens) in enumerate(chain):
        assert tier.load(b, h, tokens)
    assert torch.equal(cache[:4], saved[:4])
    assert tier.blocks_read_ahead == 2 and tier.stats().blocks_loaded == 4  # the last two from their files
    os.unlink(tier.store.path(chain[0][0]))
    tier.prefetch("q", chain[:1])
    wait_done(tier, "q")
    assert not tier.contains(chain[0][0]) and not tier.load(0, *chain[0])  # gone: nothing read ahead
    tier.close()


def test_a_damaged_block_read_ahead_is_removed_and_counted(tmp_path):
    _, _, tier, chain = stored_tier(tmp_path, 2)
    with open(tier.store.path(chain[0][0]), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")  # the payload's last byte
    events = []
    tier.subscribe(lambda h, stored: events.append((h, stored)))
    tier.prefetch("p", chain)
    wait_done(tier, "p")
    assert events == [(chain[0][0], False)] and tier.stats().corrupt_blocks == 1
    assert not tier.load(0, *chain[0]) and tier.blocks_read_ahead == 0
    tier.close()


def test_copies_read_ahead_give_their_buffers_to_offloads(tmp_path):
    cache, saved, tier, chain = stored_tier(tmp_path, 3, max_pending_bytes=2 * 16 * 4)
    tier.offload_wait_s = 0.01  # an offload that waited for the writer would drop its block
    tier.prefetch("p", chain)  # two buffers: the third block is not read ahead
    wait_done(tier, "p")
    assert tier.blocks_read_ahead == 0 and tier.contains(chain[2][0])
    cache[4] = saved[4]
    tier.offload(4, b"\x05" * 16, (8, 9))  # takes the oldest copy's buffer rather than dropping
    assert tier.blocks_dropped == 0
    assert tier.load(1, *chain[1]) and tier.load(0, *chain[0])  # read ahead, and again from its file
    assert tier.blocks_read_ahead == 1 and torch.equal(cache[:2], saved[:2])
    tier.close()


def test_the_scheduler_holds_a_prompt_back_while_its_blocks_are_read_ahead_and_others_run(tmp_path):
    bm = BlockManager(16, 2)
    tier = KVTier(torch.randn(16, 8), str(tmp_path), 1 << 20, read_ahead_wait_s=60, read_ahead=True)
    bm.attach_tier(tier)
    sched = Scheduler(SchedulerConfig(policy=MIXED), bm, 1000, eos_token_ids=(2,))
    alone, late = seq("alone", 9), Sequence("late", list(range(40, 49)), SamplingParams(max_tokens=8))
    for s in (alone, late):  # 4 full blocks and a token each, computed once ...
        computed_blocks(bm, "old", s.token_ids)
        bm.free("old")
    bm.allocate("filler", list(range(500, 532)))  # ... and all their blocks handed out: down to the tier
    bm.free("filler")
    tier.flush()
    release, read = threading.Event(), tier.store.read

    def slow_reader(*args):  # the reader thread's files take long; the engine thread's do not
        if threading.current_thread() is tier._reader:
            release.wait()
        return read(*args)

    tier.store.read = slow_reader
    sched.add(alone)  # nothing else runs: admitted at once, its blocks loaded in the step
    out = sched.schedule()
    assert [s.seq for s in out.seqs] == [alone] and alone.num_cached_tokens == 8
    feed(sched, out)  # now it decodes
    sched.add(late)
    out = sched.schedule()
    assert [s.seq for s in out.seqs] == [alone] and list(sched.waiting) == [late]  # held back: its reads go on
    release.set()
    wait_done(tier, "late")
    feed(sched, out)
    out = sched.schedule()
    assert [s.seq for s in out.seqs] == [alone, late] and late.num_cached_tokens == 8
    assert tier.blocks_read_ahead == 4  # late's blocks, copied from memory
    tier.close()


def test_a_cpu_tier_reads_nothing_ahead_by_default(tmp_path):
    tier = KVTier(torch.zeros(2, 16), str(tmp_path), 1 << 20)
    tier.prefetch("p", [(b"\x01" * 16, (0, 1))])
    assert not tier.read_ahead and not tier.fetching("p")
    tier.close()

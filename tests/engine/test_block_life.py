"""The block life, property-tested: random interleavings of what happens to KV blocks.

A model of the KV cache's *contents* runs beside the block manager. Each slot holds what was
last written into it: ``(salt, tokens[:p + 1])`` when a step computed (or a verified pull
delivered) the KV of position ``p`` of a sequence, or ``GARBAGE`` when a step raised or was
aborted mid-write, a pull failed, or a transfer is still landing. The KV of a position depends
only on the tokens up to it; the salt is kept so that a hit across tenants counts as wrong too.

Rules, each what the engine or a worker does to the block manager:
- a prompt arrives (``allocate`` with the prefix cache and tails, as the scheduler does), and
  its chunks are computed one ``mark_final`` at a time; a step that raised writes garbage and
  marks nothing;
- a decoding sequence grows by one token (``append_slots``, then ``mark_final``);
- a pull starts (``allocate`` without the cache, as ``Scheduler.add_remote_prefilled``), lands
  part of its blocks, then finishes verified (``mark_final`` of the whole prompt) or fails
  (garbage, ``free``);
- a sequence is aborted, finishes, or is preempted (``free``; a preempted one comes back later
  and is allocated again, with the cache);
- a pull is cancelled (or fails) while part of its read is still in flight: the blocks that read
  may still write are freed with ``quarantine``; such a read writes garbage into them at any
  later time (``late_write``) until the transport says it is over (``release_quarantined``).

Invariants checked after every rule:
- ``BlockManager.check_invariants`` (reference counts, the free list, the index, the chains);
- every hash a lookup can find names a block whose slots hold exactly the KV of that hash's
  prefix under that hash's salt;
- every tail a lookup can find holds, in its first slots, exactly the KV of its tokens after
  its parent hash's prefix (pdserve/engine/core/block_tails.py);
- every prefix hit handed to a new allocation (full blocks and a tail's first slots) covers
  slots holding exactly the KV the new sequence would compute itself. This is the one a user
  sees: a wrong hit is a wrong token;
- a quarantined block is in no sequence's table, no index entry, no tail and not free: it is
  never allocated and never matched, so a late write lands in no one's KV; and every block
  comes back only through ``release_quarantined`` (the model's landing reads are the manager's
  quarantine, block for block). Without the quarantine, ``late_write`` garbles the KV of a
  later sequence and the hit check (or the first invariant) fails.

With a tier below the cache (``BlockLifeWithTier``), evicted blocks are offloaded and prompts
continue their hits in it; the tier may lose or damage copies and fail loads, and the same
invariants hold, and so does one more: every copy the tier keeps holds its hash's KV.

On the first design (blocks hashed at allocation) the last two fail within a few rules: a
prompt aborted before its first chunk leaves findable blocks full of garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.core.block_manager import BlockManager, chain_hash, chain_root

NUM_BLOCKS = 12
GARBAGE = ("garbage",)
# Prompts share prefixes so that hits happen; two salts so that tenants meet.
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 6, 7, 8, 1, 2, 3])
SALTS = ("", "tenant-b")


@dataclass
class SeqModel:
    tokens: list[int]
    salt: str
    computed: int = 0  # leading tokens whose KV the model has written as final
    remote: bool = False  # its prompt arrives by a pull, not a local step
    landed: bool = False  # a remote prompt's pull has finished and was verified


class BlockLife(RuleBasedStateMachine):
    BLOCK_SIZE = 2
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.slots: list[list[tuple]] = [[GARBAGE] * self.BLOCK_SIZE for _ in range(self.NUM_BLOCKS)]
        self.seqs: dict[str, SeqModel] = {}
        self.preempted: dict[str, SeqModel] = {}
        self.landing: list[tuple[int, ...]] = []  # blocks of stopped reads not yet over, read by read
        self.next_id = 0

    # ---- helpers -----------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _write(self, sid: str, start: int, end: int, garbage: bool = False) -> None:
        seq, table = self.seqs[sid], self.bm.block_table(sid)
        for p in range(start, end):
            value = GARBAGE if garbage else (seq.salt, tuple(seq.tokens[:p + 1]))
            self.slots[table[p // self.BLOCK_SIZE]][p % self.BLOCK_SIZE] = value

    def _check_hits(self, sid: str, num_cached: int) -> None:
        seq, table = self.seqs[sid], self.bm.block_table(sid)
        for p in range(num_cached):
            got = self.slots[table[p // self.BLOCK_SIZE]][p % self.BLOCK_SIZE]
            assert got == (seq.salt, tuple(seq.tokens[:p + 1])), (
                f"{sid} reused block {table[p // self.BLOCK_SIZE]} whose slot {p % self.BLOCK_SIZE} holds {got}")

    def _admit(self, sid: str, seq: SeqModel) -> None:
        alloc = self.bm.allocate(sid, seq.tokens, cache_salt=seq.salt, take_tail=True)
        self.seqs[sid] = seq
        seq.computed = alloc.num_cached_tokens
        self._check_hits(sid, alloc.num_cached_tokens)

    def _local(self, computing: bool):
        return sorted(s for s, m in self.seqs.items() if not m.remote and (m.computed < len(m.tokens)) == computing)

    # ---- rules -------------------------------------------------------------------
    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 8), tail=st.lists(st.integers(0, 3), max_size=3),
          salt=st.sampled_from(SALTS))
    def prompt_arrives(self, base, cut, tail, salt):
        tokens = base[:cut] + tail
        if self.bm.can_allocate(len(tokens)):
            self._admit(self._new_id(), SeqModel(tokens, salt))

    @precondition(lambda self: self._local(computing=True))
    @rule(data=st.data(), n=st.integers(1, 5))
    def chunk_computes(self, data, n):
        sid = data.draw(st.sampled_from(self._local(computing=True)))
        seq = self.seqs[sid]
        end = min(len(seq.tokens), seq.computed + n)
        self._write(sid, seq.computed, end)
        seq.computed = end
        self.bm.mark_final(sid, seq.tokens, end)

    @precondition(lambda self: self._local(computing=True))
    @rule(data=st.data(), n=st.integers(1, 5))
    def chunk_raises(self, data, n):
        """A step that wrote part of its KV and then raised (or whose request was aborted
        while it ran): nothing is final."""
        sid = data.draw(st.sampled_from(self._local(computing=True)))
        seq = self.seqs[sid]
        self._write(sid, seq.computed, min(len(seq.tokens), seq.computed + n), garbage=True)

    @precondition(lambda self: self._local(computing=False)
                  or any(m.landed for m in self.seqs.values()))
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_step(self, data, token):
        ready = self._local(computing=False) + sorted(s for s, m in self.seqs.items() if m.landed)
        sid = data.draw(st.sampled_from(ready))
        seq = self.seqs[sid]
        seq.tokens.append(token)
        if not self.bm.append_slots(sid, seq.tokens):
            seq.tokens.pop()
            return
        self._write(sid, len(seq.tokens) - 1, len(seq.tokens))
        seq.computed = len(seq.tokens)
        self.bm.mark_final(sid, seq.tokens, seq.computed)

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 8), salt=st.sampled_from(SALTS))
    def pull_starts(self, base, cut, salt):
        tokens = base[:cut]
        if self.bm.can_allocate(len(tokens)):
            sid = self._new_id()
            self.bm.allocate(sid, tokens, use_prefix_cache=False, cache_salt=salt)
            self.seqs[sid] = SeqModel(tokens, salt, remote=True)

    def _pulling(self):
        return sorted(s for s, m in self.seqs.items() if m.remote and not m.landed)

    @precondition(lambda self: self._pulling())
    @rule(data=st.data())
    def pull_lands_partly(self, data):
        """Streamed KV: some blocks are in, the rest not yet; in-flight bytes are not final."""
        sid = data.draw(st.sampled_from(self._pulling()))
        seq = self.seqs[sid]
        part = data.draw(st.integers(0, len(seq.tokens)))
        self._write(sid, 0, part)
        self._write(sid, part, len(seq.tokens), garbage=True)

    @precondition(lambda self: self._pulling())
    @rule(data=st.data())
    def pull_finishes_verified(self, data):
        sid = data.draw(st.sampled_from(self._pulling()))
        seq = self.seqs[sid]
        self._write(sid, 0, len(seq.tokens))
        seq.computed, seq.landed = len(seq.tokens), True
        self.bm.mark_final(sid, seq.tokens, len(seq.tokens))

    @precondition(lambda self: self._pulling())
    @rule(data=st.data())
    def pull_fails(self, data):
        """A failed read, a checksum mismatch or an expired lease: the bytes are not the KV."""
        sid = data.draw(st.sampled_from(self._pulling()))
        self._write(sid, 0, len(self.seqs[sid].tokens), garbage=True)
        self.bm.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self._pulling())
    @rule(data=st.data())
    def pull_cancelled_in_flight(self, data):
        """The request is aborted (or a read of its transfer failed) while some of its blocks'
        read is still moving: those stay quarantined, the others are freed."""
        sid = data.draw(st.sampled_from(self._pulling()))
        table = self.bm.block_table(sid)
        moving = tuple(sorted(data.draw(st.sets(st.sampled_from(table), min_size=1))))
        self._write(sid, 0, len(self.seqs[sid].tokens), garbage=True)
        self.bm.free(sid, quarantine=moving)
        del self.seqs[sid]
        self.landing.append(moving)

    @precondition(lambda self: self.landing)
    @rule(data=st.data())
    def late_write(self, data):
        """A stopped read still lands bytes: into its own blocks only, whoever holds them now."""
        for block in data.draw(st.sampled_from(self.landing)):
            self.slots[block] = [GARBAGE] * self.BLOCK_SIZE

    @precondition(lambda self: self.landing)
    @rule(data=st.data())
    def read_over(self, data):
        """The transport says a stopped read has ended: its blocks may be used again."""
        moving = data.draw(st.sampled_from(self.landing))
        self.landing.remove(moving)
        self.bm.release_quarantined(moving)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def ends(self, data):
        """Aborted by its client, finished, or its lease released: its blocks are freed."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self._local(computing=False))
    @rule(data=st.data())
    def preempted(self, data):
        sid = data.draw(st.sampled_from(self._local(computing=False)))
        self.bm.free(sid)
        self.preempted[sid] = self.seqs.pop(sid)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resumes(self, data):
        sid = data.draw(st.sampled_from(sorted(self.preempted)))
        seq = self.preempted[sid]
        if self.bm.can_allocate(len(seq.tokens)):
            del self.preempted[sid]
            self._admit(sid, SeqModel(seq.tokens, seq.salt))

    # ---- invariants --------------------------------------------------------------
    @invariant()
    def accounting_holds(self):
        self.bm.check_invariants()

    @invariant()
    def quarantined_blocks_are_nobodys(self):
        landing = {b for moving in self.landing for b in moving}
        assert self.bm.num_quarantined == len(landing)
        held = {b for sid in list(self.seqs) + [s for s in self.bm._seqs if s not in self.seqs]
                for b in self.bm.block_table(sid)}
        assert not landing & held, f"blocks {sorted(landing & held)} are allocated while a read may write them"
        assert not landing & set(self.bm._by_hash.values()), "a quarantined block is findable"
        assert not landing & {b for b, _, _ in self.bm._tails.items()}, "a quarantined block is a tail"
        assert not landing & set(self.bm._free), "a quarantined block is free"

    @invariant()
    def every_findable_block_holds_its_prefix(self):
        for block_hash, block_id in self.bm._by_hash.items():
            self._holds_prefix(block_hash, self.slots[block_id], f"block {block_id}")

    def _holds_prefix(self, block_hash: bytes, slots: list[tuple], what: str) -> None:
        last = slots[self.BLOCK_SIZE - 1]
        assert last is not GARBAGE, f"{what} is findable but holds garbage"
        salt, prefix = last
        assert len(prefix) % self.BLOCK_SIZE == 0
        chain = chain_root(salt)
        for i in range(len(prefix) // self.BLOCK_SIZE):
            chain = chain_hash(chain, prefix[i * self.BLOCK_SIZE:(i + 1) * self.BLOCK_SIZE])
        assert chain == block_hash, f"{what} is findable under another prefix's hash"
        for j in range(self.BLOCK_SIZE):
            want = (salt, prefix[:len(prefix) - self.BLOCK_SIZE + j + 1])
            assert slots[j] == want, f"{what} slot {j}: {slots[j]}"


    @invariant()
    def every_tail_holds_its_tokens_after_its_parent(self):
        for block_id, parent, tail in self.bm._tails.items():
            for j in range(len(tail)):
                got = self.slots[block_id][j]
                assert got is not GARBAGE, f"tail block {block_id} slot {j} holds garbage"
                salt, prefix = got
                before, mine = prefix[:len(prefix) - j - 1], prefix[len(prefix) - j - 1:]
                assert mine == tuple(tail[:j + 1]) and len(before) % self.BLOCK_SIZE == 0
                chain = chain_root(salt)
                for i in range(len(before) // self.BLOCK_SIZE):
                    chain = chain_hash(chain, before[i * self.BLOCK_SIZE:(i + 1) * self.BLOCK_SIZE])
                assert chain == parent, f"tail block {block_id} slot {j} holds another prefix's KV"


class BlockLifeOf3(BlockLife):
    """Blocks of 3: tails of 1 or 2 tokens, so a prompt can take part of a tail."""

    BLOCK_SIZE = 3


class ModelTier:
    """A ``LowerTier`` over the model's slots: what ``KVTier`` does with a block's bytes
    (pdserve/engine/kv_tier/tier.py), done with the model's values. A stored copy can be lost
    (another process's eviction) or damaged (its checksum will not match), and loads can fail
    outright (an unreadable directory); a failed load leaves the block's slots undefined."""

    def __init__(self, life: "BlockLifeWithTier"):
        self.life = life
        self.stored: dict[bytes, tuple[tuple[int, ...], list[tuple], bool]] = {}  # hash -> (tokens, slots, intact)
        self.failing = False

    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        self.stored[block_hash] = (tuple(token_ids), list(self.life.slots[block_id]), True)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.stored

    def load(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        tokens, slots, intact = self.stored.get(block_hash, ((), [], False))
        if self.failing or not intact or tokens != tuple(token_ids):
            self.life.slots[block_id] = [GARBAGE] * self.life.BLOCK_SIZE
            if block_hash in self.stored and not self.failing:
                del self.stored[block_hash]  # found corrupt: removed
            return False
        self.life.slots[block_id] = list(slots)
        return True


class BlockLifeWithTier(BlockLife):
    """The same life with a tier below the cache: evicted blocks go down to it and prompts
    continue their hits in it. Hits from the tier must hold exactly the KV their sequence would
    compute, and every copy the tier keeps must be that of its hash. Fewer blocks: prefixes
    leave memory sooner, so that prompts come back to them in the tier."""

    NUM_BLOCKS = 7

    def __init__(self):
        super().__init__()
        self.tier = ModelTier(self)
        self.bm.attach_tier(self.tier)

    @precondition(lambda self: self.tier.stored)
    @rule(data=st.data(), damage=st.booleans())
    def tier_loses_or_damages_a_block(self, data, damage):
        block_hash = data.draw(st.sampled_from(sorted(self.tier.stored)))
        if damage:
            tokens, _, _ = self.tier.stored[block_hash]
            self.tier.stored[block_hash] = (tokens, [GARBAGE] * self.BLOCK_SIZE, False)
        else:
            del self.tier.stored[block_hash]

    @precondition(lambda self: any(intact for _, _, intact in self.tier.stored.values()))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def prompt_revisits_a_prefix_in_the_tier(self, data, tail):
        """A prompt beginning with a prefix whose last block went down to the tier."""
        kept = sorted(h for h, (_, _, intact) in self.tier.stored.items() if intact)
        salt, prefix = self.tier.stored[data.draw(st.sampled_from(kept))][1][-1]
        tokens = list(prefix) + tail
        if self.bm.can_allocate(len(tokens)):
            self._admit(self._new_id(), SeqModel(tokens, salt))

    @rule(failing=st.booleans())
    def tier_loads_fail(self, failing):
        self.tier.failing = failing

    @invariant()
    def every_intact_tier_copy_holds_its_prefix(self):
        for block_hash, (_, slots, intact) in self.tier.stored.items():
            if intact:
                self._holds_prefix(block_hash, slots, f"the tier's copy of {block_hash.hex()}")
        assert self.bm.tier_hits <= self.bm.prefix_hits


BlockLife.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
BlockLifeOf3.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
BlockLifeWithTier.TestCase.settings = settings(max_examples=100, stateful_step_count=80, deadline=None)
TestBlockLife = BlockLife.TestCase
TestBlockLifeOf3 = BlockLifeOf3.TestCase
TestBlockLifeWithTier = BlockLifeWithTier.TestCase

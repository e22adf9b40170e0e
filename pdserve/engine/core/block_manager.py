"""Block accounting for the paged KV cache, in plain Python (no torch).

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. Each sequence
owns a block table (a list of block ids, in token order). Full blocks get a chained hash
(the hash of the previous block and this block's tokens), so a later prompt that starts
with the same tokens reuses them: the prefix cache. A request's ``cache_salt`` (vLLM's field)
is the root of its chain, so blocks are shared only between requests of the same salt: one
tenant cannot learn from a hit (or ``cached_tokens``) what another sent.

A block's life is a small state machine, and only this module moves it:

    FREE ──allocate──▶ PENDING ──mark_final──▶ SHARED ──last free──▶ CACHED
      ▲                   │                      ▲                     │  │
      └────last free──────┘                      └──────prefix hit─────┘  │
    PENDING ◀──────────────── allocate (evicts the hash) ─────────────────┘
    PENDING ──free with a read still landing──▶ QUARANTINED ──release_quarantined──▶ FREE
    FREE or CACHED (offloaded first) ──allocate, loaded from the tier and verified──▶ SHARED

- PENDING: held by a sequence, contents not final: being computed, arriving over a transfer,
  or abandoned by an abort, a failed pull or a preemption. Never findable.
- SHARED: held by a sequence, full, and final: a finished step computed every token in it
  (``mark_final`` from the scheduler), or a transfer delivered it and its checksum matched
  (``mark_final`` from ``Scheduler.kv_ready``). Findable by its chained hash.
- CACHED: held by no sequence, contents kept: findable until the block is handed out again
  (the free list is least-recently-freed first, so freed prefixes stay reusable for as long
  as memory allows).
- FREE: held by no sequence, nothing findable.
- QUARANTINED: held by no sequence, but a read into it was cancelled or failed and the transport
  has not said that read is over: a late write may still land. Never free, allocated, findable or
  a tail; FREE again only by ``release_quarantined``, once the transport reports the read over
  (``pdserve.shell.read_quarantine``). Earlier, the late write would land in another request's KV.
- TAIL: a freed sequence's partial last block of final tokens (block_tails.py), taken whole by one
  ``allocate(take_tail=True)`` going on the same way, or handed out. Never hashed or published.

Invariants (``check_invariants``; tests/engine/test_block_life.py drives random interleavings
of allocate, compute, abort, preempt, pull start/finish/fail/cancel, late writes and free through them):

1. A block is free (in the free list) exactly when no sequence's table holds it, and its
   reference count is the number of tables that hold it.
2. Every hash a lookup can find names a block whose ``hash`` is that hash and whose contents
   were made final by ``mark_final`` under that chain; a PENDING block is never in the index.
3. A sequence's first ``num_hashed`` blocks are the full blocks of its final tokens, chained
   from its salt's root; nothing past its final tokens is ever hashed; its final tokens past
   them (fewer than a block) are its tail once it is freed.
4. A tail's block is free, unhashed, in one tail only, and holds 1 to ``block_size - 1`` tokens.
5. A quarantined block is held by no table, is not in the free list, and is unhashed.

Hence the rule the rest of pdserve relies on: a block is shared (found by a prefix lookup,
published to the router) only when its KV is final. The first design registered a prompt's
full blocks when they were allocated, so an abort between prefill chunks left hashes pointing
at blocks that were never computed, and the next request with that prefix decoded garbage.

The tier (``attach_tier``; block_tier.py, pdserve/engine/kv_tier/): a CACHED block handed out
again (``_take_fresh``, the only eviction) is offloaded to the tier before its hash is dropped;
never a PENDING, SHARED, quarantined or tail block. A prompt's allocation (``allocate`` with
``count``), after its device hits, goes on along its chain: a next block on the device again
is a hit; one the tier holds is loaded into a fresh block and, verified, becomes SHARED at once
(hashed, findable, emitted, counted in ``prefix_hits`` and ``tier_hits``); a load that fails
leaves that block fresh, to be computed, and ends the chain. So the tier adds final KV only
(invariant 2). ``share_prefix`` and ``count=False`` pins look on the device alone: a holder
pins what memory has for a reader now, without evicting others' prefixes for it, and a
prefill worker's pin reads what its device lacks from the peer that offered it. ``prefetch``
lets the tier read a queued prompt's blocks ahead; no block changes state until ``allocate``.

Listeners (``subscribe``) hear each change of the set of cached hashes: ``(hash, True)`` when
a full block's hash becomes findable (it became final), ``(hash, False)`` when it stops being
findable because its block is handed out again (evicted). A prefill worker publishes these
events so that routers know where each prefix is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Collection, Sequence

from pdserve.engine.core.block_checks import BlockStateError, check_invariants
from pdserve.engine.core.block_records import Allocation, BlockRecord, SeqBlocks
from pdserve.engine.core.block_hashes import NO_HASH, chain_hash, chain_root, full_block_hashes, prompt_block_hashes
from pdserve.engine.core.block_tails import TailIndex
from pdserve.engine.core.block_tier import LowerTier
from pdserve.engine.errors import CacheCapacityError

__all__ = ["NO_HASH", "Allocation", "BlockManager", "BlockStateError", "chain_hash", "chain_root", "full_block_hashes",
           "prompt_block_hashes"]  # the hashes live in block_hashes.py, named here as before

# (block hash, True: now cached / False: evicted); called on the thread that changed the cache.
CacheListener = Callable[[bytes, bool], None]


class BlockManager:
    """Allocates, shares and frees KV blocks; owns every sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._blocks = [BlockRecord(i) for i in range(num_blocks)]
        # Insertion-ordered free list: O(1) pop of the oldest and O(1) removal of a cached
        # block that a prefix hit revives.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._tails = TailIndex()  # freed partial blocks (block_tails.py)
        self._seqs: dict[str, SeqBlocks] = {}
        self._quarantined: set[int] = set()  # blocks a read may still write (module docstring)
        self.prefix_queries = 0  # prompt tokens eligible for the cache (whole blocks, and a tail's room)
        self.prefix_hits = 0  # of those, found (full-block hits and a tail's tokens)
        self.tier_hits = 0  # of those, full blocks loaded from the tier
        self._tier: LowerTier | None = None
        self._listeners: list[CacheListener] = []

    def subscribe(self, listener: CacheListener) -> None:
        """Call ``listener(hash, cached)`` at every change of the set of cached hashes."""
        self._listeners.append(listener)

    def attach_tier(self, tier: LowerTier) -> None:
        """Evicted CACHED blocks go down to ``tier``, and prompts continue their hits in it."""
        self._tier = tier

    def cached_hashes(self) -> list[bytes]:
        """Every hash a prefix lookup can find now (for a listener that starts late)."""
        return list(self._by_hash)

    def _emit(self, block_hash: bytes, cached: bool) -> None:
        for listener in self._listeners:
            listener(block_hash, cached)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        """Blocks a cancelled or failed read may still write (QUARANTINED): neither held nor free."""
        return len(self._quarantined)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (0.0 to 1.0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._seqs[seq_id].block_ids

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``num_tokens`` fresh slots fit while leaving ``reserve`` blocks free.

        Conservative: ignores prefix-cache hits that would make the request cheaper.
        """
        return self.blocks_needed(num_tokens) + reserve <= len(self._free)

    def check_fits(self, num_tokens: int) -> None:
        """Raise if a sequence of ``num_tokens`` could never fit, even in an empty cache."""
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks:
            raise CacheCapacityError(needed, self.num_blocks)

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: Sequence[int], use_prefix_cache: bool = True,
                 cache_salt: str = "", count: bool = True, take_tail: bool = False) -> Allocation:
        """Give ``seq_id`` blocks for all of ``token_ids``, reusing cached full blocks of the
        same ``cache_salt``. The fresh blocks are PENDING: nothing can find them until
        ``mark_final`` says their KV is final (they are then hashed under this salt).
        ``count`` False: not a prefix query of a prompt (no hit counted; a prefill worker's
        pin for a prefix it reads, ``pdserve.prefill_worker.prefix_pull``).
        ``take_tail`` (with the prefix cache): after the full-block hits, take the tail sharing
        the most next tokens (block_tails.py). Only for a caller that computes the rest of its
        block: a pull writes whole blocks, over the tail's final slots. At least one token is
        always left uncached: the model must run on the last prompt token for its logits.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        needed = self.blocks_needed(len(token_ids))
        root = chain_root(cache_salt)
        cache = use_prefix_cache and self.enable_prefix_cache
        hits = self._match_prefix(token_ids, root, count) if cache else []
        state = SeqBlocks(last_hash=hits[-1][1] if hits else root, root=root, num_hashed=len(hits),
                           num_final_tokens=len(hits) * self.block_size, tokens=token_ids)
        # Each block past the hits takes at most one free block, whether computed, loaded from
        # the tier, a later hit or a tail: checked before anything changes.
        if needed - len(hits) > len(self._free) - sum(1 for b, _ in hits if b in self._free):
            raise CacheCapacityError(needed, len(self._free))
        for block_id, _ in hits:
            self._take(block_id)
            state.block_ids.append(block_id)
        if cache and count and self._tier is not None:
            self._continue_in_tier(state, token_ids)
        start = state.num_final_tokens  # a tail's tokens go on from here, short of the last token
        tail = self._tails.best(state.last_hash, token_ids[start:start + self.block_size],
                                len(token_ids) - 1 - start) \
            if cache and take_tail and len(state.block_ids) == state.num_hashed else None
        if tail:
            self._tails.drop(tail[0])  # a tail taken is no one else's
            self._take(tail[0])
            state.block_ids.append(tail[0])
        found = tail[1] if tail else 0
        state.num_final_tokens += found
        if cache and take_tail and count:  # the tokens past the full blocks were looked up too
            self.prefix_queries += (len(token_ids) - 1) % self.block_size
            self.prefix_hits += found
        while len(state.block_ids) < needed:
            state.block_ids.append(self._take_fresh())
        self._seqs[seq_id] = state
        return Allocation(tuple(state.block_ids), state.num_final_tokens)

    def share_prefix(self, seq_id: str, token_ids: Sequence[int], cache_salt: str = "") -> Allocation:
        """Give ``seq_id`` references to the cached full blocks that begin ``token_ids`` (the
        blocks ``allocate`` would find), and no fresh block: a holder pins final KV that a
        reader copies (``pdserve.decode_worker.prefix_hold``), so it is neither evicted nor
        reused until ``free(seq_id)``. Not a prefix query (no hit counted). With no hit,
        ``seq_id`` gets nothing and the allocation is empty."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        root = chain_root(cache_salt)
        hits = self._match_prefix(token_ids, root, count=False) if self.enable_prefix_cache else []
        if not hits:
            return Allocation((), 0)
        state = SeqBlocks(last_hash=hits[-1][1], root=root, num_hashed=len(hits),
                           num_final_tokens=len(hits) * self.block_size, tokens=token_ids)
        for block_id, _ in hits:
            self._take(block_id)
            state.block_ids.append(block_id)
        self._seqs[seq_id] = state
        return Allocation(tuple(state.block_ids), len(hits) * self.block_size)

    def _match_prefix(self, token_ids: Sequence[int], root: bytes, count: bool = True) -> list[tuple[int, bytes]]:
        bs = self.block_size
        num_full = len(token_ids) // bs
        if num_full * bs == len(token_ids):
            num_full -= 1  # keep the last block uncached so the last token gets computed
        hits: list[tuple[int, bytes]] = []
        prev = root
        if count:
            self.prefix_queries += max(num_full, 0) * bs  # every eligible block counts, hit or not
        for i in range(max(num_full, 0)):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, chunk)
            block_id = self._by_hash.get(h)
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            self.prefix_hits += count * bs
            hits.append((block_id, h))
            prev = h
        return hits

    def _continue_in_tier(self, state: SeqBlocks, token_ids: Sequence[int]) -> None:
        """Go on with ``state``'s prefix chain past its device hits (module docstring, "The tier"):
        each next block is a device hit again, or loaded from the tier into a fresh block; the
        first block found in neither (or whose load fails, kept as a fresh block) ends it."""
        bs, tier = self.block_size, self._tier
        for i in range(state.num_hashed, (len(token_ids) - 1) // bs):  # never the last token's block
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(state.last_hash, chunk)
            block_id = self._by_hash.get(h)
            if block_id is not None and self._blocks[block_id].token_ids == chunk:
                self._take(block_id)
            elif tier.contains(h):
                block_id = self._take_fresh()
                state.block_ids.append(block_id)
                if not tier.load(block_id, h, chunk):
                    return  # the block stays fresh (PENDING) and is computed
                state.block_ids.pop()
                block = self._blocks[block_id]
                block.hash, block.token_ids = h, chunk
                self._by_hash[h] = block_id
                self._emit(h, True)
                self.tier_hits += bs
            else:
                return
            state.block_ids.append(block_id)
            state.last_hash, state.num_hashed, state.num_final_tokens = h, i + 1, (i + 1) * bs
            self.prefix_hits += bs

    def prefetch(self, seq_id: str, token_ids: Sequence[int], cache_salt: str = "") -> None:
        """Have the tier read ahead, under ``seq_id``, the prompt blocks that a later ``allocate``
        may load from it (those not on the device now; block_tier.py). Changes nothing here."""
        if self._tier is not None and self._tier.read_ahead and self.enable_prefix_cache:
            bs, hashes = self.block_size, prompt_block_hashes(token_ids, self.block_size, cache_salt)
            chain = [(h, tuple(token_ids[i * bs:(i + 1) * bs])) for i, h in enumerate(hashes) if h not in self._by_hash]
            if chain:
                self._tier.prefetch(seq_id, chain)

    def tier_fetching(self, seq_id: str) -> bool:
        """Whether the tier still reads ``seq_id``'s blocks ahead (``prefetch``)."""
        return self._tier is not None and self._tier.fetching(seq_id)

    def append_slots(self, seq_id: str, token_ids: Sequence[int], lookahead: int = 0) -> bool:
        """Make room for ``token_ids`` (the sequence's whole token list, the newest last) and
        ``lookahead`` slots past them (guesses a speculative step verifies: their KV is not final
        until kept). False, changing nothing, when a new block is needed and none is free."""
        state = self._seqs[seq_id]
        needed = self.blocks_needed(len(token_ids) + lookahead)
        if needed - len(state.block_ids) > len(self._free):
            return False
        while len(state.block_ids) < needed:
            state.block_ids.append(self._take_fresh())
        return True

    def mark_final(self, seq_id: str, token_ids: Sequence[int], num_final: int) -> None:
        """The KV of the first ``num_final`` of ``token_ids`` is final in ``seq_id``'s blocks:
        a step that computed them has finished, or a transfer that delivered them was
        verified. The full blocks they fill become SHARED (findable, published). Called only
        then: a block marked final too early is a wrong token for whoever finds it."""
        state = self._seqs[seq_id]
        if num_final > len(state.block_ids) * self.block_size or num_final > len(token_ids):
            raise BlockStateError(f"sequence {seq_id!r}: {num_final} final tokens, but it holds "
                                  f"{len(state.block_ids)} blocks and {len(token_ids)} tokens")
        if num_final >= state.num_final_tokens:
            state.num_final_tokens, state.tokens = num_final, token_ids
        self._register_full_blocks(state, token_ids, num_final)

    def free(self, seq_id: str, quarantine: Collection[int] = ()) -> None:
        """Drop the sequence's references; blocks no one else holds go back to the free list,
        except those of ``quarantine``: blocks of this sequence alone that a cancelled or failed
        read may still write, which become QUARANTINED until ``release_quarantined``."""
        state, landing = self._seqs.get(seq_id), set(quarantine)
        if state is None or any(b not in state.block_ids or self._blocks[b].ref_count != 1 for b in landing):
            if landing:  # checked before anything changes
                raise BlockStateError(f"sequence {seq_id!r} does not hold all of {sorted(landing)} alone to quarantine")
            return
        del self._seqs[seq_id]
        # Reverse order: the end of a sequence is the least likely to be shared again, so it
        # is handed out first. Its partial block of final tokens stays findable as a tail.
        tail = tuple(state.tokens[state.num_hashed * self.block_size:state.num_final_tokens]) if self.enable_prefix_cache else ()
        for block_id in reversed(state.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block_id in landing:
                self._unhash(block)
                self._quarantined.add(block_id)
            elif block.ref_count == 0:
                self._free[block_id] = None
                if tail and block_id == state.block_ids[state.num_hashed]:
                    self._tails.add(state.last_hash, block_id, tail)

    def release_quarantined(self, block_ids: Collection[int]) -> None:
        """The transport says every read into ``block_ids`` is over: they are FREE again."""
        if any(b not in self._quarantined for b in block_ids):
            raise BlockStateError(f"blocks {sorted(set(block_ids) - self._quarantined)} are not quarantined")
        for block_id in block_ids:
            self._quarantined.discard(block_id)
            self._free[block_id] = None

    def check_invariants(self) -> None:
        """Raise ``BlockStateError`` if an invariant of the module docstring does not hold.
        O(blocks + tokens): for tests and debugging, not for a serving step (block_checks.py)."""
        check_invariants(self)

    # ---- internals -----------------------------------------------------------------
    def _register_full_blocks(self, state: SeqBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash the full blocks of the first ``num_tokens`` of ``token_ids`` not hashed yet
        (no slice of the whole list: a decode step calls this for every sequence)."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        num_full = min(num_tokens // bs, len(state.block_ids))
        for i in range(state.num_hashed, num_full):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(state.last_hash, chunk)
            block = self._blocks[state.block_ids[i]]
            block.hash, block.token_ids = h, chunk
            new = h not in self._by_hash  # else another block holds the same tokens: still cached
            self._by_hash[h] = block.block_id
            if new:
                self._emit(h, True)
            state.last_hash = h
        state.num_hashed = max(state.num_hashed, num_full)

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        self._free.pop(block_id, None)
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._tails.drop(block_id)
        block = self._blocks[block_id]
        if self._tier is not None and block.hash and self._by_hash.get(block.hash) == block_id:
            self._tier.offload(block_id, block.hash, block.token_ids)  # CACHED, evicted: down to the tier
        self._unhash(block)
        block.ref_count = 1
        return block_id

    def _unhash(self, block: BlockRecord) -> None:
        """Nothing finds ``block`` any more (its contents are about to change)."""
        if block.hash and self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
            self._emit(block.hash, False)
        block.hash, block.token_ids = NO_HASH, ()

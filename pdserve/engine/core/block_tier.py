"""What the block manager asks of a KV tier below it (pdserve/engine/kv_tier/): a place where a
full, final prefix block goes when its memory is handed out again, and from which a later
prompt's block comes back. The block manager stays plain Python: it knows block ids, chained
hashes and tokens, never bytes; the tier moves the bytes between the cache and its store.

Both calls run on the engine thread, inside ``BlockManager.allocate``/``append_slots``, before
the block is written again: ``offload`` must have taken the block's bytes when it returns (it
may write them to its store later), and ``load`` must have written and verified them when it
returns True. A tier that fails (full, corrupt, gone) says False or drops the block: the prompt
is then computed, never served from unverified bytes.

``prefetch`` and ``fetching`` let a tier read a queued prompt's blocks ahead of its
``allocate`` (off the engine thread), so that ``load`` copies them from memory; the scheduler
holds the prompt back while ``fetching`` says the reads go on and other sequences run. Reading
ahead is a hint: ``load`` verifies and decides as before.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class LowerTier(Protocol):
    read_ahead: bool  # whether ``prefetch`` does anything (else the block manager skips it)

    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Block ``block_id`` holds the final KV of ``token_ids`` under chained hash
        ``block_hash`` and is about to be handed out again: keep a copy of its bytes."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether ``load`` may find ``block_hash`` (advisory: ``load`` still checks)."""

    def load(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Write the stored KV of ``block_hash`` into block ``block_id``; True only when the
        bytes match their checksum and the stored tokens equal ``token_ids``."""

    def prefetch(self, key: str, chain: Sequence[tuple[bytes, tuple[int, ...]]]) -> None:
        """Start reading ``chain``'s blocks ((hash, tokens), in prompt order) ahead, under ``key``."""

    def fetching(self, key: str) -> bool:
        """Whether read-ahead ``key`` is still going (bounded in time: never True for long)."""

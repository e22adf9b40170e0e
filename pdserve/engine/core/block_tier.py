"""What the block manager asks of a KV tier below it (pdserve/engine/kv_tier/): a place where a
full, final prefix block goes when its memory is handed out again, and from which a later
prompt's block comes back. The block manager stays plain Python: it knows block ids, chained
hashes and tokens, never bytes; the tier moves the bytes between the cache and its store.

Both calls run on the engine thread, inside ``BlockManager.allocate``/``append_slots``, before
the block is written again: ``offload`` must have taken the block's bytes when it returns (it
may write them to its store later), and ``load`` must have written and verified them when it
returns True. A tier that fails (full, corrupt, gone) says False or drops the block: the prompt
is then computed, never served from unverified bytes.
"""

from __future__ import annotations

from typing import Protocol


class LowerTier(Protocol):
    def offload(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Block ``block_id`` holds the final KV of ``token_ids`` under chained hash
        ``block_hash`` and is about to be handed out again: keep a copy of its bytes."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether ``load`` may find ``block_hash`` (advisory: ``load`` still checks)."""

    def load(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Write the stored KV of ``block_hash`` into block ``block_id``; True only when the
        bytes match their checksum and the stored tokens equal ``token_ids``."""

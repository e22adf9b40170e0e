"""The records the block manager keeps (block_manager.py): one per block, one per sequence, and
what an allocation hands back. Plain data; only ``BlockManager`` changes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pdserve.engine.core.block_hashes import NO_HASH


@dataclass
class BlockRecord:
    block_id: int
    ref_count: int = 0
    hash: bytes = NO_HASH
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Allocation:
    """Result of allocating a sequence: its blocks and how many leading tokens were cached."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int


@dataclass
class SeqBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Hash of the last full block made final for this sequence, and how many full blocks
    # have been hashed so far (so appending never re-hashes earlier blocks).
    last_hash: bytes = NO_HASH
    num_hashed: int = 0
    num_final_tokens: int = 0  # leading tokens whose KV is final (prefix hits included)
    root: bytes = NO_HASH  # the chain's root: its salt's (``chain_root``)
    # The token list last marked final (or allocated), by reference, not copied every decode
    # step: a sequence's list only grows, and ``free`` reads its tail from it.
    tokens: Sequence[int] = ()

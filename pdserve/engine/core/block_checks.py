"""The block manager's invariants (its module docstring), checked in full: O(blocks + tokens),
for tests and debugging, never a serving step. Reads ``BlockManager``'s state; changes nothing."""

from __future__ import annotations

from pdserve.engine.core.block_hashes import NO_HASH, chain_hash


class BlockStateError(RuntimeError):
    """An invariant of the block life (block_manager.py's docstring) does not hold: a bug, never input."""


def check_invariants(bm) -> None:
    """``bm``: a ``BlockManager``. Raise ``BlockStateError`` if an invariant of the module docstring does not hold.
    O(blocks + tokens): for tests and debugging, not for a serving step."""
    refs: dict[int, int] = {}
    for state in bm._seqs.values():
        for block_id in state.block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for block in bm._blocks:
        held = refs.get(block.block_id, 0)
        quarantined = block.block_id in bm._quarantined
        if block.ref_count != held or (held == 0 and not quarantined) != (block.block_id in bm._free):
            raise BlockStateError(f"block {block.block_id}: ref_count {block.ref_count}, held by "
                                  f"{held} tables, free {block.block_id in bm._free}, quarantined {quarantined}")
        if quarantined and (held or block.hash):
            raise BlockStateError(f"quarantined block {block.block_id} is held or hashed")
    for block_hash, block_id in bm._by_hash.items():
        if bm._blocks[block_id].hash != block_hash:
            raise BlockStateError(f"the index names block {block_id} for a hash it does not hold")
    for seq_id, state in bm._seqs.items():
        _check_chain(bm, seq_id, state)
    for block_id, _, token_ids in bm._tails.items():
        if bm._blocks[block_id].ref_count or bm._blocks[block_id].hash or block_id in bm._quarantined \
                or not 0 < len(token_ids) < bm.block_size:
            raise BlockStateError(f"tail block {block_id} is held, hashed or of {len(token_ids)} tokens")


def _check_chain(bm, seq_id: str, state) -> None:
    if not state.num_hashed * bm.block_size <= state.num_final_tokens <= len(state.tokens):
        raise BlockStateError(f"sequence {seq_id!r}: {state.num_hashed} blocks hashed, {state.num_final_tokens} "
                              f"final tokens, {len(state.tokens)} tokens")
    prev = state.root
    for i, block_id in enumerate(state.block_ids):
        block = bm._blocks[block_id]
        if i >= state.num_hashed:
            if block.hash != NO_HASH:
                raise BlockStateError(f"sequence {seq_id!r}: block {block_id} at {i} is hashed "
                                      "but not final")
            continue
        if block.hash != chain_hash(prev, block.token_ids):
            raise BlockStateError(f"sequence {seq_id!r}: block {block_id} at {i} breaks its chain")
        prev = block.hash

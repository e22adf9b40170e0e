"""The chained hashes that name full KV blocks: the block manager's prefix index keys, and what
a router computes from a prompt to know where its prefix is cached (``pdserve.router.kv_index``).
Plain Python, the same value in every process."""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

NO_HASH = b""


def kv_salt(params, fingerprint: str) -> str:
    """The salt a request's prompt blocks are hashed with: its ``cache_salt`` with its LoRA
    adapter folded in, so that KV computed under one adapter is never found for another (nor
    for the base model). ``params`` is a ``SamplingParams`` (anything with ``cache_salt`` and
    ``lora_name``); ``fingerprint`` is the adapter's content identity as the worker that runs
    it loaded it (``LoRAAdapter.fingerprint``, a digest of its files): the name alone is not
    enough, since an adapter removed and loaded again under its name from other files has other
    weights, and the old KV must not be found for it (here, in a KV tier that outlived the
    process, or on another worker). A router that knows no fingerprint passes "": a salt no
    worker uses, so its lookups miss. Without an adapter the fingerprint is ignored and the salt
    is ``cache_salt`` itself: the base model's hashes are as before adapters existed. With one
    it starts with a NUL, which no ``cache_salt`` may hold (``SamplingParams.validate``), so no
    client salt can name an adapter's blocks."""
    if not params.lora_name:
        return params.cache_salt
    name = params.lora_name
    return f"\0lora\0{len(name)}\0{name}\0{len(fingerprint)}\0{fingerprint}\0{params.cache_salt}"


def chain_hash(prev_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block given the hash of the block before it (``NO_HASH`` for the first).

    blake2b over packed ints, so the value is the same in every process (unlike ``hash()``
    of a str) and a router can compute it too.
    """
    h = hashlib.blake2b(prev_hash, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_root(cache_salt: str) -> bytes:
    """The ``prev_hash`` of a sequence's first block: ``NO_HASH`` without a salt (the hashes
    of unsalted prompts are as before salts existed), else a hash of the salt."""
    if not cache_salt:
        return NO_HASH
    return hashlib.blake2b(b"pdserve cache salt\0" + cache_salt.encode(), digest_size=16).digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """The chained hashes of the prompt blocks a prefix hit can cover: the full blocks, the
    one holding the last token excluded (it is always computed; ``BlockManager.allocate``).
    Routers compute them to know where a prompt's prefix is cached."""
    return full_block_hashes(token_ids, block_size, cache_salt, (len(token_ids) - 1) // block_size if token_ids else 0)


def full_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "",
                      num_blocks: int | None = None) -> list[bytes]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` (None: all of
    them), as the block manager hashes them once their KV is final."""
    hashes, prev = [], chain_root(cache_salt)
    for i in range(len(token_ids) // block_size if num_blocks is None else num_blocks):
        prev = chain_hash(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes

"""Tails: the last, partial block of a freed sequence, kept for a prompt that extends it.

A prefix-cache hit covers whole blocks (``BlockManager._match_prefix``), so a conversation's
next turn, whose prompt is the previous prompt + its answer + a new message, recomputed the
answer's last partial block: on average half a block a turn (issue 44). A radix cache (SGLang)
matches per token; this keeps block granularity everywhere else and adds one thing: when a
sequence is freed, the block past its last full hashed block, holding its final tokens there
(1 to ``block_size - 1`` of them), is remembered as a tail, keyed by the hash of the full block
before it (or its salt's chain root). A later allocation that has hit every full block up to
that parent and whose next tokens begin like the tail's takes the block itself, zero-copy:
the first ``k`` slots hold the KV it would compute, and it overwrites slots ``k..`` as it runs.

A tail is never a full-block hash: it is never published to routers, never found by
``_match_prefix``, ``share_prefix`` or a prefix read of whole blocks, and is taken by at most
one sequence (taking it removes it; partial blocks are never shared). Its block sits in the
free list like a cached full block, and the tail is forgotten when the block is handed out.

Why the parent hash is a sound key: it names the exact tokens (and salt) before the tail, and
the KV of a token depends only on the tokens up to it. Pure Python, owned by ``BlockManager``.
"""

from __future__ import annotations

from typing import Iterator, Sequence

# Tails kept under one parent; the oldest is forgotten past it (its block stays free). A lookup
# scans a parent's tails, and short chats that share a template's first full block would
# otherwise pile up thousands under one hash; a conversation's live branches are a handful.
MAX_TAILS_PER_PARENT = 8


class TailIndex:
    """The tails of freed sequences: parent chain hash -> {block id: the tokens its KV holds}."""

    def __init__(self) -> None:
        self._by_parent: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parent_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def add(self, parent: bytes, block_id: int, token_ids: tuple[int, ...]) -> None:
        """Keep ``block_id`` as a tail after ``parent`` holding the final KV of ``token_ids``.
        Several tails may share a parent (branches of one conversation), the newest
        ``MAX_TAILS_PER_PARENT`` of them."""
        self.drop(block_id)
        siblings = self._by_parent.setdefault(parent, {})
        siblings[block_id] = token_ids
        self._parent_of[block_id] = parent
        if len(siblings) > MAX_TAILS_PER_PARENT:
            self.drop(next(iter(siblings)))  # the oldest: dicts keep insertion order

    def drop(self, block_id: int) -> None:
        """Forget ``block_id``'s tail, if it is one (its block is handed out or taken)."""
        parent = self._parent_of.pop(block_id, None)
        if parent is None:
            return
        siblings = self._by_parent[parent]
        del siblings[block_id]
        if not siblings:
            del self._by_parent[parent]

    def best(self, parent: bytes, token_ids: Sequence[int], limit: int) -> tuple[int, int] | None:
        """The tail after ``parent`` that shares the most leading tokens with ``token_ids``, at
        most ``limit`` of them: ``(block id, how many)``, or None where none shares one."""
        best: tuple[int, int] | None = None
        for block_id, tail in self._by_parent.get(parent, {}).items():
            k = _common_prefix(tail, token_ids, limit)
            if k and (best is None or k > best[1]):
                best = (block_id, k)
        return best

    def items(self) -> Iterator[tuple[int, bytes, tuple[int, ...]]]:
        """Every tail as ``(block id, parent hash, token ids)`` (for ``check_invariants``)."""
        for parent, tails in self._by_parent.items():
            for block_id, token_ids in tails.items():
                yield block_id, parent, token_ids


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return max(n, 0)

"""The n-gram proposer (prompt lookup): a sequence guesses its own continuation.

For each sequence, the last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up among its earlier tokens, prompt and output; at the most
recent earlier place they occur, the up-to-``k`` tokens that followed are the guess. Text that
repeats itself (code being edited, a document being quoted, a list going on) is guessed well and
at no cost; text that does not gives no guess, and the step runs as without speculation.

The lookup runs every step for every speculating sequence, so it is numpy over the last
``window`` tokens only: a match further back is missed, never slower. Deterministic: no
probabilities (``Proposal.probs`` is None), and no state kept between steps.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.engine.core.sequence import Sequence
from pdserve.engine.spec.proposer import Proposal

WINDOW = 4096  # tokens looked back over: ~0.1 ms a lookup, whatever the context's length


class NgramProposer:
    """``min_n``..``max_n``: the lengths of suffix looked up, longest first."""

    def __init__(self, min_n: int, max_n: int, window: int = WINDOW):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be at least 1 and at most prompt_lookup_max ({max_n})")
        self.min_n, self.max_n, self.window = min_n, max_n, window

    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        return [Proposal(lookup(s.token_ids[-self.window:], self.min_n, self.max_n, k)) for s in seqs]

    def forget(self, seq_id: str) -> None:
        """Nothing is kept per sequence."""


def lookup(tokens: Seq[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-``k`` tokens that followed the most recent earlier occurrence of the last ``n``
    of ``tokens``, for the largest ``n`` in ``min_n..max_n`` that occurs; [] when none does."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        # Windows that start early enough for a token to follow them (so not the suffix itself).
        windows = sliding_window_view(arr[:-1], n)  # (L - n, n)
        starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return arr[follow:follow + k].tolist()
    return []

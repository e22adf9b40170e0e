"""What a proposer promises the engine, and what speculation counts.

A proposer sees the running sequences of a step (``Sequence.token_ids`` ends with the newest
sampled token, whose KV is not computed yet) and guesses up to ``k`` tokens to follow each one.
It keeps whatever state it wants per sequence (a draft model's KV), and must stay right when
the engine keeps fewer of its guesses than it made: the sequence's tokens are the truth at each
call, so state past their common prefix with what it saw last is stale. ``forget`` drops a
sequence that ended or left the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence as Seq

import torch

from pdserve.engine.core.sequence import Sequence


@dataclass
class Proposal:
    """Up to ``k`` guessed tokens for one sequence (empty: no guess this step). ``probs``: the
    (len(token_ids), vocab) float32 distributions the guesses were drawn from, row i for
    token i; None when they were chosen deterministically (an n-gram lookup, a greedy draft),
    which rejection sampling treats as all the mass on the guess."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """One proposal per sequence, in order, each at most ``k`` tokens."""

    def forget(self, seq_id: str) -> None:
        """Drop any state kept for ``seq_id`` (unknown ids are ignored)."""


@dataclass
class SpecStats:
    """Counters since the engine started (vLLM's meanings): ``num_drafts`` proposals verified
    (one per sequence per speculating step, empty proposals not counted), ``num_draft_tokens``
    tokens proposed in them, ``num_accepted_tokens`` of those the target kept, and
    ``accepted_per_pos[i]`` how often the guess at position i was kept. Acceptance rate is
    accepted / draft tokens; mean accepted length is 1 + accepted / drafts (the target's own
    token always comes too)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verified proposal of ``proposed`` tokens of which the first ``accepted`` were kept."""
        if proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

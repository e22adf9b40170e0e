"""Logit processing before the draw: min_tokens, logit_bias and the three penalties.

The order is vLLM's: bans (``min_tokens``) and ``logit_bias`` first, then repetition,
frequency and presence penalties. Only rows whose ``SamplingParams.penalised`` is true are
touched, so a batch without them costs one ``any`` and greedy output stays bit-identical.

The whole step is one plan built on the host (``PenaltyPlan``): for each of the four stages,
the flat positions (row * V + token) it touches and the values it writes there. The plan goes
to the logits' device in one copy that the host does not wait for, and each stage is one
indexed op over the whole batch. Per-row tensors made on the device (a blocking copy each,
up to four a penalised row) were a host sync each on a GPU. The values are the ones the
per-row ops computed, bit for bit: float32 on the host rounds as it does on the device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pdserve.engine.device import to_device
from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling.params import SamplingParams


class PenalisedRow(Protocol):
    """What the penalties read of a row; the sampler's ``SamplerRow`` is one. Declared here, so
    that this module needs nothing of the sampler that calls it."""

    seq_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] is output


@dataclass
class PenaltyPlan:
    """One step's penalties as flat positions into the (B, V) logits and their values, on
    the host. Each list grows row by row; ``tensors`` makes them the step's one copy."""

    vocab: int
    banned: list[int]  # set to -inf (min_tokens)
    bias_at: list[int]  # logit_bias: added
    bias: list[float]
    repeat_at: list[int]  # repetition penalty: divided (multiplied when negative)
    repeat: list[float]
    counted_at: list[int]  # frequency / presence: subtracted
    frequency: list[float]
    count: list[int]
    presence: list[float]

    @classmethod
    def empty(cls, vocab: int) -> "PenaltyPlan":
        return cls(vocab, [], [], [], [], [], [], [], [], [])

    def add(self, i: int, r: PenalisedRow, eos_token_ids: frozenset[int]) -> None:
        """Row ``i``'s part. Raises, having added nothing, when its token ids leave the
        vocabulary (an index the device would fault on, taking every row with it)."""
        p, v = r.params, self.vocab
        output = r.token_ids[r.num_prompt_tokens:]
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)) \
            if len(output) < p.min_tokens else set()
        bias_ids = [t for t, _ in p.logit_bias]
        seen = sorted(set(r.token_ids)) if p.repetition_penalty != 1.0 else []
        counts = Counter(output) if p.frequency_penalty or p.presence_penalty else Counter()
        outside = [t for t in (*banned, *bias_ids, *seen, *counts) if not 0 <= t < v]
        if outside:
            raise IndexError(f"token id {outside[0]} is outside the vocabulary [0, {v})")
        base = i * v
        self.banned += [base + t for t in sorted(banned)]
        self.bias_at += [base + t for t in bias_ids]
        self.bias += [b for _, b in p.logit_bias]
        self.repeat_at += [base + t for t in seen]
        self.repeat += [p.repetition_penalty] * len(seen)
        self.counted_at += [base + t for t in counts]
        self.count += list(counts.values())
        self.frequency += [p.frequency_penalty] * len(counts)
        self.presence += [p.presence_penalty] * len(counts)

    def tensors(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Host tensors: positions (int64) and values (``dtype``) of the four stages. The
        subtracted amounts are computed here, frequency * count + presence, in ``dtype``: the
        same roundings the per-row ops made on the device."""
        counted = torch.tensor(self.frequency, dtype=dtype) * torch.tensor(self.count, dtype=dtype) \
            + torch.tensor(self.presence, dtype=dtype)
        return [torch.tensor(self.banned, dtype=torch.long),
                torch.tensor(self.bias_at, dtype=torch.long), torch.tensor(self.bias, dtype=dtype),
                torch.tensor(self.repeat_at, dtype=torch.long), torch.tensor(self.repeat, dtype=dtype),
                torch.tensor(self.counted_at, dtype=torch.long), -counted]


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenalisedRow], eos_token_ids: frozenset[int],
                    failed: dict[str, SequenceFailed] | None = None) -> torch.Tensor:
    """logits (B, V), changed in place and returned. A row whose plan cannot be built goes to
    ``failed`` and is left as it is (the sampler drops it), or, with no ``failed`` given, the
    error propagates."""
    plan = PenaltyPlan.empty(logits.shape[-1])
    for i, r in enumerate(rows):
        if not r.params.penalised or (failed is not None and r.seq_id in failed):
            continue
        try:
            plan.add(i, r, eos_token_ids)
        except Exception as exc:  # this row's own bias or penalties: its fault alone
            if failed is None:
                raise
            failed[r.seq_id] = SequenceFailed(r.seq_id, "sampling", f"{type(exc).__name__}: {exc}")
    banned, bias_at, bias, repeat_at, repeat, counted_at, counted = to_device(plan.tensors(logits.dtype),
                                                                              logits.device)
    flat = logits.view(-1)  # (B * V,)
    if plan.banned:
        flat.index_fill_(0, banned, float("-inf"))
    if plan.bias_at:
        flat.index_add_(0, bias_at, bias)
    if plan.repeat_at:
        seen = flat.index_select(0, repeat_at)
        flat.index_copy_(0, repeat_at, torch.where(seen < 0, seen * repeat, seen / repeat))
    if plan.counted_at:
        flat.index_add_(0, counted_at, counted)  # x + (-s) is x - s, bit for bit
    return logits

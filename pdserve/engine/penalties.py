"""Logit processing before the draw: min_tokens, logit_bias and the three penalties.

The order is vLLM's: bans (``min_tokens``) and ``logit_bias`` first, then repetition,
frequency and presence penalties. Only rows whose ``SamplingParams.penalised`` is true are
touched, so a batch without them costs one ``any`` and greedy output stays bit-identical.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from pdserve.engine.errors import SequenceFailed
from pdserve.engine.sampling import SamplingParams


class PenalisedRow(Protocol):
    """What the penalties read of a row; the sampler's ``SamplerRow`` is one. Declared here, so
    that this module needs nothing of the sampler that calls it."""

    seq_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] is output


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenalisedRow], eos_token_ids: frozenset[int],
                    failed: dict[str, SequenceFailed] | None = None) -> torch.Tensor:
    """logits (B, V), changed in place and returned. A row whose processing raises goes to
    ``failed`` (its logits row is then unspecified; the sampler drops it), or, with no
    ``failed`` given, the error propagates."""
    for i, r in enumerate(rows):
        if not r.params.penalised or (failed is not None and r.seq_id in failed):
            continue
        try:
            _penalise(logits[i], r, eos_token_ids)
        except Exception as exc:  # this row's own bias or penalties: its fault alone
            if failed is None:
                raise
            failed[r.seq_id] = SequenceFailed(r.seq_id, "sampling", f"{type(exc).__name__}: {exc}")
    return logits


def _penalise(row: torch.Tensor, r: PenalisedRow, eos_token_ids: frozenset[int]) -> None:
    """row (V,), in place."""
    p = r.params
    dev = row.device
    output = r.token_ids[r.num_prompt_tokens:]
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if banned:
            row[torch.tensor(sorted(banned), device=dev)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev, dtype=row.dtype))
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(r.token_ids)), device=dev, dtype=torch.long)
        seen = row[ids]
        row[ids] = torch.where(seen < 0, seen * p.repetition_penalty, seen / p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        # Counts by index_add (exact whole numbers, as bincount gave): it runs on every
        # device type, the meta device of the device tests included.
        ids = torch.tensor(output, device=dev)
        counts = row.new_zeros(row.shape[0]).index_add_(0, ids, row.new_ones(len(output)))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

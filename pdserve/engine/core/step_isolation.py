"""Whose fault a failed step was: its batch is split and run again until the fault is pinned
on the rows that raise on their own.

A step that raises (in the forward, the logits, the sampler: anywhere in the model runner)
names no row. Rather than fail every sequence in it, the engine runs the step's rows again in
halves: a half that runs is kept, a half that raises is split again, and a row that raises
alone while another part of the step ran is that row's own fault (``SequenceFailed``, field
"step"). It ends alone; the rest of its step goes on with the tokens it would have had.

Running a row again changes nothing it would not have had. ``update_from_output`` ran for no
part of the failed step, so each row is scheduled exactly as before: its KV goes to the same
slots with the same values (the kernels are batch-invariant: a row's KV and logits do not
depend on what else is in its batch), a grammar matcher catches up from the sequence's own
tokens (none was appended), penalties are read from those tokens, and the sampler gives back
every draw a call that raised took from its generators (``Sampler.__call__``), so a seeded
request still draws once per token.

Bounded: each split halves a group, so a step of B rows runs at most 2B - 2 more times (one
row: once more), even when every run raises. When no part of the step runs at all (a broken
engine, or a lone row that raised twice), the fault is pinned on no row: ``Unattributed``,
which the engine turns into ``StepFailed``, and the router reads as not the request's fault.
"""

from __future__ import annotations

import logging
from typing import Callable, Collection

from pdserve.engine.errors import SequenceFailed, StepFailed
from pdserve.engine.core.scheduler import SampledTokens, ScheduledSeq, SchedulerOutput

FIELD = "step"  # what a SequenceFailed of a row that raised alone names

log = logging.getLogger(__name__)


class Unattributed(Exception):
    """No part of the step ran: nothing says which row, if any, the fault belongs to.
    ``cause``: the last error a part raised."""

    def __init__(self, cause: Exception):
        self.cause = cause
        super().__init__(f"every part of the step raised ({type(cause).__name__}: {cause})")


def isolate(run: Callable[[SchedulerOutput], SampledTokens], out: SchedulerOutput) -> SampledTokens:
    """Run ``out``'s rows again in parts (``run`` is the model runner's), after the whole of it
    raised. Returns what the parts that ran produced, merged, with each row that raised alone
    in ``failed``. Raises ``Unattributed`` if no part ran."""
    parts: list[SampledTokens] = []
    alone: dict[str, Exception] = {}
    groups = _halves(out.seqs)[::-1] if len(out.seqs) > 1 else [out.seqs]  # a stack: first half on top
    last: Exception | None = None
    while groups:
        group = groups.pop()
        try:
            parts.append(run(SchedulerOutput(group, out.is_prefill)))
        except Exception as exc:  # whatever it is, it is pinned below or re-raised as Unattributed
            last = exc
            if len(group) > 1:
                groups.extend(_halves(group)[::-1])
            else:
                alone[group[0].seq.seq_id] = exc
    if not parts:
        raise Unattributed(last)
    failed = {rid: SequenceFailed(rid, FIELD, f"the engine step raised {type(exc).__name__}: {exc} with this "
                                  "request alone in it, while the rest of its batch ran")
              for rid, exc in alone.items()}
    return merge(parts, failed)


def isolate_or_abort(run: Callable[[SchedulerOutput], SampledTokens], out: SchedulerOutput, exc: Exception,
                     known: Collection[str], abort: Callable[[str], object]) -> SampledTokens:
    """The engine's answer to a step ``out`` that raised ``exc``: what its parts that run give
    (``isolate``); if none runs, every row still ``known`` is ``abort``ed and ``StepFailed`` names them."""
    log.warning("engine step of %d sequence(s) raised (%s: %s); running it again in parts to find whose "
                "fault it is", len(out.seqs), type(exc).__name__, exc)
    try:
        return isolate(run, out)
    except Unattributed as unattributed:
        failed = [item.seq.seq_id for item in out.seqs if item.seq.seq_id in known]
        for request_id in failed:
            abort(request_id)
        raise StepFailed(failed, unattributed.cause) from exc


def _halves(group: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
    middle = len(group) // 2
    return [group[:middle], group[middle:]]


def merge(parts: list[SampledTokens], failed: dict[str, SequenceFailed]) -> SampledTokens:
    """One step's ``SampledTokens`` from its parts' (rows are disjoint), plus ``failed``."""
    merged = SampledTokens({}, {}, {}, {}, dict(failed))
    for part in parts:
        merged.token_ids.update(part.token_ids)
        merged.logprobs.update(part.logprobs)
        merged.top_logprobs.update(part.top_logprobs)
        merged.prompt_logprobs.update(part.prompt_logprobs)
        merged.failed.update(part.failed)
        merged.accepted.update(part.accepted)
    return merged

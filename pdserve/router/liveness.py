"""Is a worker alive? The rule, pure: no I/O, no clock of its own.

A worker that answers ``Stats`` may still be hung: its gRPC loop runs on a thread apart from
the engine, so a wedged forward pass (or a process stopped between two answers) looks
reachable. What tells is the engine's progress count (``engine_steps``: its steps and the
decoder layers computed inside them, pdserve/engine/progress.py): while the engine holds
runnable work it must move. A worker counts as having made progress when an answer shows its
count moved, or shows it idle (nothing to run, so nothing to move). A worker that does not
answer at all (dead, or SIGSTOPped) makes no progress either. A worker without progress for
``hang_timeout_s`` is hung: the router stops routing to it and its requests migrate, the
supervisor replaces it.

The timeout must exceed the longest single decoder layer (a thirtieth of a step or less), not
the longest step: with steps alone, a 2,048-token prefill step of long prompts on an AVX2-only
core outlasted the router's 10 s bound for a prefill call and read as a hang.

A worker whose KV reads hang is hung too, though its engine steps: a read stopped in flight
keeps its blocks quarantined until the transport says it is over (pdserve/shell/read_quarantine.py),
and one that never ends keeps them for good. A worker with more than ``QUARANTINE_BOUND`` of its
blocks quarantined for ``hang_timeout_s`` (a healthy transport ends a stopped read within
milliseconds) is hung, and replaced like one whose engine stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

QUARANTINE_BOUND = 0.25  # of a worker's KV blocks: more, quarantined for hang_timeout_s, is a hang


@dataclass(frozen=True)
class Liveness:
    """What the answers so far showed about one worker."""

    steps: int  # the engine's step count in the last answer
    progressed_at: float  # when it last made progress (or was first seen), on the caller's clock
    quarantined_since: float | None = None  # since when its quarantined blocks are past the bound


def observe(prev: Liveness | None, now: float, answered: bool, steps: int = 0, busy: bool = False,
            quarantined: int = 0, blocks: int = 0) -> Liveness:
    """Fold one ``Stats`` poll into ``prev``: ``answered`` False for a poll that failed, else
    the answer's ``engine_steps``, ``engine_busy``, ``kv_quarantined_blocks`` and
    ``num_blocks_total``. A first sighting counts as progress (the worker was added because it
    serves)."""
    if prev is None:
        prev = Liveness(steps if answered else 0, now)
    if not answered:
        return prev
    over = quarantined > QUARANTINE_BOUND * blocks
    since = (prev.quarantined_since if prev.quarantined_since is not None else now) if over else None
    if steps != prev.steps or not busy:  # a restarted worker's count starts over: also a change
        return Liveness(steps, now, since)
    return Liveness(prev.steps, prev.progressed_at, since)


def is_hung(liveness: Liveness, now: float, hang_timeout_s: float) -> bool:
    """No progress, or blocks quarantined past the bound, for longer than ``hang_timeout_s``."""
    since = liveness.quarantined_since
    return now - liveness.progressed_at > hang_timeout_s or (since is not None and now - since > hang_timeout_s)

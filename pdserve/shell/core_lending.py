"""A decode worker lends its core to a prefill in progress, within a step budget.

On a host where each worker is pinned to its own core, the prefill worker's kernels also run
on the decode worker's core while that core is idle (``borrow_idle_cores``: idle-priority
helpers). A decode worker with streams running is never idle, though: its steps run back to
back, so a prompt that arrives while anything decodes is prefilled on one core, about 1.9x
slower than with both (256 tokens, ``benchmarks/borrow_prefill.py``). Its time to first token
then depends on whether someone else was decoding.

The two workers meet in shared memory instead, one 8-byte slot per core:
- the prefill worker, before each step it runs, writes into the slots of the cores it borrows
  a moment (``time.monotonic``, one clock for the whole host) until which it will be
  prefilling, twice its last step's length ahead, and 0 once it has nothing to run. A
  borrower that dies stops counting when its moment passes;
- the decode worker, pinned to those cores, reads its slots before each step. While a
  borrower is prefilling it starts a step at most every ``lend_tpot_s`` (an engine hold, so
  calls and KV arrivals are still served meanwhile), and the idle-priority helper runs in the
  gaps. Its streams' time per output token is then ``lend_tpot_s`` (or the step itself, if
  longer) for as long as the prefill lasts, and unchanged otherwise.

``lend_tpot_s`` is the trade: a decode step of 13 ms paced to 40 ms lends two thirds of its
core. A decode worker whose steps take half the period or more lends nothing: under load,
pacing grew its batches and its steps with them (measured at 3.25 req/s: TPOT p50 79 ms paced,
50 ms not). Keep it well under the TPOT objective; 0 lends nothing beyond idle time.

Where steps are slow the period follows them. It is at least ``PERIOD_IN_STEPS`` (6) of the
worker's own fastest one-sequence decode step, and "loaded" starts at ``LOADED_STEPS`` (1.5) of
that step where that is later than half the period. A fixed 40 ms fits a processor whose steps
take 13 ms (loaded at 20 ms, 1.5 of them). Where they take 17-23 ms (the AVX2-only EPYC) every
step was over half of it, so the rule above lent nothing there at any load, and a prompt that met
a stream was prefilled on one core, beside it, in 1.0-1.3 s instead of 0.7. The period is about
100 ms there: at three steps (50 ms) the streams' own steps, 1.5x slower beside the prefill, left
it little.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from pdserve.engine.core.step_trace import StepShape

_SLOT = struct.Struct("d")
# A lender's period is at least this many of its fastest one-sequence decode steps, and it is
# loaded (lends nothing) from a step of LOADED_STEPS of them where that is later than half its
# period (module docstring).
PERIOD_IN_STEPS = 6.0
LOADED_STEPS = 1.5
# A prefill step's mark reaches this far past its start at the least (the first step has no
# last length to go by; a mark that ends early only stops the pacing early).
MIN_MARK_S = 0.1


def lend_dir() -> Path:
    """Where the slots live: ``$PDSERVE_LEND_DIR``, else ``/dev/shm/pdserve-lend`` (the system's
    temporary directory where there is no ``/dev/shm``). Every worker on a host must agree."""
    if os.environ.get("PDSERVE_LEND_DIR"):
        return Path(os.environ["PDSERVE_LEND_DIR"])
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "pdserve-lend"


class CoreSlots:
    """The slots of ``cpus``: each holds the moment until which a borrower of that core says it
    prefills (0: none)."""

    def __init__(self, cpus: Iterable[int], directory: Path | None = None):
        directory = directory or lend_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self._maps: list[mmap.mmap] = []
        for cpu in sorted(set(cpus)):
            fd = os.open(directory / f"cpu{cpu}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < _SLOT.size:
                    os.ftruncate(fd, _SLOT.size)
                self._maps.append(mmap.mmap(fd, _SLOT.size))
            finally:
                os.close(fd)

    def mark(self, until: float) -> None:
        for slot in self._maps:
            _SLOT.pack_into(slot, 0, until)

    def latest(self) -> float:
        return max((_SLOT.unpack_from(slot, 0)[0] for slot in self._maps), default=0.0)

    def close(self) -> None:
        for slot in self._maps:
            slot.close()
        self._maps = []


class BorrowerMark:
    """An engine hook of a worker that prefills: marks its borrowed cores' slots before each step
    it will run while ``has_work``, clears them when it has none. A mark reaches twice the last
    step's length ahead; with ``last_step_shape``, twice the last step that ran prompt tokens
    (a colocated worker's decode steps between its prompts say nothing of a prompt's length)."""

    def __init__(self, slots: CoreSlots, has_work: Callable[[], bool], last_step_s: Callable[[], float],
                 last_step_shape: Callable[[], StepShape | None] | None = None):
        self.slots = slots
        self._has_work = has_work
        self._last_step_s = last_step_s
        self._last_step_shape = last_step_shape
        self._prefill_step_s = 0.0  # the last step that ran prompt tokens (with ``last_step_shape``)
        self._marked = False

    def __call__(self) -> None:
        ahead = self._last_step_s()
        if self._last_step_shape is not None:
            shape = self._last_step_shape()
            if shape is not None and shape.prefill:
                self._prefill_step_s = ahead
            ahead = self._prefill_step_s
        if self._has_work():
            self.slots.mark(time.monotonic() + max(2.0 * ahead, MIN_MARK_S))
            self._marked = True
        elif self._marked:
            self.slots.mark(0.0)
            self._marked = False
        return None  # nothing to poll: it runs before every step anyway


class LenderPace:
    """An engine hold of a decode worker: while a borrower's mark on its cores is live, the next
    step waits until ``period`` after the last one started; unless the last step took
    ``loaded_s`` or more (half the period, or 1.5 one-sequence steps where that is later: a
    loaded decode worker lends nothing: pacing it would grow its batch and its steps with it,
    and its streams would wait the longer). With ``last_step_shape`` (what the last step ran), a
    step counts as long as the fastest decode step of its batch size seen so far, not as it ran:
    a step beside the borrower's prefill runs 1.5x slower (cache and memory shared; 23 against
    34 ms on the AVX2-only EPYC), which alone would stop the lending it depends on. ``period``
    is ``period_s``, or ``PERIOD_IN_STEPS`` of the fastest one-sequence decode step where that
    is longer. A worker with prompts of its own to prefill (``own_prompts``: a colocated
    worker's) lends nothing meanwhile: they are its first tokens."""

    def __init__(self, slots: CoreSlots, period_s: float, last_step_started: Callable[[], float],
                 last_step_s: Callable[[], float] = lambda: 0.0,
                 last_step_shape: Callable[[], StepShape | None] = lambda: None,
                 own_prompts: Callable[[], bool] = lambda: False):
        self.slots = slots
        self._own_prompts = own_prompts
        self.period_s = period_s
        self._last_step_started = last_step_started
        self._last_step_s = last_step_s
        self._last_step_shape = last_step_shape
        self.fastest_s: dict[int, float] = {}  # the fastest decode-only step seen, by its batch size
        self.paced_steps = 0  # steps that waited for a borrower (tests and stats read it)
        self._pacing_since: float | None = None

    @property
    def fastest_step_s(self) -> float:
        """The fastest one-sequence decode step seen (inf: none yet)."""
        return self.fastest_s.get(1, math.inf)

    @property
    def period(self) -> float:
        fastest = self.fastest_step_s
        return max(self.period_s, PERIOD_IN_STEPS * fastest) if fastest < math.inf else self.period_s

    @property
    def loaded_s(self) -> float:
        """A step this long or longer: the worker is loaded and lends nothing."""
        fastest = self.fastest_step_s
        return max(self.period_s / 2, LOADED_STEPS * fastest) if fastest < math.inf else self.period_s / 2

    def __call__(self) -> float | None:
        step_s, shape = self._last_step_s(), self._last_step_shape()
        cost = step_s
        if shape is not None and shape.decode_batch:
            if not shape.prefill and step_s > 0:
                self.fastest_s[shape.decode_batch] = min(self.fastest_s.get(shape.decode_batch, math.inf), step_s)
            cost = min(step_s, self.fastest_s.get(shape.decode_batch, step_s))
        period = self.period
        if self.slots.latest() <= time.monotonic() or cost >= self.loaded_s or self._own_prompts():
            self._pacing_since = None
            return None
        until = self._last_step_started() + period
        if until > time.monotonic() and self._pacing_since != until:
            self._pacing_since = until
            self.paced_steps += 1
        return until

"""How late the router's event loop runs what it scheduled (``pdserve:router_loop_lag_seconds``).

The router serves everything on one asyncio loop: both public APIs, ``/health``, the Stats
polls that keep its workers' leases alive. Work that holds the loop (a large body parsed on
it, a detokenizer re-decoding a growing window, a schema converted on it) delays all of them
alike, so one number shows it: a probe task asks to wake every ``PROBE_INTERVAL_S`` and
records how much later than asked it woke. An idle loop is late by well under a millisecond;
a loop held for 10 s makes the prefill workers free that router's KV as OWNER_LOST.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from pdserve.wire import metrics

PROBE_INTERVAL_S = 0.1  # often enough to see a 50 ms stall; costs ~10 callbacks a second


async def probe(interval_s: float = PROBE_INTERVAL_S,
                observe: Callable[[float], None] = metrics.LOOP_LAG.observe) -> None:
    """Run until cancelled: each ``interval_s``, observe how late this task woke (seconds)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due))

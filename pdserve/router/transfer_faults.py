"""Which end of a failing KV transfer the router stops routing to.

A decode worker reads a prompt's KV from the worker that holds it. When the read fails, either
end may have stalled, and the router cannot tell which: a holder that never sends and a reader
that never receives both time out at the reader. So each failure counts against both ends, and
each success clears both. An end whose last ``MAX_TRANSFER_FAILURES`` transfers all failed is
down for routing for ``TRANSFER_DOWN_S``, whatever its Stats answers say (a worker whose KV
nobody can read, or that reads nothing, answers them fine). The healthy end of a failing pair
is cleared by its transfers with other workers meanwhile. Two refinements:
- a failure whose source is down (this failure took it down, or it already was) is laid on
  the source alone: the reader's count stays;
- a reader goes down only while another decode-pool worker is routable. Without one the
  requests would have nowhere to go, where a source that goes down leaves its prompts to the
  decode workers to prefill.
A request also passes over both ends of its own failed transfers in its later attempts
(``pdserve.router.worker_calls.CallContext.avoid``).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from pdserve.router.policy import SERVES

log = logging.getLogger(__name__)

MAX_TRANSFER_FAILURES = 3  # KV transfers with one worker (either end) failed in a row before it is down
TRANSFER_DOWN_S = 10.0  # how long it stays down for routing then (it may have been restarted)


def failed(workers: Mapping, source: str | None, reader: str) -> None:
    """A KV read by ``reader`` from ``source`` (None: no remote KV) failed; ``workers``: the
    pool's clients by address (``pdserve.router.pool.WorkerClient``)."""
    for address, role in ((source, "prefill"), (reader, "decode")):
        client = workers.get(address) if address is not None else None
        if client is None:
            continue
        if role == "decode" and source is not None and _down(workers, source):
            continue  # explained by a source that is down
        client.transfer_failures += 1
        if client.transfer_failures < MAX_TRANSFER_FAILURES:
            continue
        if role == "decode" and not any(w.role in SERVES["decode"] and w.snapshot().routable
                                        for a, w in workers.items() if a != address):
            continue
        log.warning("%s worker %s: %d KV transfers with it failed in a row; down for %.0f s",
                    role, address, client.transfer_failures, TRANSFER_DOWN_S)
        client.transfer_failures = 0
        client.down_until = time.monotonic() + TRANSFER_DOWN_S


def succeeded(workers: Mapping, source: str | None, reader: str) -> None:
    """A KV read by ``reader`` from ``source`` arrived: both ends' counts start again."""
    for address in (source, reader):
        client = workers.get(address) if address is not None else None
        if client is not None:
            client.transfer_failures = 0


def _down(workers: Mapping, address: str) -> bool:
    client = workers.get(address)
    return client is not None and client.down_until > time.monotonic()

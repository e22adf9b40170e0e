"""A router's end in a rolling restart: another router already serves (or, behind a
Kubernetes Service, will serve) the same public address, and this one leaves without ending a
stream or refusing a request.

Where ``GenerationService.drain`` (the whole cluster stopping) refuses new requests at once,
a hand-over never refuses one:

1. Readiness goes false (gRPC health and ``/health`` NOT_SERVING), and for ``unready_s`` the
   router goes on serving every request that still reaches it: a load balancer, or a Service's
   endpoints, take a moment to see the change (what a preStop sleep covers on Kubernetes).
2. It stops listening, and tells every client connection to go: gRPC sends HTTP/2 GOAWAY, so a
   client's next call opens a new connection, which reaches the other router; an HTTP/1.1
   connection is closed once its current answer is sent (idle ones at once).
3. The streams it runs finish, up to ``grace_s``; what runs past it is cut.

The caller then stops the router's servers (``RunningServer.stop``).
"""

from __future__ import annotations

import asyncio

from pdserve.router.service import SERVICE
from pdserve.wire.server import RunningServer, set_serving

_IDLE_CHECK_S = 0.05  # how soon after its last stream the router notices it is idle


async def hand_over(running: RunningServer, unready_s: float, grace_s: float) -> int:
    """Steps 1 to 3 above on the router ``running`` (``pdserve.router.server.start``'s).
    Returns how many requests were still running when the grace ended (0: none was cut)."""
    service = running.service
    service.unready = True
    await set_serving(running.health, [SERVICE], False)
    await asyncio.sleep(unready_s)
    http = getattr(running, "http_runner", None)
    if http is not None:
        for site in list(http.sites):
            await site.stop()  # the listening socket only; open connections stay
        if http.server is not None:
            http.server.pre_shutdown()  # each connection closes after its answer in progress
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    # The public gRPC server's stop closes its listener, sends GOAWAY, and waits for the calls
    # in flight up to the grace (then cancels them). HTTP streams are waited for here.
    await asyncio.gather(running.server.stop(grace_s), _idle(service, deadline))
    return len(service.running) + service.waiting


async def _idle(service, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while (service.running or service.waiting) and loop.time() < deadline:
        await asyncio.sleep(_IDLE_CHECK_S)

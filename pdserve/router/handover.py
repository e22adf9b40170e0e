"""A router's end in a rolling restart: another router already serves (or, behind a
Kubernetes Service, will serve) the same public address, and this one leaves without ending a
stream or refusing a request.

Where ``GenerationService.drain`` (the whole cluster stopping) refuses new requests at once,
a hand-over never refuses one:

1. Readiness goes false (gRPC health and ``/health`` NOT_SERVING), and for ``unready_s`` the
   router goes on serving every request that still reaches it: a load balancer, or a Service's
   endpoints, take a moment to see the change (what a preStop sleep covers on Kubernetes).
2. It stops listening for HTTP and closes each HTTP/1.1 connection once its current answer is
   sent (idle ones at once). With a connection age (``RouterConfig.connection_age_s``) it
   serves gRPC for that age again: each client connection is sent GOAWAY while the server
   still takes every call, and the client's next call opens a new connection, which the
   Service sends to another router.
3. It stops the gRPC server, which sends GOAWAY to any connection left, and the streams it
   runs finish, up to ``grace_s``; what runs past it is cut.

Why step 2 waits: gRPC's stop refuses every call that has not reached a handler yet, and a
call the client sent just before it saw the stop's GOAWAY ends CANCELLED (grpcio's server
does not tell it to retry). A client whose connection has aged out
before the stop sends nothing into it. Behind ``SO_REUSEPORT`` (``pdserve rollout`` on
Ray: both routers listen on one port), a connection opened during the wait may still land
here, so there the wait would not close the race and is not taken.

The caller then stops the router's servers (``RunningServer.stop``).
"""

from __future__ import annotations

import asyncio

from pdserve.router.service import SERVICE
from pdserve.wire.grpc_util import CONNECTION_AGE_JITTER
from pdserve.wire.server import RunningServer, set_serving

_IDLE_CHECK_S = 0.05  # how soon after its last stream the router notices it is idle
# An aged connection's GOAWAY is two frames a ping apart (the client's calls in flight across
# the first are still served); this covers the ping's round trip on a loaded machine.
_GOAWAY_RTT_S = 0.5


async def hand_over(running: RunningServer, unready_s: float, grace_s: float,
                    connection_age_s: float | None = None) -> int:
    """Steps 1 to 3 above on the router ``running`` (``pdserve.router.server.start``'s), its
    public gRPC server started with ``connection_age_s`` (None: no wait in step 2). Returns
    how many requests were still running when the grace ended (0: none was cut)."""
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
    if connection_age_s:  # every connection now open gets its GOAWAY by then, the server serving
        await asyncio.sleep(min(connection_age_s * (1 + CONNECTION_AGE_JITTER) + _GOAWAY_RTT_S, grace_s))
    grace_s = max(0.0, deadline - loop.time())
    # The public gRPC server's stop closes its listener, sends GOAWAY, and waits for the calls
    # in flight up to the grace (then cancels them). HTTP streams are waited for here.
    await asyncio.gather(running.server.stop(grace_s), _idle(service, deadline))
    return len(service.running) + service.waiting


async def _idle(service, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while (service.running or service.waiting) and loop.time() < deadline:
        await asyncio.sleep(_IDLE_CHECK_S)

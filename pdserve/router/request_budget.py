"""A request's time: one deadline (``timeout_s``, the client's or ``request_timeout_s``) that
bounds every RPC it makes, and one admission budget (``admission_wait_s``) shared by every
wait for room before its first token. A prefill call is bounded tighter still, by what its
prompt should take (``prefill_call_timeout_s``): a worker that holds its socket open and never
answers (SIGSTOPped, wedged) costs the request that bound, not its deadline.
RESOURCE_EXHAUSTED (HTTP 429) is only ever answered before the first token: later, a request
that cannot go on ends UNAVAILABLE or DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from pdserve.router.errors import RouteError
from pdserve.router.policy import Choice


class RequestBudget:
    """The deadline and the admission budget of one request. ``arrived`` is
    ``time.monotonic()`` when it reached the router; ``sent()`` how many tokens the client
    has (after the first, waits count against the deadline alone)."""

    def __init__(self, arrived: float, timeout_s: float, admission_wait_s: float, sent: Callable[[], int]):
        self.arrived = arrived
        self.timeout_s = timeout_s
        self.admission_wait_s = admission_wait_s
        self.sent = sent
        self.waited_s = 0.0  # time spent waiting in the router for room in a full pool
        # An attempt was lost to a worker fault: the request was admitted, and waits for a
        # replacement of a pool that fault emptied until its deadline, not its admission budget.
        self.faulted = False

    @property
    def deadline(self) -> float:
        return self.arrived + self.timeout_s

    def remaining_s(self) -> float:
        """Seconds until the request's deadline; raises DEADLINE_EXCEEDED once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"the request's deadline of {self.timeout_s:g} s passed (after {self.sent()} tokens)")
        return left

    async def admit(self, pick: Callable[[], Choice], poll_s: float, wait_empty: bool = True) -> Choice:
        """``pick()``, tried again every ``poll_s`` while its pool is saturated or has no
        routable worker at all (a replacement is on its way: with one decode worker, a crash
        would otherwise fail every stream in flight): before the first token until the
        admission budget is spent, after it until the deadline; for an empty pool after a
        fault (``faulted``) until the deadline too. ``wait_empty`` False: an empty pool is
        answered at once (the prefill pool's work has somewhere else to go)."""
        start = time.monotonic()
        admission = self.deadline if self.sent() else min(self.deadline, self.arrived + self.admission_wait_s)
        try:
            while True:
                choice = pick()
                if choice.worker_id is not None or not (choice.saturated or (choice.pool_empty and wait_empty)):
                    return choice
                deadline = self.deadline if choice.pool_empty and self.faulted else admission
                if time.monotonic() >= deadline:
                    self.remaining_s()  # DEADLINE_EXCEEDED if it was the request's own deadline
                    return choice
                await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
        finally:
            self.waited_s += time.monotonic() - start


def prefill_call_timeout_s(remaining_s: float, prompt_tokens: int, queued_tokens: int, token_s: float | None,
                           min_s: float, slack: float, token_s_guess: float) -> float:
    """How long one prefill call may take before its worker counts as not answering: ``slack``
    times the time the ``queued_tokens`` ahead of it and its own ``prompt_tokens`` should take
    at ``token_s`` seconds a token (the prefill pool's pace as seen; None: ``token_s_guess``),
    at least ``min_s``, and never past the request's deadline (``remaining_s``)."""
    pace = token_s if token_s is not None and token_s > 0 else token_s_guess
    expected = (max(queued_tokens, 0) + max(prompt_tokens, 0)) * pace
    return min(remaining_s, max(min_s, slack * expected))

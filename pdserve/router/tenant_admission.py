"""Per-tenant admission: each tenant's own limits (``pdserve.router.tenants.TenantLimits``),
checked before any work for a request, so that one tenant's flood is refused as that
tenant's excess, and the router's shared limits (``max_waiting_requests``, the tokenizer
queue, the pools) stay for everyone else.

A request is counted from its admission: *running* until it ends, *waiting* until its first
response. Its tokens count towards ``tokens_per_minute`` as they are used: the prompt once it
is tokenized, output as it is sent. A request is admitted while the tenant's last 60 s are
below the limit, so one request may take it past (its size is known only after tokenizing);
the next waits for the window to slide, and its 429 says when.

Plain state, no I/O: the service calls ``admit`` and the ``Ticket``'s methods around a request.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from pdserve.router.errors import RouteError
from pdserve.router.tenants import Tenant

WINDOW_S = 60.0  # tokens_per_minute's window


class TenantLimitError(RouteError):
    """A tenant's own limit refused its request: RESOURCE_EXHAUSTED / HTTP 429, naming the
    limit; ``retry_after_s`` is when to try again."""

    def __init__(self, tenant: str, limit: str, value: int, message: str, retry_after_s: int):
        self.tenant, self.limit, self.value, self.retry_after_s = tenant, limit, value, retry_after_s
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"tenant {tenant!r}: {message}; its limit is {limit}={value} (api_keys_file)")


@dataclass
class _Usage:
    running: int = 0
    waiting: int = 0
    tokens: collections.deque = field(default_factory=collections.deque)  # (monotonic time, tokens)
    token_sum: int = 0


class TenantAdmission:
    """Every tenant's counters. ``clock``: seconds, monotonic (a test passes its own)."""

    def __init__(self, retry_after_s: int = 1, clock: Callable[[], float] = time.monotonic):
        self._usage: dict[str, _Usage] = {}
        self._retry_after_s = retry_after_s
        self._clock = clock

    def admit(self, tenant: Tenant | None) -> "Ticket":
        """A ticket for one request of ``tenant`` (None: no tenant, nothing counted), or
        ``TenantLimitError`` naming the first of its limits it is at."""
        if tenant is None:
            return Ticket(None, None)
        usage = self._usage.setdefault(tenant.name, _Usage())
        limits = tenant.limits
        if limits.max_concurrent_requests is not None and usage.running >= limits.max_concurrent_requests:
            raise TenantLimitError(tenant.name, "max_concurrent_requests", limits.max_concurrent_requests,
                                   f"{usage.running} requests are running", self._retry_after_s)
        if limits.max_waiting_requests is not None and usage.waiting >= limits.max_waiting_requests:
            raise TenantLimitError(tenant.name, "max_waiting_requests", limits.max_waiting_requests,
                                   f"{usage.waiting} requests are waiting for their first token", self._retry_after_s)
        if limits.tokens_per_minute is not None:
            used = self._tokens(usage)
            if used >= limits.tokens_per_minute:
                raise TenantLimitError(tenant.name, "tokens_per_minute", limits.tokens_per_minute,
                                       f"{used} tokens were used in the last {WINDOW_S:g} s",
                                       self._until_below(usage, limits.tokens_per_minute))
        usage.running += 1
        usage.waiting += 1
        return Ticket(self, usage)

    def usage(self, name: str) -> tuple[int, int, int]:
        """(running, waiting, tokens in the window) of tenant ``name``, for tests and metrics."""
        usage = self._usage.get(name, _Usage())
        return usage.running, usage.waiting, self._tokens(usage)

    def _tokens(self, usage: _Usage) -> int:
        """Tokens in the window, dropping what slid out of it."""
        horizon = self._clock() - WINDOW_S
        while usage.tokens and usage.tokens[0][0] <= horizon:
            usage.token_sum -= usage.tokens.popleft()[1]
        return usage.token_sum

    def _until_below(self, usage: _Usage, limit: int) -> int:
        """Whole seconds until enough of the window slides out to bring it below ``limit``."""
        left, now = usage.token_sum, self._clock()
        for at, n in usage.tokens:
            left -= n
            if left < limit:
                return max(1, math.ceil(at + WINDOW_S - now))
        return self._retry_after_s

    def _charge(self, usage: _Usage, tokens: int) -> None:
        if tokens > 0:
            usage.tokens.append((self._clock(), tokens))
            usage.token_sum += tokens


@dataclass
class Ticket:
    """One admitted request's place in its tenant's counters; ``done`` once, when it ends."""

    _owner: TenantAdmission | None
    _usage: _Usage | None
    _waiting: bool = True

    def used(self, tokens: int) -> None:
        """``tokens`` more of the tenant's tokens_per_minute (prompt or output)."""
        if self._owner is not None:
            self._owner._charge(self._usage, tokens)

    def started(self) -> None:
        """The request's first response went out: it no longer waits."""
        if self._usage is not None and self._waiting:
            self._waiting = False
            self._usage.waiting -= 1

    def done(self) -> None:
        self.started()
        if self._usage is not None:
            self._usage.running -= 1
            self._usage = self._owner = None

"""A prompt whose KV streams out while it computes (``PrefillStream``): what the worker's
``prefill_stream`` yields before its ``PrefillResult`` (``KVEarly``, then ``KVReady`` per
chunk), the error that ends it early (``KVLeaseEnded``), and the ``KVWatch`` that ``WatchKV``
callers wait on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.kv_transfer.handoff import Lease


@dataclass(frozen=True)
class KVEarly:
    """A streamed prompt has its blocks and its first chunk is computed: the lease on them,
    and the checksums of the blocks final so far."""

    lease: Lease
    ready_tokens: int
    checksums: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVReady:
    """Another chunk of a streamed prompt is computed; the checksums of every block final so far."""

    ready_tokens: int
    checksums: tuple[int, ...] = ()


class KVLeaseEnded(Exception):
    """A streamed prompt's lease ended before the prompt was done (the decode side gave up,
    its router died, or it expired): the prompt was stopped."""


class KVWatch:
    """A streamed lease's progress, on the event loop, for ``WatchKV`` callers: how many
    prompt tokens are computed and the checksums of the blocks final so far, then the first
    token (done), or why it failed."""

    def __init__(self, ready_tokens: int, checksums: tuple[int, ...] = ()):
        self.ready_tokens = ready_tokens
        self.checksums = checksums
        self.first_token: int | None = None
        self.failed: str | None = None
        self.changed = asyncio.Event()  # replaced at each update: wait on the one you read

    def update(self, ready_tokens: int | None = None, first_token: int | None = None,
               failed: str | None = None, checksums: tuple[int, ...] | None = None) -> None:
        if self.first_token is not None or self.failed is not None:
            return  # ended: later news (the lease's release after a good end) changes nothing
        if ready_tokens is not None:
            self.ready_tokens = ready_tokens
        if checksums is not None:
            self.checksums = checksums
        self.first_token = first_token
        self.failed = failed
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

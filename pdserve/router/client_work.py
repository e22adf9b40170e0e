"""Client work off the router's event loop: parsing bodies, tokenizing, detokenizing.

The router's one event loop also serves gRPC, the internal admin plane and its Stats polls of
the workers (2 s timeouts). A client's megabytes of JSON, or of token ids, walked on that loop
stall them all (20 bodies of 3.8 MB once held ``/health`` for 8.6 s). So such work runs on a
small thread pool, and the pool's queue is bounded: a request that would queue past
``max_queued`` jobs is refused at once with RESOURCE_EXHAUSTED / 429 and Retry-After, before
any of its work is queued. A job of a request already admitted (a running stream's next
chunk) is never refused, so a client that has tokens is not told to retry.

One thread by default: a HF fast tokenizer shared by threads can fail with "Already borrowed".
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import grpc

from pdserve.router.errors import RouteError

T = TypeVar("T")
INLINE_BYTES = 16 << 10  # client data up to this size is cheap enough to handle on the loop


class ClientWork:
    """A bounded queue of client work in front of ``threads`` threads."""

    def __init__(self, threads: int, max_queued: int):
        self.max_queued = max_queued
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pdserve-tokenize")
        self._lock = threading.Lock()  # the count changes on the loop and on the pool's threads
        self._queued = 0  # jobs submitted and not yet finished (running ones included)

    @property
    def queued(self) -> int:
        return self._queued

    async def run(self, fn: Callable[..., T], *args, admitted: bool = False) -> T:
        """``fn(*args)`` on the pool. Unless ``admitted``, refused with RESOURCE_EXHAUSTED
        when ``max_queued`` jobs are already queued or running. A caller that is cancelled
        stops waiting; its job still counts until it has run."""
        with self._lock:
            if not admitted and self._queued >= self.max_queued:
                raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{self._queued} tokenizer jobs are queued; the limit is "
                                 f"max_tokenizer_queue={self.max_queued}")
            self._queued += 1
        future = self._pool.submit(self._counted, fn, *args)
        return await asyncio.wrap_future(future)

    def _counted(self, fn: Callable[..., T], *args) -> T:
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._queued -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

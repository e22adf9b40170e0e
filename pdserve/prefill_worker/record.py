"""What a prefill worker knows about one request, in one record (``RequestRecord``), and what
it answers for it (``PrefillResult``).

The worker keeps one record per request in ``PrefillWorker.records``, from the ``Prefill``
call that brings it until ``PrefillWorker.forget`` removes it, which every exit calls: the
decode side pulled the KV, the lease was released or expired or its router died, the caller
gave up, the prompt failed, or it finished at its first token. While the record exists the
request may hold KV blocks; once it is gone it holds none.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling.params import TopLogprobs
from pdserve.kv_transfer.handoff import Lease
from pdserve.prefill_worker.kv_stream import KVWatch


@dataclass(eq=False)
class RequestRecord:
    """One request on this worker. The gRPC loop creates it and writes ``watch`` and
    ``caller_gone``; the engine thread writes the rest (each field has one writer)."""

    request_id: str
    owner: str  # the router incarnation that asked: leases granted for it are freed if it dies
    arrived_at: float  # time.monotonic() when Prefill queued it
    # Its prompt's block hashes while it is queued, so that Stats leaves out the tokens the
    # prefix cache holds; None when not looked up (prompt logprobs run every position).
    prompt_hashes: list[bytes] | None
    stream_kv: bool  # PrefillStream: its lease comes once its first chunk has run
    computing: bool = True  # until its first token is sampled
    first_chunk_at: float | None = None  # when the first of its several chunks ran
    lease: Lease | None = None  # the lease on its KV, once granted; it ends before the record goes
    announced_tokens: int = 0  # streamed: prompt tokens whose KV has been announced
    watch: KVWatch | None = None  # streamed: its progress, for WatchKV callers (loop only)
    caller_gone: bool = False  # its Prefill call ended without taking a lease: forget follows
    # While tracing: each chunk that has run, (start, end, prompt tokens computed by then), in
    # time.monotonic() seconds, for the chunk spans (pdserve.wire.tracing). None: not kept.
    chunks: list[tuple[float, float, int]] | None = None

    @property
    def streaming(self) -> bool:
        """A streamed prompt still computing: its chunks are announced as they finish."""
        return self.stream_kv and self.computing


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: float
    finish_reason: str | None  # None: generation continues on a decode worker
    num_prompt_tokens: int
    lease: Lease | None  # on the prompt's KV (its blocks are the lease's); None: nothing to read
    num_cached_tokens: int
    seconds: float  # queue + compute
    queue_seconds: float  # of ``seconds``: before the prompt's first chunk ran
    first_top_logprobs: TopLogprobs = ()
    prompt_logprobs: list[tuple[float, TopLogprobs]] | None = None  # with params.prompt_logprobs
    arrived_at: float = 0.0  # time.monotonic() when Prefill queued it
    chunks: tuple[tuple[float, float, int], ...] = ()  # while tracing: ``RequestRecord.chunks``, the last one too

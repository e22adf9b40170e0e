"""The router's own limits and settings: attempts, timeouts, admission, routing policy,
conditional disaggregation and streamed KV (``pdserve serve`` flags, serve config, env)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router.kv_policy import RoutingConfig
from pdserve.router.local_prefill import LocalPrefillConfig
from pdserve.router.validation import RequestLimits


@dataclass(frozen=True)
class RouterLimits:
    max_prefill_attempts: int = 3  # prefill workers tried for one prefill
    max_migrations: int = 3  # times one request may move to a new prefill/decode pair
    # A request's whole life, arrival to last token; a client may ask for less (gRPC deadline,
    # the OpenAI body's ``timeout``, HTTP X-Request-Timeout). Every RPC the router makes for it ends by then.
    request_timeout_s: float = 600.0
    # A prefill call waits at most ``prefill_call_slack`` times what its prompt and the queue
    # ahead of it should take at the prefill pool's pace (``PrefillPace``; before any answer,
    # ``prefill_token_s_guess`` a token), and never less than ``prefill_call_min_s``; past it, or
    # once its worker has shown no progress for ``prefill_call_min_s`` (router.liveness), the
    # worker counts as not answering (a SIGSTOPped one holds its sockets and never does) and the
    # prompt moves on: to another prefill worker, or to a decode worker that prefills it itself
    # (``pdserve.router.request_budget.prefill_call_timeout_s``). Like hang_timeout_s,
    # prefill_call_min_s must exceed the longest single decoder layer (progress is counted by
    # layer, router.liveness), or a slow layer is read as silence (the prompt is then prefilled
    # again on a decode worker: the same tokens, later).
    prefill_call_min_s: float = 10.0
    prefill_call_slack: float = 4.0
    prefill_token_s_guess: float = 0.01
    # A decode stream that sends nothing for this long is given up and the request migrates
    # (the first message waits for the KV transfer, bounded by the worker's transfer timeout).
    decode_idle_timeout_s: float = 60.0
    # Requests that have not had their first token yet (tokenizing, waiting for room, in
    # prefill). Past it, RESOURCE_EXHAUSTED / 429 at once, with Retry-After.
    max_waiting_requests: int = 256
    retry_after_s: int = 1  # the Retry-After a 429 / RESOURCE_EXHAUSTED carries
    tokenizer_threads: int = 1  # threads that tokenize and apply chat templates, off the event loop
    # Client work (parsing large bodies, tokenizing, detokenizing) queued or running on those
    # threads; past it a new request is RESOURCE_EXHAUSTED / 429 (router.client_work).
    max_tokenizer_queue: int = 64
    # Slow HTTP clients (aiohttp has no limits of its own): a request's headers must arrive
    # within header_timeout_s of its connection (or of the previous answer), its body within
    # body_timeout_s, and a stream the client stops reading ends after stream_idle_timeout_s.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 60.0
    requests: RequestLimits = field(default_factory=RequestLimits)
    # Beyond this many queued prompt tokens on every prefill worker, the pool is full (at
    # ~600 tok/s per CPU worker: ~100 s of work); new requests wait for room as below.
    max_queued_tokens_per_prefill: int = 65536
    # A request that finds every worker of a pool full (queue or KV) waits for room,
    # re-checking at each stats poll, before it gets RESOURCE_EXHAUSTED: a burst queues
    # briefly instead of failing, and a pool that stays full still answers, not hangs. One
    # budget per request, counted from its arrival, shared by every wait before its first token.
    admission_wait_s: float = 30.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # how a prefill worker is picked
    # Colocated mode, and conditional disaggregation's thresholds (pdserve/router/local_prefill.py).
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)
    # Prompts of at least this many tokens stream their KV: the decode worker is picked as soon
    # as the prompt has blocks and reads each chunk's blocks while later chunks compute
    # (PrefillStream, WatchKV). It pays when a prompt spans several chunks
    # (max_num_batched_tokens); the decode worker's blocks are taken for the whole prefill. 0: off.
    stream_kv_min_tokens: int = 0
    # Conversations keep their KV: decode workers publish their finished blocks and the router
    # routes each attempt by what the decode workers cache (router.local_prefill). Off: as
    # before the feature (a benchmark's "reuse off" arm, the tests' replay oracle).
    decode_kv_reuse: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_call_min_s", "prefill_call_slack", "prefill_token_s_guess", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)!r}")

"""Prometheus metrics: every pdserve metric family, the one registry, and how it is served.

Names follow vLLM's (``vllm:`` becomes ``pdserve:``); colons are legal in Prometheus names
and prometheus_client exports them unchanged. Every family lives in ``REGISTRY``, never in
prometheus_client's global default registry (other libraries in the process write there).
A process fills only its own families; ``render()`` serves the router's ``/metrics`` and
``pdserve.wire.worker_metrics.serve_worker`` starts a worker's.

Router, per request (pdserve/router/request_run.py), label ``model_name`` (the first served name):

- histogram ``pdserve:time_to_first_token_seconds``: request start to the first token sent
- histogram ``pdserve:inter_token_latency_seconds``: between two token batches sent
- histogram ``pdserve:e2e_request_latency_seconds``: request start to its finish (aborts included)
- histogram ``pdserve:request_queue_time_seconds``: waiting for room in a full pool, then on the
  prefill worker (first prefill)
- histogram ``pdserve:request_prefill_time_seconds``: prefill compute on the worker (first prefill)
- histogram ``pdserve:request_decode_time_seconds``: first token to finish
- histogram ``pdserve:kv_transfer_seconds``: one prompt's KV read by a decode worker
- counter ``pdserve:request_success_total{finished_reason}``: stop, length or abort
- counter ``pdserve:request_failures_total{code}``: gRPC status of requests that failed while
  routing (malformed requests rejected before routing are not counted)
- counter ``pdserve:prompt_tokens_total``, ``pdserve:generation_tokens_total``
- histogram ``pdserve:request_prompt_tokens``: one request's prompt tokens (first prefill)
- histogram ``pdserve:request_generation_tokens``: tokens one request was sent (at its finish)
- counter ``pdserve:request_retries_total``: prefill attempts a worker failed (unreachable or
  full); the router then tries another if one is left
- counter ``pdserve:request_migrations_total``: re-prefills after a lost decode (transfer or worker)
- counter ``pdserve:request_kv_moves_total``: streams a decode worker handed over with their KV
  that went on on another decode worker from that KV (no re-prefill)
- counter ``pdserve:routing_decisions_total{reason}``: prefill workers chosen, by the rule that
  chose (``pdserve.router.kv_policy.RULES``: cache, load, balance, round_robin, only)
- histogram ``pdserve:routing_prefix_overlap_tokens``: prompt tokens the chosen prefill worker
  caches as a prefix, per the router's KV index (what the worker then finds can be less: the
  index may be stale)
- counter ``pdserve:local_prefill_decisions_total{decision,reason}``: who prefilled each attempt,
  ``local`` (its decode worker) or ``remote`` (the prefill pool), and why (pdserve/router/local_prefill.py)
- histogram ``pdserve:local_prefill_uncached_tokens{decision}``, ``pdserve:local_prefill_decode_load{decision}``:
  the rule's inputs, the prompt's uncached tokens and the decode worker's KV share in use

Router, its event loop (pdserve/router/loop_lag.py):

- histogram ``pdserve:router_loop_lag_seconds``: how late the loop ran a callback scheduled
  every 0.1 s (no labels). Everything the router serves (gRPC, HTTP, ``/health``, its worker
  polls) waits at least this long; past 10 s the prefill workers free its KV as OWNER_LOST

Router, per role switch of an elastic worker (pdserve/elastic_worker), as the controller reports it
(``Membership.role_changes``):

- histogram ``pdserve:role_switch_seconds{to_role}``: the controller's decision to the router
  listing the worker in its new pool (its old role drained, its new one open)
- counter ``pdserve:role_changes_total{from_role,to_role,reason}``: ``reason`` is ``manual``
  (or what ``pdserve set-role --reason`` said) or the budget policy's ``prefill_pressure`` /
  ``decode_pressure`` (the pool that needed the worker)
- counters ``pdserve:role_switch_streams_handed_over_total{from_role}``,
  ``pdserve:role_switch_streams_kv_moved_total{from_role}`` and
  ``pdserve:role_switch_leases_left_total{from_role}``: the work a switch moved (streams the
  router migrated past the grace, those of them that moved with their KV, held KV left to its
  lease)
- gauge ``pdserve:role_budget_pressure{pool}``: the budget policy's pressure of each pool as the
  controller last pushed it (pdserve/cluster/autoscaling/budget.py)

Router, per stats poll (pdserve/router/pool.py), label ``pool`` (prefill, decode):

- gauge ``pdserve:num_requests_running``, ``pdserve:num_requests_waiting``: summed over the
  pool's healthy workers
- gauge ``pdserve:kv_cache_usage_perc``: the pool's used KV blocks over its total, 0..1
- gauge ``pdserve:pool_replicas``: healthy workers
- gauge ``pdserve:mixed_workers`` (no label): of the decode pool's, those in the mixed role
  (elastic roles: they prefill the streams they take)
- gauge ``pdserve:autoscaler_desired_replicas``: what the autoscaler wants
- gauge ``pdserve:autoscaler_signal_target``: the autoscaler's per-worker target of the pool's
  primary signal (prefill: ``worker_num_waiting_prompt_tokens``; decode:
  ``worker_kv_cache_usage_perc``); absent without autoscaling

Workers, read from the engine and the KV agent at each scrape; labels ``pool``, ``worker``,
``model_name`` (the first served name, as on the router's families):

- gauge ``pdserve:worker_num_requests_running``, ``pdserve:worker_num_requests_waiting``,
  ``pdserve:worker_num_waiting_prompt_tokens`` (the prefill autoscaling signal, for KEDA/HPA),
  ``pdserve:worker_kv_cache_usage_perc`` (0..1), ``pdserve:worker_num_held_leases``
- counter ``pdserve:kv_transfer_bytes_total``, ``pdserve:kv_transfers_total``,
  ``pdserve:kv_transfer_failures_total``: KV reads (a decode worker's; a prefill worker's of
  the prefixes it reads from decode workers, the reversed pull)
- counter ``pdserve:kv_verify_failures_total``: of the failed KV reads, those whose bytes
  landed but did not match the holder's checksums (the request re-prefilled elsewhere)
- counter ``pdserve:kv_unverified_refused_total``: KV a worker that verifies refused unread,
  for its holder sent no checksums (a pair that disagrees on ``verify_kv_transfers``): a decode
  worker's reads (the request is prefilled again, on a decode worker), a prefill worker's
  prefix reads (the prompt is computed whole)
- counter ``pdserve:kv_leases_expired_total``: held KV freed because no one pulled it in time
- gauge ``pdserve:kv_quarantined_blocks``: KV blocks kept from reuse because a read into them
  was stopped (cancelled, failed) and the transport has not said it is over
  (pdserve/shell/read_quarantine.py); past a bound for ``hang_timeout_s`` the worker counts as hung
- counter ``pdserve:prefix_cache_queries_total``, ``pdserve:prefix_cache_hits_total``: prompt
  tokens looked up and found, as vLLM counts them: whole blocks, and a tail's tokens (the last
  partial block of a finished sequence, taken by the next prompt that goes on the same way)
- counter ``pdserve:forward_tokens_total``: tokens run through the model
- counter ``pdserve:num_preemptions_total``: sequences whose KV was freed to make room
- counter ``pdserve:prefix_read_tokens_total``, ``pdserve:prefix_reads_refused_total``
  (prefill workers, the reversed pull): prompt tokens read from a decode worker's cache
  instead of computed; prefixes held for them that they did not read (a tensor-parallel
  worker, prompt logprobs, no free block), computing the prompt whole
- counter ``pdserve:spec_decode_num_drafts_total``, ``pdserve:spec_decode_num_draft_tokens_total``,
  ``pdserve:spec_decode_num_accepted_tokens_total``, and
  ``pdserve:spec_decode_num_accepted_tokens_per_pos_total`` (label ``position``, 0 the first
  speculated token): speculative decoding on a worker that decodes with ``--speculative-config``,
  as vLLM's ``vllm:spec_decode_*`` (proposals verified, tokens proposed, tokens kept, kept at
  each position); no series for a worker that does not speculate. Acceptance rate and mean
  accepted length: docs/speculative.md#serving-it
- ``pdserve:kv_tier_bytes``, ``pdserve:kv_tier_capacity_bytes`` (gauges), ``pdserve:kv_tier_blocks_offloaded_total``,
  ``pdserve:kv_tier_blocks_loaded_total``, ``pdserve:prefix_cache_tier_hits_total``, ``pdserve:kv_tier_corrupt_blocks_total``
  (label ``tier``, its id): a worker's KV tier (``--kv-offload-bytes``, docs/kv_tier.md); bytes and bound are
  those of the tier its host's workers share, counts this worker's; no series for a worker without a tier

Decode workers, per KV read, labels ``pool``, ``worker``, ``backend`` (nixl, tcp), ``model_name``, as vLLM's
NIXL connector reports them:

- histogram ``pdserve:worker_kv_transfer_seconds``: start of the read to its completion (a
  streamed prompt's KV: the wait from the start of its last read, after prefill, to the end of
  every read)
- histogram ``pdserve:worker_kv_transfer_bytes``: bytes one prompt's KV moved
- histogram ``pdserve:worker_kv_transfer_descriptors``: descriptors (one per KV block) it posted

The per-worker gauges carry a ``worker_`` prefix because the router exports the pool sums
under the plain names: one name per meaning, so ``sum by (pool)`` never adds a pool's sum to
its own workers.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.wire.latency import RecentLatencies
from pdserve.wire.worker_metrics import MODEL_LABEL, POOL_LABEL, TRANSFER_BUCKETS, TRANSFER_FAMILIES, WORKERS

# (Importing wire.worker_metrics has turned the *_created series off, for these families too.)
REGISTRY = CollectorRegistry()

# CPU latencies: a TTFT is ~0.1 s for a short prompt and minutes for a long one in a queue;
# the prefill timeout is 600 s.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# One CPU decode step is ~20-200 ms; a re-prefill after a migration shows up as a long gap.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0)
# Token counts, 1-2-5 steps up to the longest context a supported model has (128 Ki).
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(5) for m in (1, 2, 5)) + (100000.0, 131072.0)


def _histogram(name: str, doc: str, buckets: tuple[float, ...] = REQUEST_BUCKETS) -> Histogram:
    return Histogram(name, doc, [MODEL_LABEL], buckets=buckets, registry=REGISTRY)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, doc, [*labels, MODEL_LABEL], registry=REGISTRY)


# ---- router: requests -------------------------------------------------------------------
TTFT = _histogram("pdserve:time_to_first_token_seconds", "Request start to the first token sent.")
ITL = _histogram("pdserve:inter_token_latency_seconds", "Time between two token batches sent.", ITL_BUCKETS)
E2E = _histogram("pdserve:e2e_request_latency_seconds", "Request start to finish, aborts included.")
QUEUE_TIME = _histogram("pdserve:request_queue_time_seconds",
                        "Time the request waited for room in a full pool, then for the prefill worker.")
PREFILL_TIME = _histogram("pdserve:request_prefill_time_seconds",
                          "Compute time of the request's first prefill on the prefill worker.")
DECODE_TIME = _histogram("pdserve:request_decode_time_seconds", "First token to finish.")
KV_TRANSFER_TIME = _histogram("pdserve:kv_transfer_seconds", "One prompt's KV read by a decode worker.",
                              TRANSFER_BUCKETS)
REQUEST_PROMPT_TOKENS = _histogram("pdserve:request_prompt_tokens", "Prompt tokens of one request.", TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram("pdserve:request_generation_tokens", "Tokens one request was sent.",
                                       TOKEN_BUCKETS)
REQUEST_SUCCESS = _counter("pdserve:request_success_total", "Finished requests, by finish reason.",
                           ("finished_reason",))
REQUEST_FAILURES = _counter("pdserve:request_failures_total", "Requests that failed while routing, by gRPC status.",
                            ("code",))
PROMPT_TOKENS = _counter("pdserve:prompt_tokens_total", "Prompt tokens of requests prefilled.")
GENERATION_TOKENS = _counter("pdserve:generation_tokens_total", "Tokens sent to clients.")
RETRIES = _counter("pdserve:request_retries_total", "Prefill attempts a worker failed (unreachable or full).")
MIGRATIONS = _counter("pdserve:request_migrations_total", "Re-prefills after a lost decode.")
KV_MOVES = _counter("pdserve:request_kv_moves_total",
                    "Streams handed over with their KV that went on on another decode worker (no re-prefill).")
ROUTING_DECISIONS = _counter("pdserve:routing_decisions_total", "Prefill workers chosen, by the rule that chose.",
                             ("reason",))
ROUTING_OVERLAP = _histogram("pdserve:routing_prefix_overlap_tokens",
                             "Prompt tokens the chosen prefill worker caches, per the router's KV index.",
                             (0.0,) + TOKEN_BUCKETS)
LOCAL_PREFILL_DECISIONS = _counter("pdserve:local_prefill_decisions_total",
                                   "Who prefilled each attempt: its decode worker (local) or the prefill pool (remote).",
                                   ("decision", "reason"))
LOCAL_PREFILL_UNCACHED = Histogram("pdserve:local_prefill_uncached_tokens",
                                   "Uncached prompt tokens the local-prefill rule saw.", ["decision", MODEL_LABEL],
                                   buckets=TOKEN_BUCKETS, registry=REGISTRY)
LOCAL_PREFILL_LOAD = Histogram("pdserve:local_prefill_decode_load",
                               "KV share in use (0..1) of the decode worker the local-prefill rule saw.",
                               ["decision", MODEL_LABEL], buckets=tuple(k / 10 for k in range(1, 11)),
                               registry=REGISTRY)

# ---- router: pools ----------------------------------------------------------------------
RUNNING = Gauge("pdserve:num_requests_running", "Requests running in the pool.", [POOL_LABEL], registry=REGISTRY)
WAITING = Gauge("pdserve:num_requests_waiting", "Requests waiting in the pool.", [POOL_LABEL], registry=REGISTRY)
KV_USAGE = Gauge("pdserve:kv_cache_usage_perc", "Fraction of the pool's KV blocks in use (0..1).", [POOL_LABEL],
                 registry=REGISTRY)
REPLICAS = Gauge("pdserve:pool_replicas", "Healthy workers in the pool.", [POOL_LABEL], registry=REGISTRY)
DESIRED_REPLICAS = Gauge("pdserve:autoscaler_desired_replicas", "Workers the autoscaler wants in the pool.",
                         [POOL_LABEL], registry=REGISTRY)
SIGNAL_TARGET = Gauge("pdserve:autoscaler_signal_target",
                      "The autoscaler's per-worker target of the pool's primary signal.", [POOL_LABEL], registry=REGISTRY)

# ---- router: its event loop (pdserve/router/loop_lag.py) -----------------------------------
# A healthy loop is late by well under a millisecond; 10 s stalls lose the router's KV.
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOOP_LAG = Histogram("pdserve:router_loop_lag_seconds",
                     "How late the router's event loop ran a callback scheduled every 0.1 s.",
                     buckets=LOOP_LAG_BUCKETS, registry=REGISTRY)


# ---- router: role changes of elastic workers (pdserve/router/admin.py, from the controller) --
SWITCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROLE_SWITCH_TIME = Histogram("pdserve:role_switch_seconds",
                             "An elastic worker's role switch, from the controller's decision until it serves its "
                             "new role.", ["to_role"], buckets=SWITCH_BUCKETS, registry=REGISTRY)
ROLE_CHANGES = Counter("pdserve:role_changes_total", "Role switches of elastic workers, by old role, new role and reason.",
                       ["from_role", "to_role", "reason"], registry=REGISTRY)
ROLE_SWITCH_HANDED_OVER = Counter("pdserve:role_switch_streams_handed_over_total",
                                  "Decode streams a role switch gave up past its grace (the router migrated them).",
                                  ["from_role"], registry=REGISTRY)
ROLE_SWITCH_KV_MOVED = Counter("pdserve:role_switch_streams_kv_moved_total",
                               "Of the streams a role switch handed over, those that moved with their KV to another "
                               "decode worker (no re-prefill).", ["from_role"], registry=REGISTRY)
ROLE_SWITCH_LEASES_LEFT = Counter("pdserve:role_switch_leases_left_total",
                                  "Held KV leases still served under their lease when a switch's new role opened.",
                                  ["from_role"], registry=REGISTRY)
MIXED_WORKERS = Gauge("pdserve:mixed_workers", "Healthy decode-pool workers in the mixed role (elastic roles): "
                      "they prefill the streams they take.", registry=REGISTRY)
BUDGET_PRESSURE = Gauge("pdserve:role_budget_pressure",
                        "The budget policy's pressure of each pool (1: at its targets), as the controller last saw it.",
                        [POOL_LABEL], registry=REGISTRY)


def role_changed(from_role: str, to_role: str, reason: str, seconds: float, handed_over: int = 0,
                 leases_left: int = 0, kv_moved: int = 0) -> None:
    """One completed role switch (the controller reports it with the membership that lists the new role)."""
    ROLE_SWITCH_TIME.labels(to_role).observe(seconds)
    ROLE_CHANGES.labels(from_role, to_role, reason).inc()
    ROLE_SWITCH_HANDED_OVER.labels(from_role).inc(handed_over)
    ROLE_SWITCH_KV_MOVED.labels(from_role).inc(kv_moved)
    ROLE_SWITCH_LEASES_LEFT.labels(from_role).inc(leases_left)


# The reasons a switch has unless an operator names another (``pdserve set-role --reason``).
ROLE_CHANGE_REASONS = ("manual", "prefill_pressure", "decode_pressure")


def register_role_changes() -> None:
    """Create the role-switch series at zero when the router starts, so that a dashboard reads
    no switches, not "no data", until the first one (the budget's pressure exists only while
    a budget policy runs)."""
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        ROLE_SWITCH_TIME.labels(dst)
        ROLE_SWITCH_HANDED_OVER.labels(src)
        ROLE_SWITCH_KV_MOVED.labels(src)
        ROLE_SWITCH_LEASES_LEFT.labels(src)
        for reason in ROLE_CHANGE_REASONS:
            ROLE_CHANGES.labels(src, dst, reason)


def set_budget_pressure(pressures: dict[str, float]) -> None:
    for pool, value in pressures.items():
        BUDGET_PRESSURE.labels(pool).set(value)


# The workers' families (wire.worker_metrics) are listed here too, after the router's.
REGISTRY.register(WORKERS)
for _family in TRANSFER_FAMILIES:
    REGISTRY.register(_family)

# The same TTFT and ITL observations, kept exactly for a few minutes: the autoscaler asks the
# router for their recent p90 (RouterAdmin.GetLatency), its SLO signals.
RECENT_TTFT = RecentLatencies()
RECENT_ITL = RecentLatencies()


def render() -> tuple[bytes, str]:
    """This process's metrics as the Prometheus text format: (body, content type)."""
    # Format 0.0.4: every name here is a classic one, and every scraper reads it.
    return generate_latest(REGISTRY), CONTENT_TYPE_PLAIN_0_0_4


def register_model(model_name: str) -> None:
    """Create the model's request series at zero when the router starts, so that a dashboard
    reads 0 retries or migrations, not "no data", before the first one happens."""
    for family in (TTFT, ITL, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, KV_TRANSFER_TIME, REQUEST_PROMPT_TOKENS,
                   REQUEST_GENERATION_TOKENS, PROMPT_TOKENS, GENERATION_TOKENS, RETRIES, MIGRATIONS, KV_MOVES,
                   ROUTING_OVERLAP):
        family.labels(model_name)


def set_mixed_workers(count: int) -> None:
    MIXED_WORKERS.set(count)


def set_pool(pool: str, running: int, waiting: int, kv_usage: float, replicas: int, desired: int,
             target: float | None = None) -> None:
    """Publish one pool's gauges (the router, after each stats poll); ``target``: the
    autoscaler's signal target, None without autoscaling."""
    if target is not None:
        SIGNAL_TARGET.labels(pool).set(target)
    RUNNING.labels(pool).set(running)
    WAITING.labels(pool).set(waiting)
    KV_USAGE.labels(pool).set(kv_usage)
    REPLICAS.labels(pool).set(replicas)
    DESIRED_REPLICAS.labels(pool).set(desired)


class RequestMetrics:
    """One request's timeline at the router, observed into the router's families as it goes.

    Latencies count from ``arrived`` (a ``clock`` reading taken when the request reached the
    router, before tokenization and validation; now when not given), as a client sees them.
    ``clock`` is injectable for tests. A request is counted once, by the first of
    ``finished`` or ``failed``; later calls are ignored. Every family carries ``model_name``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, arrived: float | None = None,
                 model_name: str = ""):
        self._clock = clock
        self.model_name = model_name
        self.started = clock() if arrived is None else arrived
        self.first_token_at: float | None = None
        self._last_sent_at: float | None = None
        self.generated = 0  # tokens sent so far
        self.outcome: str | None = None  # the finish reason or failure code, once counted

    def prefilled(self, prompt_tokens: int, queue_s: float, prefill_s: float, admission_s: float = 0.0) -> None:
        """The first prefill answered; ``prefill_s`` is the worker's queue + compute time.
        Queue time also counts ``admission_s``, the wait in the router for room in a full pool."""
        m = self.model_name
        PROMPT_TOKENS.labels(m).inc(prompt_tokens)
        REQUEST_PROMPT_TOKENS.labels(m).observe(prompt_tokens)
        QUEUE_TIME.labels(m).observe(admission_s + queue_s)
        PREFILL_TIME.labels(m).observe(max(0.0, prefill_s - queue_s))

    def sent(self, num_tokens: int, finish_reason: str | None = None) -> None:
        """A batch of tokens went to the client; the last batch carries the finish reason."""
        now = self._clock()
        if self.first_token_at is None:
            self.first_token_at = now
            TTFT.labels(self.model_name).observe(now - self.started)
            RECENT_TTFT.add(now - self.started)
        else:
            ITL.labels(self.model_name).observe(now - self._last_sent_at)
            RECENT_ITL.add(now - self._last_sent_at)
        self._last_sent_at = now
        self.generated += num_tokens
        GENERATION_TOKENS.labels(self.model_name).inc(num_tokens)
        if finish_reason is not None:
            self.finished(finish_reason)

    def finished(self, reason: str) -> None:
        """The request ended with ``reason`` (stop, length, abort)."""
        if self.outcome is not None:
            return
        self.outcome = reason
        now, m = self._clock(), self.model_name
        E2E.labels(m).observe(now - self.started)
        if self.first_token_at is not None:
            DECODE_TIME.labels(m).observe(now - self.first_token_at)
        REQUEST_GENERATION_TOKENS.labels(m).observe(self.generated)
        REQUEST_SUCCESS.labels(reason, m).inc()

    def failed(self, code: str) -> None:
        """The request ended with gRPC status ``code`` (a name such as UNAVAILABLE)."""
        if self.outcome is None:
            self.outcome = code
            REQUEST_FAILURES.labels(code, self.model_name).inc()

    def kv_transferred(self, seconds: float) -> None:
        KV_TRANSFER_TIME.labels(self.model_name).observe(seconds)

    def retried(self) -> None:
        RETRIES.labels(self.model_name).inc()

    def migrated(self) -> None:
        MIGRATIONS.labels(self.model_name).inc()

    def kv_moved(self) -> None:
        KV_MOVES.labels(self.model_name).inc()

    def routed(self, rule: str, cached_tokens: int) -> None:
        """A prefill worker was chosen by ``rule``; the index says it caches ``cached_tokens``."""
        ROUTING_DECISIONS.labels(rule, self.model_name).inc()
        ROUTING_OVERLAP.labels(self.model_name).observe(cached_tokens)

    def prefill_placed(self, decision: str, reason: str, uncached_tokens: int, load: float) -> None:
        """The local-prefill rule decided (``decision``: local or remote) for this attempt."""
        LOCAL_PREFILL_DECISIONS.labels(decision, reason, self.model_name).inc()
        LOCAL_PREFILL_UNCACHED.labels(decision, self.model_name).observe(uncached_tokens)
        LOCAL_PREFILL_LOAD.labels(decision, self.model_name).observe(load)

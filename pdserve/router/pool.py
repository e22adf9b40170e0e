"""The router's view of the workers: a gRPC client per worker, its last stats, and the load
this router placed on it since. Membership changes through ``add`` / ``remove``.

The same polls feed the KV index (``pdserve.router.kv_index``): each worker's answer carries its
prefix-cache events since the last poll (a decode worker's with decode_kv_reuse); ``route_prefill``
reads the prefill workers' part, ``decode_overlaps`` the decode workers'.

After each stats poll the pool publishes its per-pool gauges (``pdserve.wire.metrics``) and knows
where every worker serves its own /metrics (``metrics_targets``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import secrets
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import grpc

from pdserve.engine.core.block_hashes import kv_salt
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.router import transfer_faults
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_policy import RoutingConfig, choose_prefill
from pdserve.router.liveness import Liveness, is_hung, observe
from pdserve.router.local_prefill import PrefillPace
from pdserve.router.policy import SERVES, Choice, WorkerSnapshot, prefer_holders
from pdserve.router.session_hint import SessionHints
from pdserve.router.transfer_faults import TRANSFER_DOWN_S
from pdserve.wire import metrics
from pdserve.wire.grpc_util import aio_channel
from pdserve.wire.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass
class WorkerClient:
    """One worker as the router sees it; ``address`` is its identity."""

    role: str
    address: str
    channel: grpc.aio.Channel
    stub: object
    stats: worker_pb2.WorkerStats | None = None
    healthy: bool = False
    local_tokens: int = 0  # prompt tokens sent since the last stats
    local_blocks: int = 0  # blocks of streams placed since the last stats
    inflight: int = 0
    draining: bool = False
    epoch: int = 0  # stats polls so far; local_* count only what was placed since the last
    last_placed: int = 0  # the pool's placement counter when this worker last got a request
    liveness: Liveness | None = None  # router.liveness: its engine's progress as the polls saw it
    hung: bool = False
    # Set when the worker is found hung: the requests on it stop waiting and migrate. A new
    # event replaces it once the worker makes progress again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # KV transfers with this worker (either end) that failed in a row, and until when
    # (monotonic) it is down for routing because they kept failing (``pdserve.router.transfer_faults``):
    # a worker whose KV nobody can read, or that reads nothing, answers Stats fine, and routing
    # would keep picking it.
    transfer_failures: int = 0
    down_until: float = 0.0

    def snapshot(self) -> WorkerSnapshot:
        s = self.stats or worker_pb2.WorkerStats()
        down = self.down_until > time.monotonic()
        return WorkerSnapshot(
            worker_id=self.address, role=self.role, healthy=self.healthy and not self.hung and not down, draining=self.draining or s.draining,
            queued_tokens=s.num_waiting_tokens + self.local_tokens,
            blocks_used=s.num_blocks_used + self.local_blocks, blocks_total=s.num_blocks_total,
            blocks_unbounded=s.num_blocks_unbounded, inflight=self.inflight, last_placed=self.last_placed,
            local_token_s=s.local_prefill_token_s or None, verify_kv=s.verify_kv if self.stats is not None else None,
            loras=frozenset(s.lora_names) if s.lora_enabled else None)


POOLS = ("prefill", "decode")
POOL_OF = {"mixed": "decode"}  # a mixed worker's KV and streams are its decode pool's (router.policy.SERVES)


@dataclass(frozen=True)
class PoolLoad:
    """One pool's load: its healthy workers' last stats, summed."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    replicas: int = 0  # healthy workers

    @property
    def kv_usage(self) -> float:
        """Used KV blocks over the pool's total, 0..1 (0 for an empty pool)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


def pool_loads(workers: Iterable[WorkerClient]) -> dict[str, PoolLoad]:
    """Every pool's load, an empty pool included. Unhealthy workers' stats are stale: left out."""
    loads = {pool: PoolLoad() for pool in POOLS}
    for w in workers:
        if not w.healthy or w.stats is None:
            continue
        pool = POOL_OF.get(w.role, w.role)
        s, old = w.stats, loads.get(pool, PoolLoad())
        loads[pool] = PoolLoad(old.running + s.num_running, old.waiting + s.num_waiting,
                                 old.blocks_used + s.num_blocks_used, old.blocks_total + s.num_blocks_total,
                                 old.replicas + 1)
    return loads


@dataclass
class WorkerPool:
    interval_s: float = 0.2
    tls: TlsConfig | None = None  # mTLS to the workers (wire.tls)
    # A worker whose engine makes no progress this long while it holds work (or that does not
    # answer this long) is hung: not routed to, and its requests migrate (router.liveness).
    hang_timeout_s: float = 30.0
    workers: dict[str, WorkerClient] = field(default_factory=dict)
    required_roles: tuple[str, ...] = POOLS  # ready when each has a routable worker; colocated: decode only
    # This router's incarnation, sent with every Stats poll and Prefill: a prefill worker frees
    # the unclaimed KV it holds for an incarnation that stops polling (the router died).
    router_id: str = field(default_factory=lambda: secrets.token_hex(8))
    desired_replicas: dict[str, int] = field(default_factory=dict)  # set by the controller
    signal_targets: dict[str, float] = field(default_factory=dict)  # the autoscaler's, set by the controller
    index: KVIndex = field(default_factory=KVIndex)  # which worker caches which blocks (decode ones with decode_kv_reuse)
    sessions: SessionHints = field(default_factory=SessionHints)  # the session_id hint (router.session_hint)
    rng: random.Random = field(default_factory=random.Random)  # KV routing with a temperature above 0
    prefill_pace: PrefillPace = field(default_factory=PrefillPace)  # a prompt token's cost on the prefill pool
    # Called with each worker after its answered stats poll (the router's LoRA sync,
    # router.lora_admin: a worker that joined is given the adapters it lacks); None: nothing.
    on_stats: Callable[[WorkerClient], None] | None = None
    _task: asyncio.Task | None = None
    _was_complete: bool = False  # every required pool has had a routable worker at once (``ready``)
    _placements: itertools.count = field(default_factory=lambda: itertools.count(1))
    _turns: itertools.count = field(default_factory=itertools.count)  # round-robin routing

    def add(self, role: str, address: str) -> WorkerClient:
        if address not in self.workers:
            channel = aio_channel(address, self.tls, peer=POOL_OF.get(role, role))
            stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
            self.workers[address] = WorkerClient(role, address, channel, stub)
        return self.workers[address]

    async def remove(self, address: str) -> None:
        """Stop routing to ``address`` at once; its channel closes in the background once the
        requests already on it are done (``_close_when_idle``)."""
        client = self.workers.pop(address, None)
        self.index.remove(address)  # a conversation it held re-prefills elsewhere
        self.sessions.forget_worker(address)
        if client is None:
            return
        # Closed in the background, never awaited here: a membership change (the controller's
        # SetMembership) must not wait on a channel's close, which once held one for the whole
        # 90 s of its caller's deadline in a fuzz run of hostile memberships.
        task = asyncio.get_running_loop().create_task(_close_when_idle(client))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    async def set_members(self, members: list[tuple[str, str]]) -> None:
        """Make the routing table exactly ``members`` ((role, address) pairs): the controller's word."""
        wanted = {address: role for role, address in members}
        # A worker listed under another role (an elastic worker that switched) is a new member:
        # its old client finishes the calls it carries, a new one polls and routes as the new role.
        for address in [a for a, w in self.workers.items() if wanted.get(a) != w.role]:
            await self.remove(address)
        for address, role in wanted.items():
            if address not in self.workers:
                self.add(role, address)
        await self.refresh()

    def members(self) -> list[tuple[str, str]]:
        return [(w.role, w.address) for w in self.workers.values()]

    def snapshots(self, lora_name: str = "") -> list[WorkerSnapshot]:
        """Every worker's snapshot; for a request of LoRA adapter ``lora_name``, those of a pool
        where some worker holds it but this one does not are unroutable (``prefer_holders``)."""
        return prefer_holders([w.snapshot() for w in self.workers.values()], lora_name)

    def lora_fingerprint(self, lora_name: str) -> str:
        """The fingerprint of adapter ``lora_name`` that every worker reporting it agrees on
        (``WorkerStats.lora_fingerprints``); "" where none reports one, they differ (an adapter
        reloaded on some workers only), or one holds it without saying which: hashes made with
        "" match no worker's blocks, so KV-aware routing misses, never finds another's KV."""
        seen = set()
        for worker in self.workers.values():
            s = worker.stats
            if s is None or not s.lora_enabled or lora_name not in s.lora_names:
                continue
            if len(s.lora_fingerprints) != len(s.lora_names):
                return ""
            seen.add(s.lora_fingerprints[list(s.lora_names).index(lora_name)])
        return seen.pop() if len(seen) == 1 else ""

    def kv_salt(self, params) -> str:
        """``kv_salt`` of a request's ``params`` as the workers holding its adapter hash its
        blocks (``lora_fingerprint``)."""
        return kv_salt(params, self.lora_fingerprint(params.lora_name) if params.lora_name else "")

    def route_prefill(self, prompt: Sequence[int], routing: RoutingConfig, exclude: frozenset[str] = frozenset(),
                      max_queued_tokens: int | None = None, cache_salt: str = "", lora_name: str = "") -> Choice:
        """The prefill worker for ``prompt`` under ``routing.policy`` (``pdserve.router.kv_policy``),
        with each worker's cached prefix (under ``cache_salt``, the request's ``kv_salt``) read
        from the KV index, then what its KV tier holds after that (``KVIndex.tier_tokens``), among
        the workers holding its adapter where any does."""
        snapshots = self.snapshots(lora_name)
        overlaps = self.prefill_overlaps(prompt, cache_salt)
        tiered = self.index.tier_tokens(prompt, overlaps, cache_salt)  # what each loads from its KV tier after that
        turn = next(self._turns) if routing.policy == "round_robin" else 0
        return choose_prefill(snapshots, overlaps, len(prompt), routing, turn, exclude, max_queued_tokens, self.rng,
                              tiered)

    def decode_overlaps(self, prompt: Sequence[int], cache_salt: str = "") -> dict[str, int]:
        """Per decode-pool worker (decode and mixed), the prompt tokens its prefix cache holds
        under ``cache_salt`` per the KV index (decode workers publish them with decode_kv_reuse)."""
        return self.index.overlaps(prompt, [w.address for w in self.workers.values() if w.role in SERVES["decode"]],
                                   cache_salt)

    def prefill_overlaps(self, prompt: Sequence[int], cache_salt: str = "") -> dict[str, int]:
        """Per prefill worker, the prompt tokens its prefix cache holds under ``cache_salt``."""
        return self.index.overlaps(prompt, [w.address for w in self.workers.values() if w.role == "prefill"],
                                   cache_salt)

    def ready(self) -> bool:
        """Whether the router takes traffic. Until it has first had a routable worker in every
        pool it needs, only then (a cluster starting serves as it was laid out). After, while
        it can still serve a request: with the prefill pool gone (hung, dead, being replaced)
        its decode workers prefill (``Reason.NO_PREFILL_WORKER``), so a lost prefill pool
        degrades it (``degraded``) rather than taking it out of its Service, which would
        refuse every client."""
        missing = self.missing_roles()
        if not missing:
            self._was_complete = True
            return True
        return self._was_complete and not self.missing_serving_roles()

    def degraded(self) -> list[str]:
        """The pools missing from a router that is ready all the same (``ready``)."""
        return self.missing_roles() if self.ready() else []

    def missing_serving_roles(self) -> list[str]:
        """The missing pools no request can do without: the decode pool (a mixed worker counts)."""
        return [role for role in self.missing_roles() if role != "prefill"]

    def missing_roles(self) -> list[str]:
        """The pools this router needs that have no routable worker (colocated: decode only)."""
        roles = {w.role for w in self.workers.values() if w.healthy and not w.hung and not w.draining}
        if "mixed" in roles:  # it decodes, and it prefills what it decodes (and, then, so do the decode workers)
            roles |= {"prefill", "decode"}
        return [role for role in self.required_roles if role not in roles]

    def metrics_targets(self) -> list[dict]:
        """Prometheus HTTP service discovery: one entry per worker that reported its /metrics.

        Workers now unreachable stay listed, so that Prometheus records them as down.
        """
        return [{"targets": [w.stats.metrics_address], "labels": {"pool": w.role, "worker": w.stats.worker_id}}
                for w in self.workers.values() if w.stats is not None and w.stats.metrics_address]

    def publish_metrics(self) -> None:
        """Set the per-pool gauges from the workers' last stats."""
        for pool, load in pool_loads(self.workers.values()).items():
            desired = self.desired_replicas.get(pool, load.replicas)  # no autoscaler: the current size
            metrics.set_pool(pool, load.running, load.waiting, load.kv_usage, load.replicas, desired=desired,
                             target=self.signal_targets.get(pool))
        metrics.set_mixed_workers(sum(w.role == "mixed" and w.healthy for w in self.workers.values()))

    def mark_down(self, address: str) -> None:
        client = self.workers.get(address)
        if client is not None:
            client.healthy = False

    def transfer_failed(self, source: str | None, reader: str) -> None:
        transfer_faults.failed(self.workers, source, reader)

    def call_unanswered(self, address: str) -> None:
        """A call to ``address`` passed its bound unanswered while the worker still answers its
        Stats polls (an accepted call it never serves): down for routing for ``TRANSFER_DOWN_S``,
        so the next requests do not each wait out that bound on it."""
        client = self.workers.get(address)
        if client is not None:
            log.warning("worker %s left a call unanswered past its bound; down for %.0f s", address, TRANSFER_DOWN_S)
            client.down_until = time.monotonic() + TRANSFER_DOWN_S

    def transfer_ok(self, source: str | None, reader: str) -> None:
        transfer_faults.succeeded(self.workers, source, reader)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for address in list(self.workers):
            await self.remove(address)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round hit
                log.exception("worker stats refresh failed")

    async def refresh(self) -> None:
        await asyncio.gather(*(self._refresh_one(w) for w in list(self.workers.values())))
        self.publish_metrics()

    async def _refresh_one(self, w: WorkerClient) -> None:
        epoch, after = self.index.cursor(w.address)
        try:
            stats = await w.stub.Stats(worker_pb2.StatsRequest(router_id=self.router_id, cache_events=True,
                                                               cache_epoch=epoch, cache_events_after=after),
                                       timeout=min(2.0, self.hang_timeout_s))
        except grpc.aio.AioRpcError as exc:
            if w.healthy:
                log.warning("worker %s unreachable: %s", w.address, exc.code().name)
            w.healthy = False
            self._check_liveness(w, answered=False)
            return
        if stats.HasField("cache_events") and self.workers.get(w.address) is w:  # not one removed meanwhile
            self.index.apply(w.address, stats.cache_events, stats.block_size, stats.kv_tier_id)
            stats.ClearField("cache_events")  # applied; a snapshot can be large, keep only the load
        w.stats = stats
        w.healthy = True
        w.local_tokens = w.local_blocks = 0  # the fresh stats include what we sent
        w.epoch += 1
        self._check_liveness(w, answered=True)
        if self.on_stats is not None and self.workers.get(w.address) is w:
            self.on_stats(w)

    def _check_liveness(self, w: WorkerClient, answered: bool) -> None:
        now = time.monotonic()
        s = w.stats if answered else None
        w.liveness = observe(w.liveness, now, answered, s.engine_steps if s else 0, s.engine_busy if s else False,
                             s.kv_quarantined_blocks if s else 0, s.num_blocks_total if s else 0)
        hung = is_hung(w.liveness, now, self.hang_timeout_s)
        if hung and not w.hung:
            log.warning("worker %s is hung: no engine progress for %.1f s, or KV quarantined past its bound "
                        "(hang_timeout_s %g); its requests migrate", w.address, now - w.liveness.progressed_at,
                        self.hang_timeout_s)
            w.lost.set()
        elif w.hung and not hung:
            log.warning("worker %s makes progress again", w.address)
            w.lost = asyncio.Event()
        w.hung = hung

    @contextlib.contextmanager
    def placed(self, client: WorkerClient, tokens: int = 0, blocks: int = 0):
        """Count a request's load on ``client`` while it runs there.

        Until the next stats poll the worker's own numbers do not include it, so it is added
        locally; if it ends before that poll, it is taken off again.
        """
        epoch = client.epoch
        client.last_placed = next(self._placements)
        client.inflight += 1
        client.local_tokens += tokens
        client.local_blocks += blocks
        try:
            yield client
        finally:
            client.inflight -= 1
            if client.epoch == epoch:
                client.local_tokens = max(0, client.local_tokens - tokens)
                client.local_blocks = max(0, client.local_blocks - blocks)


_CLOSING: set[asyncio.Task] = set()  # the closes in flight (a task nothing holds may be collected)
CLOSE_TIMEOUT_S = 5.0


async def _close_when_idle(client: WorkerClient, poll_s: float = 0.2) -> None:
    """Close a removed worker's channel once the requests on it are done (closing it sooner
    would cancel them: a drained worker finishes its streams), giving up after
    ``CLOSE_TIMEOUT_S`` (the channel is out of the routing table either way)."""
    while client.inflight:
        await asyncio.sleep(poll_s)
    try:
        await asyncio.wait_for(client.channel.close(grace=None), CLOSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        log.warning("closing the channel of removed worker %s took over %.0f s; left to the collector",
                    client.address, CLOSE_TIMEOUT_S)

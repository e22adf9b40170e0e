"""A discrete-event simulator of a pdserve cluster.

Events, in time order (ties: the order they were scheduled):

- ``ARRIVE``: a request reaches the router. Disaggregated: the real ``pdserve.router.policy.pick_prefill``
  chooses a prefill worker (least queued prompt tokens, with the router's queue limit);
  colocated: the same policy over colocated workers. With prefill that keeps up on
  (``ClusterSpec.overflow_ttft_s``), the real ``behind`` rule first asks whether the prefill
  pool is so far behind that the picked decode worker should prefill the prompt itself
  (``pdserve.planner.placement``). No worker can take it: it waits in the router, re-tried
  whenever a step ends, and fails after ``admission_wait_s``.
- ``STEP``: a worker's step (a prefill step, a decode epoch of k steps, or with a step target
  ``ClusterSpec.step_target_s`` a mixed step of streams and a time-sized prompt chunk, see
  ``pdserve.planner.worker``) ends. Prompts prefilled there get their first token (TTFT). On a prefill
  worker each then needs a decode worker: the real ``pick_decode`` (least KV in use, enough
  free blocks for prompt + output) chooses one, which reserves the prompt's blocks, and the
  KV transfer starts (``XFER``). Finished requests record their finish time. The worker then
  starts its next step if it has work.
- ``XFER``: a KV transfer lands. The prefill worker frees the held blocks; the decode
  worker's batch takes the sequence at its next step (``SimWorker.interrupt`` cuts the decode
  epoch in flight short). Transfers into one decode worker share its link, first come first
  served.
- ``TICK``: every second, the autoscaling driver (``pdserve.planner.autoscale``) samples each pool and
  runs the real ``pdserve.cluster.autoscaling.decide``; a scale-up adds a worker ``startup_s`` later
  (``READY``), a scale-down drains the least-loaded one (no new work; gone once idle).

Open or closed loop: by default each request arrives at its trace time. With ``closed_loop=C``
the trace's times are ignored and C clients send the requests in order, each its next one when
its last one finishes or fails (as ``vllm bench serve --max-concurrency C`` with rate ``inf``,
or ``benchmarks/loadgen.py --concurrency C``); a request's arrival is when its client sent it.

Request states: routed -> prefilling (queued or in a step) -> [transferring -> decoding] ->
finished, or failed (no worker took it within ``admission_wait_s``).

The router here reads each worker's load exactly, where the real one reads polled stats plus
its own placements since; on a cluster the router's view lags by up to one poll (0.5 s).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

import numpy as np

from pdserve.planner.layout import ClusterSpec
from pdserve.planner.metrics import CacheStats, SimResult, revisits
from pdserve.planner.trace import TraceRequest
from pdserve.planner.placement import Placement
from pdserve.planner.prefix_cache import HostTiers
from pdserve.planner.worker import SimSeq, SimWorker
from pdserve.planner.routing import RoutingIndex, snapshot
from pdserve.router.local_prefill import LocalPrefillConfig, PrefillPace
from pdserve.router.policy import WorkerSnapshot

ARRIVE, STEP, XFER, TICK, READY = range(5)
ROLES = ("prefill", "decode", "colocated")


class Simulator(Placement):
    def __init__(self, spec: ClusterSpec, requests: list[TraceRequest], autoscaler=None, full_scan: bool = False,
                 closed_loop: int | None = None):
        if closed_loop is not None and (closed_loop < 1 or autoscaler is not None):
            raise ValueError(f"closed_loop: needs >= 1 client and no autoscaler, got {closed_loop}")
        self.spec = spec
        self.closed_loop = closed_loop
        self.full_scan = full_scan
        self.requests = requests
        self.autoscaler = autoscaler
        n = len(requests)
        self.arrival = np.array([r.t for r in requests], dtype=float) if closed_loop is None else np.full(n, np.nan)
        self._next_sent = 0  # closed loop: requests its clients have sent
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.device_hit = np.zeros(n, dtype=np.int64)  # prompt tokens from cache at the first prefill
        self.tier_hit = np.zeros(n, dtype=np.int64)
        # one KV tier per host (pdserve/planner/prefix_cache.py), or none
        self.hosts = HostTiers(spec.kv_offload_bytes, spec.prefill_cost.kv_bytes_per_token * spec.limits.block_size,
                               spec.prefill_cost.hw.devices_per_node) if spec.kv_offload_bytes else None
        self._itl: list[tuple[float, int]] = []
        self._events: list = []
        self._counter = itertools.count()
        self.pools: dict[str, list[SimWorker]] = {role: [] for role in ROLES}
        self.draining: list[SimWorker] = []
        self._ids = itertools.count()
        self._index = {"prefill": RoutingIndex(self._prefill_key), "colocated": RoutingIndex(self._prefill_key),
                       "decode": RoutingIndex(self._decode_key)}
        self._by_id: dict[str, SimWorker] = {}
        # Decode workers in the mixed role (elastic roles): in the decode pool and its index, role
        # "colocated" (a prefill in their steps stalls their streams), and a prompt placed on one
        # is prefilled there unless a prefill worker queues less (pdserve/router/local_prefill.py).
        self.mixed: set[str] = set()
        self._placed = itertools.count(1)
        self._last_placed: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._waiting_prefill: deque[SimSeq] = deque()
        self._waiting_decode: deque[tuple[SimSeq, SimWorker]] = deque()
        self._link_free: dict[str, float] = {}
        self._handing_over: set[str] = set()  # draining workers whose streams move once their step ends
        self.failed = 0
        self.now = 0.0
        # Prefill that keeps up: the router's rule and the pace it reads, fed as the router
        # feeds it (each prefill worker's answer: compute seconds per prompt token computed).
        self.overflow = LocalPrefillConfig(overflow_ttft_s=spec.overflow_ttft_s,
                                           overflow_slowdown=spec.overflow_slowdown)
        self.pace = PrefillPace()
        lay = spec.layout
        for role, count in (("prefill", lay.prefill), ("decode", lay.decode), ("colocated", lay.colocated)):
            for _ in range(count):
                self.add_worker(role)
        # listeners the autoscaler reads: first tokens and ITLs since its last sample
        self.recent_ttft: list[float] = []
        self.recent_itl: list[tuple[float, int]] = []

    # ---- workers ------------------------------------------------------------------
    def add_worker(self, role: str) -> SimWorker:
        cost = self.spec.prefill_cost if role == "prefill" else self.spec.decode_cost
        limits = self.spec.prefill_limits if role == "prefill" and self.spec.prefill_limits else self.spec.limits
        w = SimWorker(f"{role}-{next(self._ids)}", role, cost, limits, step_target_s=self.spec.step_target_s)
        if self.hosts is not None:
            w.prefix_cache.tier = self.hosts.place(cost.tp)
        self.pools[role].append(w)
        self._by_id[w.wid] = w
        self._inflight[w.wid] = 0
        self._touch(w)
        return w

    def drain_worker(self, role: str) -> SimWorker | None:
        """Take the least-loaded worker of ``role`` out of routing; it leaves once idle."""
        pool = self.pools[role]
        if len(pool) <= 1:
            return None
        w = min(pool, key=lambda x: (x.num_seqs, x.queued_tokens))
        pool.remove(w)
        self._index[role].remove(w)
        self.mixed.discard(w.wid)
        w.draining = True
        self.draining.append(w)
        return w

    def switch_in_place(self, to_role: str) -> SimWorker | None:
        """Elastic roles' half move: the least loaded plain decode worker becomes mixed
        (``to_role`` "mixed"), or a mixed one plain decode again ("decode"). Its streams and
        queued prompts stay; only how it is routed to changes. None if none can switch."""
        mixed = to_role == "mixed"
        pool = [w for w in self.pools["decode"] if (w.wid in self.mixed) != mixed]
        if not pool:
            return None
        w = min(pool, key=lambda x: (x.num_seqs, x.queued_tokens))
        if mixed:
            self.mixed.add(w.wid)
            w.role = "colocated"
        else:
            self.mixed.discard(w.wid)
            w.role = "decode"
        return w

    def hand_over(self, w: SimWorker) -> None:
        """A draining decode worker's streams move with their KV to the decode pool, at the end
        of the step in flight (``SimWorker.hand_over``; transfers as a prompt's, ``_place_decode``)."""
        if w.busy:
            self._handing_over.add(w.wid)
            return
        self._handing_over.discard(w.wid)
        for seq in w.hand_over():
            self._inflight[w.wid] -= 1
            if not self._place_decode(seq, w):
                self._waiting_decode.append((seq, w))

    def start_worker_later(self, driver, pool: str) -> None:
        """A scale-up: the worker takes requests once its model is loaded, ``startup_s`` from now."""
        self.schedule(self.now + self.spec.startup_s, READY, (driver, pool))

    def schedule(self, t: float, kind: int, a=None, b=None) -> None:
        heapq.heappush(self._events, (t, next(self._counter), kind, a, b))

    # ---- the loop -----------------------------------------------------------------
    def run(self) -> SimResult:
        # Arrivals are read in (time, index) order from one sorted list, merged with the event
        # heap, instead of pushed into it up front: the heap then holds only the events in
        # flight (about one per busy worker), not every request of the run. The order is the
        # one a heap of all arrivals gave: arrivals were scheduled first, so an arrival goes
        # before any other event at the same time.
        events = self._events
        reqs = self.requests
        arrivals = sorted(range(len(reqs)), key=lambda i: reqs[i].t)  # stable: ties by index
        if self.closed_loop is not None:
            arrivals = []  # the clients send them: ``_send``
            for _ in range(min(self.closed_loop, len(reqs))):
                self._send()
        arrival_t = [reqs[i].t for i in arrivals]
        n, nxt = len(arrivals), 0
        if self.autoscaler is not None:
            self.schedule(0.0, TICK)
        end = reqs[-1].t if reqs else 0.0
        handlers = (self._on_arrive, self._on_step, self._on_xfer, self._on_tick, self._on_ready)
        on_arrive, pop = self._on_arrive, heapq.heappop
        while True:
            if nxt < n and (not events or arrival_t[nxt] <= events[0][0]):
                self.now = arrival_t[nxt]
                on_arrive(arrivals[nxt], None)
                nxt += 1
                continue
            if not events:
                break
            t, _, kind, a, b = pop(events)
            self.now = t
            if kind == TICK and t > end and not self._busy():
                continue  # traffic is over: stop sampling so the loop ends
            handlers[kind](a, b)
        itl = np.array(self._itl, dtype=float).reshape(-1, 2)
        if self.closed_loop is not None and reqs:
            end = float(np.nanmax(self.arrival))  # the last send, as an open loop's last arrival
        lay = self.spec.layout
        return SimResult(self.arrival, self.first_token, self.finish,
                         np.array([r.output_tokens for r in self.requests]), itl[:, 0], itl[:, 1],
                         duration_s=max(end, 1e-9), gpus=lay.gpus,
                         preemptions=sum(w.preemptions for p in self.pools.values() for w in p),
                         failed=self.failed,
                         pool_history=self.autoscaler.history if self.autoscaler is not None else {},
                         cache=self._cache_stats())

    def _cache_stats(self) -> CacheStats:
        tiers = self.hosts.tiers if self.hosts is not None else []
        prompt = np.array([r.prompt_tokens for r in self.requests], dtype=np.int64)
        return CacheStats(np.where(np.isfinite(self.first_token), prompt, 0), self.device_hit, self.tier_hit,
                          revisits(self.requests, self.arrival), self.spec.kv_offload_bytes, len(tiers),
                          sum(t.blocks_offloaded for t in tiers), sum(t.blocks_loaded for t in tiers))

    def _send(self) -> None:
        """Closed loop: a client sends the next request now."""
        if self._next_sent < len(self.requests):
            self.schedule(self.now, ARRIVE, self._next_sent)
            self._next_sent += 1

    def _done(self, rid: int | None) -> None:
        """A request finished (``rid``) or failed (None): its client, in a closed loop, sends the next."""
        if rid is not None:
            self.finish[rid] = self.now
        if self.closed_loop is not None:
            self._send()

    def _busy(self) -> bool:
        return any(not w.idle() for p in self.pools.values() for w in p) or bool(self._waiting_prefill)

    # ---- routing ------------------------------------------------------------------
    def _snapshots(self, role: str) -> list[WorkerSnapshot]:
        """What the policy sees: the one worker that can win (``pdserve.planner.routing``), or with
        ``full_scan`` every worker of the pool, as the router passes them."""
        kind = "prefill" if role != "decode" else "decode"
        workers = self.pools[role] if self.full_scan else [w for w in (self._index[role].best(),) if w is not None]
        return [snapshot(w, kind, self._inflight[w.wid], self._last_placed.get(w.wid, 0)) for w in workers]

    def _prefill_key(self, w: SimWorker) -> tuple:
        return (w.queued_tokens, self._inflight[w.wid], self._last_placed.get(w.wid, 0), w.wid)

    def _decode_key(self, w: SimWorker) -> tuple:
        return (w.used_blocks / max(w.num_blocks, 1), self._inflight[w.wid], self._last_placed.get(w.wid, 0), w.wid)

    def _touch(self, w: SimWorker) -> None:
        if not w.draining:
            self._index["decode" if w.wid in self.mixed else w.role].touch(w)

    def _place_decode(self, seq: SimSeq, src: SimWorker) -> bool:
        choice = self._pick_decode(seq)
        if choice.worker_id is None:
            if choice.too_large:
                self._fail(seq, src)
                return True
            return False
        dst = self._worker("decode", choice.worker_id)
        self._last_placed[dst.wid] = next(self._placed)
        self._inflight[dst.wid] += 1
        dst.reserve(seq)
        self._touch(dst)
        start = max(self.now, self._link_free.get(dst.wid, 0.0))
        done = start + self.spec.prefill_cost.transfer_s(seq.prompt, self.spec.decode_cost.tp)
        self._link_free[dst.wid] = done
        self.schedule(done, XFER, (seq, src), dst)
        return True

    def _worker(self, role: str, wid: str) -> SimWorker:
        return self._by_id[wid]

    def _retry(self) -> None:
        while self._waiting_decode:
            seq, src = self._waiting_decode[0]
            if not self._place_decode(seq, src):
                break
            self._waiting_decode.popleft()
        while self._waiting_prefill:
            seq = self._waiting_prefill[0]
            if self.now - self.arrival[seq.rid] > self.spec.admission_wait_s:
                self._waiting_prefill.popleft()
                self.failed += 1
                self._done(None)
                continue
            if not self._place(seq):
                break
            self._waiting_prefill.popleft()

    def _fail(self, seq: SimSeq, src: SimWorker) -> None:
        src.free(seq)
        self.failed += 1
        self._done(None)

    # ---- handlers -----------------------------------------------------------------
    def _on_arrive(self, i: int, _) -> None:
        r = self.requests[i]
        if self.closed_loop is not None:
            self.arrival[i] = self.now
        seq = SimSeq(i, i, r.prompt_tokens, r.output_tokens, r.prefix_hash, r.prefix_tokens)
        if self._waiting_prefill or not self._place(seq):
            self._waiting_prefill.append(seq)

    def _kick(self, w: SimWorker) -> None:
        if w.busy:
            end = w.interrupt(self.now)
        elif w.borrow_factors == (1.0, 1.0):  # a profile without borrowed cores (every GPU one)
            end = w.start(self.now)
        else:  # the workers share one host: with the others idle, its kernels borrow their cores
            others = [x for x in self._by_id.values() if x is not w]
            end = w.start(self.now, borrow=not any(x.busy for x in others))
            if end is not None:  # a borrowed core is busy again: its borrower goes on at its own speed
                for x in others:
                    if x.busy and x.borrowing and (cut := x.unborrow(self.now)) is not None:
                        self.schedule(cut, STEP, x, x.version)
        if end is not None:
            self.schedule(end, STEP, w, w.version)

    def _on_step(self, w: SimWorker, version: int) -> None:
        if version != w.version or not w.busy:
            return  # superseded: the epoch was cut short and rescheduled
        out = w.finish()
        if out.itl is not None:
            self._itl.append(out.itl)
            self.recent_itl.append(out.itl)
        for seq in out.prefilled:
            if not seq.recompute:
                self.first_token[seq.rid] = self.now
                self.device_hit[seq.rid], self.tier_hit[seq.rid] = seq.device_hit, seq.tier_hit
                self.recent_ttft.append(self.now - self.arrival[seq.rid])
            if w.role == "prefill":
                self.pace.observe(seq.compute_tokens, self.now - seq.compute_from)
                self._inflight[w.wid] -= 1
                if seq.remaining == 0:
                    w.free(seq)
                    self._done(seq.rid)
                elif not self._place_decode(seq, w):
                    self._waiting_decode.append((seq, w))
        for seq in out.finished:
            if w.role != "prefill":
                self._done(seq.rid)
                self._inflight[w.wid] -= 1
        if w.wid in self._handing_over:
            self.hand_over(w)
        self._kick(w)
        self._touch(w)
        self._retry()

    def _on_xfer(self, pair: tuple[SimSeq, SimWorker], dst: SimWorker) -> None:
        seq, src = pair
        src.free(seq)
        seq.tokens = seq.prompt
        dst.join(seq)
        # the gap from the first token (on the prefill worker) to the second: transfer and queueing
        self._kick(dst)
        self._kick(src)
        self._touch(dst)
        self._touch(src)
        self._retry()

    def _on_tick(self, _a, _b) -> None:
        self.autoscaler.tick(self, self.now)
        self.draining = [w for w in self.draining if not w.idle()]
        self.schedule(self.now + self.autoscaler.interval_s, TICK)

    def _on_ready(self, driver_pool, _) -> None:
        driver, pool = driver_pool
        driver.worker_ready(self, pool)
        self._retry()

"""The worker both roles are: an engine on its thread plus a KV-transfer agent, written once
for prefill and decode (``PrefillWorker`` and ``DecodeWorker`` subclass ``WorkerShell``).

What differs between the roles is small (what a request waits for, what ``abort_now`` frees, the
hooks that poll transfers or leases); what is the same lives here: start (pin the process to
its cores, start the engine thread), stop, the engine-thread-to-asyncio bridge (``call``;
per-request streams fed once per step), abort, stats, and drain (no new requests; wait for
in-flight ones up to a grace period).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable, ClassVar, Iterable, Sequence

from pdserve.engine import progress
from pdserve.engine.engine_thread import EngineThread, Hold, Hook
from pdserve.engine.errors import StepFailed
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.core.step_trace import StepTrace, trace_path
from pdserve.kv_transfer import KVTransferAgent
from pdserve.kv_transfer.rank_agents import RankAgents
from pdserve.protos import worker_pb2
from pdserve.shell.cache_events import CacheEventBatch, CacheEventLog
from pdserve.shell.core_lending import BorrowerMark, CoreSlots, LenderPace, lend_dir
from pdserve.shell.stats import worker_stats

log = logging.getLogger(__name__)

# How often ``drain`` re-checks for in-flight work: its wait is bounded by the grace period,
# and this only sets how soon after the last request it notices.
_DRAIN_CHECK_S = 0.05


class WorkerShell:
    """Base of ``PrefillWorker`` and ``DecodeWorker``. ``config`` needs ``worker_id``,
    ``cpus`` (cores to pin to; empty: no pinning), ``max_requests``, ``max_receive_bytes``,
    ``step_trace_dir`` (None: no step trace) and ``otlp_traces_endpoint`` (None: no request
    traces; ``pdserve.shell.server.serve`` configures them)."""

    role: ClassVar[str]

    def __init__(self, config: Any, engine: LLMEngine, agent: KVTransferAgent | RankAgents, hooks: Iterable[Hook] = (),
                 holds: Iterable[Hold] = (), cache_log: CacheEventLog | None = None):
        """``cache_log``: the prefix-cache events this worker publishes to routers' Stats polls
        (``pdserve.shell.cache_events``); None: it publishes none."""
        self.config = config
        self.cache_log = cache_log
        self.engine = engine
        self.agent = RankAgents.of(agent)  # one per tensor-parallel rank (pdserve/shell/agents.py)
        self.draining = False  # no new requests; those here finish
        self.refusal = "is draining"  # what a request refused while draining is told (ShellRpcs.admit)
        self.lender: LenderPace | None = None  # a decode worker's pacing while its core is lent (start)
        self.hooks = list(hooks)  # kept for a worker that runs several shells on one thread (run_together)
        self.holds = list(holds)  # likewise (engine_thread: what may delay a step a little)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        trace = StepTrace(trace_path(config.step_trace_dir, config.worker_id)) if config.step_trace_dir else None
        self.thread = EngineThread(engine, self._on_outputs, hooks=self.hooks, name=f"{config.worker_id}-engine",
                                   holds=self.holds, on_step_error=self._on_step_error, step_trace=trace)

    def start(self) -> None:
        if self.config.cpus:
            # A tensor-parallel worker's ranks each take their share of its cores (rank 0: this process).
            own = self.config.cpus if self.engine.ranks is None else self.engine.ranks.pin(self.config.cpus)
            pin_process(own)
            if self.config.borrow_cpus:
                borrow_idle_cores(own, self.config.borrow_cpus)
            self._lend_cores(own)
        self.agent.expect_reads(False)  # until the role says otherwise (a prefill worker holding KV)
        self.thread.start()

    def _lend_cores(self, own: Sequence[int]) -> None:
        """A prefill worker marks the cores it borrows while it prefills; a decode worker with
        ``lend_tpot_s`` paces its steps on its own cores while they are marked, and marks the
        cores it borrows while prompts of its own wait (colocated workers lend to each other;
        shell.core_lending)."""
        try:
            if self.role == "prefill" and self.config.borrow_cpus:
                self.thread.add(hook=BorrowerMark(CoreSlots(self.config.borrow_cpus), self.engine.has_runnable,
                                                  lambda: self.thread.last_step_s))
            elif self.role == "decode" and getattr(self.config, "lend_tpot_s", 0.0) > 0:
                self.engine.keep_step_shape = True  # the lender's period follows its one-sequence steps
                prompts = lambda: bool(self.engine.scheduler.waiting)  # noqa: E731 (prefilled here: colocated)
                self.lender = LenderPace(CoreSlots(own), self.config.lend_tpot_s,
                                         lambda: self.thread.last_step_started, lambda: self.thread.last_step_s,
                                         lambda: self.engine.last_step_shape, own_prompts=prompts)
                self.thread.add(hold=self.lender)
                if self.config.borrow_cpus:
                    self.thread.add(hook=BorrowerMark(CoreSlots(self.config.borrow_cpus), prompts,
                                                      lambda: self.thread.last_step_s,
                                                      lambda: self.engine.last_step_shape))
        except OSError as exc:  # another user's slots, a read-only /dev/shm: serve on, lending nothing
            log.warning("cores %s: no lending between workers (%s: %s)", sorted(own), lend_dir(), exc)

    def stop(self) -> None:
        self.thread.stop()
        self.agent.close()
        self.engine.close(graceful=not self.thread.alive)  # a tensor-parallel worker's other ranks

    # ---- the bridge (asyncio side) ---------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread, between steps."""
        return await asyncio.wrap_future(self.thread.call(fn, *args))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue that ``push`` fills for ``request_id``, on the running loop."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        return await self.call(self.abort_now, request_id)

    # ---- the bridge (engine thread) ----------------------------------------------------
    def push(self, items: Iterable[tuple[str, Any]]) -> None:
        """Hand items to their requests' streams: one wake-up of each event loop per call,
        however many requests and tokens (a step's outputs travel together)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop has closed: nobody is listening any more
                pass

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A request its own fault ended gets its ``SequenceFailed``, which its RPC raises."""
        self.push((o.request_id, o.error if o.error is not None else o) for o in outputs)

    def _on_step_error(self, exc: StepFailed) -> None:
        self.push((request_id, exc) for request_id in exc.request_ids)

    # ---- the role's part -------------------------------------------------------------
    def abort_now(self, request_id: str) -> bool:
        """Engine thread: abort ``request_id``, stopping it wherever it is and freeing what it
        holds (the ``Abort`` RPC, run between steps)."""
        return self.engine.abort(request_id)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is this shell's (``run_together`` hands it its outputs)."""
        return request_id in self._streams

    def in_flight(self) -> int:
        """Requests that a drain waits for."""
        return len(self._streams)

    def requests(self) -> int:
        """Requests on this worker now, queued or running (what ``max_requests`` bounds)."""
        return len(self._streams)

    def note_poll(self, router_id: str) -> None:
        """A router polled Stats; the prefill worker tracks which routers are alive."""

    def cache_events(self, epoch: str, after: int) -> CacheEventBatch | None:
        """The prefix-cache events a router at (``epoch``, ``after``) has not seen yet; None
        where this worker publishes none."""
        return None if self.cache_log is None else self.cache_log.since(epoch, after)

    def stats_extra(self) -> dict[str, Any]:
        """The role's own ``WorkerStats`` fields."""
        return {}

    # ---- stats and drain -------------------------------------------------------------
    def stats(self, metrics_address: str = "") -> worker_pb2.WorkerStats:
        return worker_stats(self.config.worker_id, self.role, self.engine, self.agent, metrics_address,
                            engine_steps=self.thread.steps + progress.layers_done(), draining=self.draining,
                            num_in_flight=self.in_flight(),
                            verify_kv=self.config.verify_kv, **self.stats_extra())

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests, then wait until none is in flight or ``grace_s`` passes.
        True if the worker went idle in time."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.in_flight() and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_CHECK_S)
        return not self.in_flight()


def run_together(shells: Sequence[WorkerShell], name: str, step_trace: StepTrace | None = None) -> EngineThread:
    """One engine thread for several shells over one engine and one KV agent (a worker that
    serves both roles, ``pdserve.elastic_worker``): every shell's hooks run before each step,
    each output goes to the shell that owns its request (``owns``), one no shell owns to the
    first (the prefill shell, which frees a finished sequence nobody waits for), and a failed
    step to all. Replaces each shell's own thread (build the shells without a step trace:
    ``step_trace`` is the one thread's); start it once, for all of them."""
    first = shells[0]

    def on_outputs(outputs: list[RequestOutput]) -> None:
        mine: dict[int, list[RequestOutput]] = {}
        for o in outputs:
            k = next((k for k, shell in enumerate(shells) if shell.owns(o.request_id)), 0)
            mine.setdefault(k, []).append(o)
        for k, batch in mine.items():
            shells[k]._on_outputs(batch)

    def on_step_error(exc: StepFailed) -> None:
        for shell in shells:
            shell._on_step_error(exc)

    thread = EngineThread(first.engine, on_outputs, hooks=[h for shell in shells for h in shell.hooks], name=name,
                          holds=[h for shell in shells for h in shell.holds], on_step_error=on_step_error, step_trace=step_trace)
    for shell in shells:
        shell.thread = thread
    return thread


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def pin_process(cpus: Iterable[int]) -> None:
    """Pin every thread of this process (and the threads they start later) to ``cpus``, and
    size torch's intra-op pool to match: one worker's threads then never share a core with
    another's."""
    import torch

    cores = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile
            pass
    torch.set_num_threads(len(cores))


def borrow_idle_cores(own: Iterable[int], borrowed: Iterable[int]) -> None:
    """Let this worker's CPU kernels also run on ``borrowed`` cores while their owners (the
    other workers on this host) are idle: one idle-priority helper per core, which gives the
    core back the moment its owner wakes (pdserve/engine/kernels/csrc/borrow_pool.h). Torch's own pool keeps
    the worker's own cores. Without pdserve's CPU kernels (a GPU, or no AVX2) there is nothing
    to share."""
    from pdserve.engine.kernels import cpu_kernels

    if not cpu_kernels.cpu_supported():
        return
    import torch

    cpu_kernels.load()
    helpers = torch.ops.pdserve.start_borrow_pool(sorted(own), sorted(borrowed))
    log.info("kernels on cores %s, and %d idle-priority helper(s) on %s", sorted(own), helpers, sorted(borrowed))

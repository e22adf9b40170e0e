"""The elastic worker's core: a prefill worker and a decode worker over one engine and one KV
agent, on one engine thread, and the role switch between them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from pdserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig, decode_engine_config
from pdserve.elastic_worker.roles import CORE, ROLES
from pdserve.engine.core.step_trace import StepTrace, trace_path
from pdserve.kv_transfer.handoff import KVHandle
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.protos import worker_pb2
from pdserve.shell.agents import worker_engine
from pdserve.shell.cache_events import CacheEventLog
from pdserve.shell.worker import WorkerShell, run_together

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElasticWorkerConfig:
    """Each role's own settings, and the role it starts in. The process's settings (id, host,
    ports, cores, TLS, step trace) are the decode config's; the engine runs the decode
    worker's ``mixed`` policy, whose prompts and streams share steps."""

    prefill: PrefillWorkerConfig
    decode: DecodeWorkerConfig
    role: str = "decode"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.prefill.worker_id != self.decode.worker_id:
            raise ValueError(f"both roles need the same worker_id, got {self.prefill.worker_id!r} "
                             f"and {self.decode.worker_id!r}")

    @property
    def worker_id(self) -> str:
        return self.decode.worker_id


@dataclass(frozen=True)
class Switched:
    """What one ``set_role`` did (``SetRoleResponse``)."""

    role: str
    previous: str
    idle: bool  # the old role finished everything within the grace
    handed_over: int  # decode streams given up past the grace (the router migrates them)
    leases_left: int  # held KV still served under its lease when the new role opened
    seconds: float  # from the call until the new role took requests
    kv_moved: int = 0  # of handed_over: streams whose KV stays held here for their next decode worker

    def to_proto(self) -> worker_pb2.SetRoleResponse:
        return worker_pb2.SetRoleResponse(role=self.role, previous=self.previous, idle=self.idle,
                                          handed_over=self.handed_over, leases_left=self.leases_left,
                                          seconds=self.seconds, kv_moved=self.kv_moved)


class ElasticWorker:
    """Both roles on one engine (see the package docstring). It has what ``pdserve.shell.server.serve``
    asks of a worker: ``config``, ``endpoint``, ``engine``, ``role``, ``start``, ``stop``,
    ``stats``, ``in_flight`` and ``drain``."""

    def __init__(self, config: ElasticWorkerConfig):
        engine = worker_engine(decode_engine_config(config.decode.engine))
        # One log of the one cache's events: whichever role a router polls, it hears one epoch
        # and one numbering (the decode role publishes from it only with ``decode_kv_reuse``).
        cache_log = CacheEventLog.following(engine.blocks, config.prefill.cache_event_log_size, engine.kv_tier)
        # The shells get no step trace of their own: the one thread that steps for both writes it.
        self.decode = DecodeWorker(dataclasses.replace(config.decode, step_trace_dir=None), engine,
                                   cache_log=cache_log)
        self.prefill = PrefillWorker(dataclasses.replace(config.prefill, step_trace_dir=None), engine,
                                     agent=self.decode.agent, cache_log=cache_log)
        trace_dir = config.decode.step_trace_dir
        trace = StepTrace(trace_path(trace_dir, config.worker_id)) if trace_dir else None
        self.thread = run_together([self.prefill, self.decode], f"{config.worker_id}-engine", trace)
        self.config = config.decode
        self.endpoint = self.decode.endpoint
        self.engine = engine
        self.agent = self.decode.agent
        self.role = config.role
        self.address = ""  # its gRPC server's, once serving (the server's register sets it): KV handles name it
        self._close(self.other(self.role), self.role)
        self._switching: asyncio.Lock | None = None

    def part(self, role: str) -> WorkerShell:
        """The core that serves ``role``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        return self.prefill if CORE[role] == "prefill" else self.decode

    def other(self, role: str) -> WorkerShell:
        return self.decode if CORE[role] == "prefill" else self.prefill

    @staticmethod
    def _close(part: WorkerShell, role: str) -> None:
        part.draining = True
        part.refusal = f"serves the {role} role now"

    # ---- what serve() needs --------------------------------------------------------
    def start(self) -> None:
        self.decode.start()  # pins the process and starts the one engine thread (shared by both)

    def stop(self) -> None:
        self.decode.stop()  # the thread and the agent, both shared

    def stats(self, metrics_address: str = "") -> worker_pb2.WorkerStats:
        return self.part(self.role).stats(metrics_address)

    def in_flight(self) -> int:
        return self.prefill.in_flight() + self.decode.in_flight()

    async def drain(self, grace_s: float) -> bool:
        """SIGTERM: both roles take nothing new; True if both went idle within ``grace_s``.
        Streams are not handed over early here, as they are when the controller retires the
        worker: alone, a worker cannot know that a decode worker is left to take them (a whole
        deployment ending drains every one of them at once)."""
        done = await asyncio.gather(self.prefill.drain(grace_s), self.decode.drain(grace_s))
        return all(done)

    # ---- the switch ----------------------------------------------------------------
    async def set_role(self, role: str, grace_s: float, reason: str = "") -> Switched:
        """Close the old role, let what it runs finish within ``grace_s`` (then hand over the
        decode streams left), open ``role``. One switch at a time; the same role again is a
        no-op. Raises ValueError for an unknown role."""
        new = self.part(role)
        if self._switching is None:
            self._switching = asyncio.Lock()
        async with self._switching:
            start, previous = time.monotonic(), self.role
            if role == previous:
                return Switched(role, previous, True, 0, len(self.prefill.leases), 0.0)
            old = self.part(previous)
            if old is new:  # decode <-> mixed: the same core stays open, only the router's use of it changes
                self.role = role
                return Switched(role, previous, True, 0, len(self.prefill.leases), time.monotonic() - start)
            self._close(old, role)
            idle = await old.drain(grace_s)
            handed_over = moved = 0
            if not idle and old is self.decode:
                handed_over, moved = await self.decode.hand_over_streams(
                    f"worker {self.config.worker_id} changes its role to {role}", self._keep if self.address else None)
            self.role = role
            new.draining = False
            switched = Switched(role, previous, idle, handed_over, len(self.prefill.leases), time.monotonic() - start,
                                moved)
        log.info("%s: role %s -> %s (%s) in %.3f s%s", self.config.worker_id, previous, role, reason or "no reason given",
                 switched.seconds, "" if idle else f", past the grace: {handed_over} stream(s) handed over "
                 f"({moved} with their KV), {switched.leases_left} lease(s) left to their holders")
        return switched

    def _keep(self, request_id: str) -> KVHandle | None:
        """Engine thread: a decoding stream handed over keeps its KV here, under a lease of the
        prefill core's (whose ``Claim`` and reads are served in every role), for the decode
        worker the router moves it to. The KV covers the prompt and every token sent but the
        newest, from which the next worker decodes on. None where the stream has no whole KV
        (its prompt or its KV still on the way): it is re-prefilled."""
        kept = self.engine.hold_running(request_id)
        if kept is None:
            return None
        block_ids, num_tokens = kept
        lease = self.prefill.adopt(request_id, block_ids, num_tokens)
        return KVHandle.of_lease(self.address, lease, num_tokens)

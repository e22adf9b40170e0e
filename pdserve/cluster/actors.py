"""The process that hosts one role of a cluster on Ray: a prefill worker, a decode worker or
the router, each its own Ray actor (``ServerActor``), started and supervised by the controller
(``pdserve.cluster.local.LocalCluster``)."""

from __future__ import annotations

import dataclasses

import logging
import os
import signal
import threading

import ray

from pdserve.cluster.placement import PoolPlacement
from pdserve.cluster.settings import DRAIN_GRACE_SECONDS
from pdserve.wire.logs import LogConfig, configure

log = logging.getLogger(__name__)


def _start_role(role: str, config):
    """The coroutine factory that starts ``role``'s server inside its actor (an elastic
    worker's, whichever pool it starts in, when its config is one)."""
    from pdserve.elastic_worker.worker import ElasticWorkerConfig

    if isinstance(config, ElasticWorkerConfig):
        from pdserve.elastic_worker.server import start
    elif role == "prefill":
        from pdserve.prefill_worker.server import start
    elif role == "decode":
        from pdserve.decode_worker.server import start
    elif role == "router":
        from pdserve.router.server import start
    else:
        raise ValueError(f"unknown role {role!r}")
    return start(config)


def normal_priority() -> None:
    """Every thread of this process at niceness 0 (Linux keeps a niceness per thread, and new
    threads take their creator's). A Ray this cluster started already runs its workers at 0
    (pdserve/cluster/ray_start.py); on another Ray, whose workers start at 15, raising the priority
    needs CAP_SYS_NICE, and without it the worker stays where Ray put it, with a warning."""
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except PermissionError:
            log.warning("this worker runs at niceness %d: raising it to 0 needs CAP_SYS_NICE (or start the "
                        "Ray nodes with RAY_worker_niceness=0)", os.getpriority(os.PRIO_PROCESS, 0))
            return


@ray.remote(num_cpus=0)
class ServerActor:
    """One role (prefill worker, decode worker or router) in its own process."""

    def __init__(self, role: str, config, threads: int | None = None, log_config: LogConfig = LogConfig(),
                 placement: PoolPlacement | None = None):
        import torch

        from pdserve.wire.server import ServerThread

        self._spec = (role, config, threads, placement)  # what ``describe`` tells a controller that adopts it
        normal_priority()
        if threads:
            torch.set_num_threads(threads)
        configure(log_config, getattr(config, "worker_id", role))
        self._server = ServerThread(lambda: _start_role(role, self._spec[1]), name=role)
        # An actor's own SIGTERM (its node or pod stopping) drains within the setting's default:
        # the cluster's stop, which ``--drain-grace-seconds`` sets, drains the router instead.
        self._drain_grace_s = DRAIN_GRACE_SECONDS.default
        if threading.current_thread() is threading.main_thread():
            # Ray's own handler ends the process at once; a worker drains first, as the plain
            # process does (cluster.worker_process): what Kubernetes' SIGTERM to a pod means.
            signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=self._drain_and_exit, daemon=True).start())

    def start(self, config=None) -> str:
        """Start the role's server; ``config``, when given, replaces the one the actor was made
        with (a router made while its workers' addresses were still unknown). Returns its address."""
        if config is not None:
            self._spec = (self._spec[0], config, *self._spec[2:])
        return self._server.start()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def http_address(self) -> str | None:
        return self._server.running.http_address

    def internal_address(self) -> str:
        """The router's internal plane (RouterAdmin); a worker's only address is internal."""
        return self._server.running.internal_address or self._server.running.address

    def pid(self) -> int:
        return os.getpid()

    def inject_fault(self, fault: str, on: bool = True, delay_s: float = 0.0) -> int:
        """Test-only fault injection (tests/conformance; docs/reliability.md), switched on or off
        at run time in this one worker: ``never_answer`` (a prefill worker accepts Prefill calls
        and never answers them), ``holder_stall`` (its tcp block server accepts reads and never
        sends), ``reader_stall`` (its tcp reads never receive), ``read_delay`` (each KV read its
        agents start from now on is posted ``delay_s`` after its claim, as the config's
        ``inject_transfer_delay_s`` does from the start; off: at once). Never used in serving.
        Returns how many calls ``never_answer`` has left unanswered in this worker so far (0 for
        the others, whose reads fail and are counted by the reader)."""
        worker = self._server.running.worker
        if fault == "never_answer" and hasattr(worker, "inject_never_answer"):
            worker.inject_never_answer = on
            return worker.never_answered
        agents = getattr(getattr(worker, "agent", None), "agents", ())
        if fault == "read_delay" and agents and all(hasattr(a, "inject_delay_s") for a in agents):
            if on and not delay_s > 0:
                raise ValueError(f"read_delay: delay_s must be above 0, got {delay_s!r}")
            for agent in agents:
                agent.inject_delay_s = float(delay_s) if on else 0.0
            return 0
        if fault in ("holder_stall", "reader_stall") and agents and all(hasattr(a, f"inject_{fault}") for a in agents):
            for agent in agents:
                setattr(agent, f"inject_{fault}", on)
            return 0
        raise ValueError(f"fault {fault!r}: this {self._spec[0]} worker has no such injection "
                         "(never_answer: prefill workers; holder_stall, reader_stall: the tcp KV backend; "
                         "read_delay: agents in the worker's own process)")

    def retag(self, role: str) -> None:
        """An elastic worker switched to ``role`` (``pdserve.cluster.roles``): ``describe`` says so
        from now on, so that a controller that adopts it files it under its pool, and a
        replacement of it starts in that role."""
        _, config, threads, placement = self._spec
        self._spec = (role, dataclasses.replace(config, role=role) if hasattr(config, "role") else config, threads,
                      placement)

    def describe(self) -> dict:
        """What a restarted controller needs to take this actor over (``LocalCluster.adopt``)."""
        role, config, threads, placement = self._spec
        running = self._server.running
        return {"role": role, "config": config, "threads": threads, "placement": placement,
                "group": ray.util.get_current_placement_group(), "address": running.address, "http_address": running.http_address,
                "internal_address": running.internal_address or running.address}

    def drain(self, grace_s: float) -> int:
        """The router's drain (see ``GenerationService.drain``); workers have none here."""
        service = self._server.running.service
        return self._server.submit(service.drain(grace_s)) if hasattr(service, "drain") else 0

    def ready(self) -> bool:
        """A router: whether it would take traffic now (its readiness: a routable worker in
        each pool, not draining). A worker serves once ``start`` has returned."""
        service = self._server.running.service
        if not hasattr(service, "pool"):
            return True
        return service.pool.ready() and not service.draining and not service.unready

    def hand_over(self, unready_s: float, grace_s: float) -> int:
        """A router replaced in a rolling restart (``pdserve.router.handover``): readiness
        false, stop listening, let its streams finish within ``grace_s``, stop. Returns how
        many requests were cut at the grace's end."""
        from pdserve.router.handover import hand_over

        left = self._server.submit(hand_over(self._server.running, unready_s, grace_s))
        self._server.stop()
        return left

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving; RPCs still running get ``grace_s`` to finish, then are cut (their
        streams fail over: the router migrates them)."""
        self._server.stop(grace_s)

    def _drain_and_exit(self) -> None:
        """SIGTERM: health NOT_SERVING, no new requests, in-flight ones finish within the
        grace period; then the process exits 0 (the supervisor starts a replacement)."""
        running = self._server.running
        try:
            if running is not None and running.drain is not None:
                self._server.submit(running.drain(self._drain_grace_s))
            elif running is not None and hasattr(running.service, "drain"):  # the router
                self._server.submit(running.service.drain(self._drain_grace_s))
                self._server.stop()
        finally:
            os._exit(0)

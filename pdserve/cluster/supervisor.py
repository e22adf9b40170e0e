"""The controller's supervisor: it keeps every worker slot of a ``LocalCluster`` filled with
a live worker, and the router's routing table true."""

from __future__ import annotations

import logging
import os
import signal
import time

import ray

from pdserve.cluster.round_loop import RoundLoop
from pdserve.router.liveness import Liveness, is_hung, observe
from pdserve.elastic_worker.roles import POOL
from pdserve.wire.grpc_util import channel
from pdserve.wire.tls import TlsConfig

log = logging.getLogger(__name__)


class Supervisor(RoundLoop):
    """Keeps the router and every worker slot alive, and the router's table true. A router whose
    process died is started again on the same ports (``LocalCluster.restart_router``). A worker whose process died,
    or that hangs (``pdserve.router.liveness``: its engine makes no progress while it holds work, or it
    stops answering, or it keeps KV quarantined past its bound, for ``hang_timeout_s``), leaves the
    router's table at once; a hung one is killed; then a new one starts in its slot (in a new placement group) and joins it. Every
    round re-sends the membership."""

    name = "supervisor"

    def __init__(self, cluster, interval_s: float):
        super().__init__(interval_s)
        self.cluster = cluster
        self.replaced = 0
        self.hung_killed = 0
        self.routers_restarted = 0
        self._liveness: dict[str, Liveness] = {}  # by worker address
        self._processes: dict[str, tuple[int, str]] = {}  # address -> (pid, Ray node id), once it answered

    def round(self) -> None:
        self.check_once()

    def hung_slots(self) -> list[tuple[str, int]]:
        """Slots whose worker is hung, from one ``Stats`` poll of every worker."""
        hang_s = self.cluster.config.hang_timeout_s
        hung, seen = [], set()
        for role in ("prefill", "decode"):
            for index, address in enumerate(self.cluster.addresses(role)):
                stats = worker_stats(role, address, self.cluster.config.tls_for("controller"), timeout_s=min(2.0, hang_s))
                now = time.monotonic()
                seen.add(address)
                self._liveness[address] = observe(self._liveness.get(address), now, stats is not None,
                                                  stats.engine_steps if stats else 0,
                                                  stats.engine_busy if stats else False,
                                                  stats.kv_quarantined_blocks if stats else 0,
                                                  stats.num_blocks_total if stats else 0)
                if is_hung(self._liveness[address], now, hang_s):
                    hung.append((role, index))
        for address in set(self._liveness) - seen:
            del self._liveness[address]
        return hung

    def router_dead(self) -> bool:
        try:
            ray.get(self.cluster.router.pid.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass  # busy or slow, not known dead
        return False

    def dead_slots(self, skip: frozenset[tuple[str, int]] = frozenset()) -> list[tuple[str, int]]:
        """Slots whose worker's process is gone. Every worker is asked for its pid at once, with
        one deadline for all (5 s, or half the hang timeout where that is shorter): a stopped or
        busy worker costs the round that deadline once, not 5 s each, and a hung worker is still
        judged by ``hung_slots``. Asked one by one, a stopped worker's unanswered ask made every
        round 2 s of poll plus 5 s, and a hang was found some 9.5 s after it began."""
        asks = {}
        for role in ("prefill", "decode"):
            for index, actor in enumerate(self.cluster.actors(role)):
                if (role, index) not in skip:
                    asks[(role, index)] = (actor, actor.pid.remote())
        if not asks:
            return []
        refs = [ref for _, ref in asks.values()]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=min(5.0, self.cluster.config.hang_timeout_s / 2))
        answered = set(answered)
        dead = []
        for (role, index), (actor, ref) in asks.items():
            if ref not in answered:
                continue  # busy or slow, not known dead (hung_slots judges that)
            address = self.cluster.addresses(role)[index]
            try:
                pid = ray.get(ref)
                if address not in self._processes:
                    self._processes[address] = (pid, ray.get(actor.node_id.remote(), timeout=5))
            except ray.exceptions.RayActorError:
                dead.append((role, index))
            except ray.exceptions.GetTimeoutError:
                pass  # its node id not told in time: asked again next round
        return dead

    def check_once(self) -> None:
        """Replace dead and hung workers, and re-assert the membership in any case: the router's
        table is the controller's word, so a router restarted (empty) or told otherwise by anyone
        else is back to the true membership within one round."""
        with self.cluster.lock:
            if self._stop.is_set():
                return
            if self.router_dead():
                log.warning("the router died; starting a new one on the same ports")
                self.cluster.restart_router()
                self.routers_restarted += 1
            hung = self.hung_slots()
            dead = self.dead_slots(frozenset(hung))
            if not dead and not hung:
                self.cluster.push_membership()
                return
            gone = {self.cluster.addresses(role)[index] for role, index in dead + hung}
            log.warning("workers died: %s, hung: %s; replacing",
                        sorted(self.cluster.addresses(r)[i] for r, i in dead),
                        sorted(self.cluster.addresses(r)[i] for r, i in hung))
            self.cluster.push_membership(exclude=gone)
            for role, index in hung:
                self._kill(self.cluster.addresses(role)[index], self.cluster.actors(role)[index])
            for role, index in dead + hung:
                if self._stop.is_set():  # the cluster began to stop during this round
                    return
                self._processes.pop(self.cluster.addresses(role)[index], None)
                self.cluster.replace(role, index)
                self.replaced += 1
            self.cluster.push_membership()

    def _kill(self, address: str, actor) -> None:
        """End a hung worker for good. Ray's kill asks the actor's process to exit, which a
        stopped process never reads; on this node its pid is SIGKILLed as well."""
        self.hung_killed += 1
        pid, node = self._processes.get(address, (None, None))
        if pid is not None and node == ray.get_runtime_context().get_node_id():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.kill(actor, no_restart=True)


def worker_stats(role: str, address: str, tls: TlsConfig | None, timeout_s: float):
    """One ``Stats`` answer, or None if the worker did not answer in time."""
    import grpc

    from pdserve.protos import worker_pb2, worker_pb2_grpc

    stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    try:
        with channel(address, tls, peer=POOL.get(role, role)) as ch:
            return stub_cls(ch).Stats(worker_pb2.StatsRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None

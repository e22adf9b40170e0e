"""Draining one worker over its own RPCs, as the controller does before it stops one
(``LocalCluster.retire``: scale-down, rollout)."""

from __future__ import annotations

import logging
import time

from pdserve.elastic_worker.roles import POOL
from pdserve.wire.grpc_util import channel

log = logging.getLogger(__name__)


def drain_worker(role: str, address: str, tls, timeout_s: float) -> bool:
    """Ask the ``role`` worker at ``address`` to drain (``tls``: the controller's client TLS, or
    None); whether it went idle (no request, no held KV) within ``timeout_s``."""
    from pdserve.protos import worker_pb2, worker_pb2_grpc

    stub_cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    deadline = time.monotonic() + timeout_s
    with channel(address, tls, peer=POOL.get(role, role)) as ch:
        stub = stub_cls(ch)
        stats = stub.Drain(worker_pb2.DrainRequest(), timeout=10)
        while stats.num_in_flight:  # not running + waiting + held: those have a gap (worker.proto)
            if time.monotonic() > deadline:
                log.warning("%s still busy after %.0f s of draining; stopping it anyway", address, timeout_s)
                return False
            time.sleep(0.2)
            stats = stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    return True

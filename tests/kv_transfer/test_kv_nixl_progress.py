"""A NIXL agent must not burn a core while idle: nixl_cu12's own UCX progress thread
busy-polls (its poll delay is fixed at 0), so NixlAgent drives progress itself."""

import resource
import threading
import time

from kv_helpers import make_cache

from pdserve.kv_transfer import create_agent


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_idle_nixl_agent_uses_little_cpu_and_close_stops_its_thread():
    agent = create_agent("nixl", "idle", make_cache(4))
    try:
        start = _cpu_seconds()
        time.sleep(0.5)
        # A spinning progress thread would cost ~0.5 s here; ours ticks each millisecond.
        assert _cpu_seconds() - start < 0.2
    finally:
        agent.close()
    assert not any(t.name == "kv-nixl-progress-idle" for t in threading.enumerate())

"""Autoscaling end to end: long prompts with short outputs grow the prefill pool and not the
decode pool; long outputs grow decode and not prefill; a latency over its SLO alone grows its
pool; when the load stops, each pool drains back to its minimum. Every request completes,
the scale-down included. Windows and cooldowns are seconds here, not minutes.

On this one 2-core machine both pools share the CPUs, so one pool's load slows the other's
latency (the interference disaggregation removes on real hosts). The queue and KV tests
therefore set SLOs no latency here reaches, and the latency test sets one SLO below any."""

import asyncio
import time

import pytest

from pdserve.cluster.autoscaling import pool_config
from pdserve.router.limits import RouterLimits
from tests.clusters import cluster_config, running_cluster
from tests.helpers.autoscale_load import FAST, send_load

pytestmark = pytest.mark.slow

QUEUE_AND_KV = {"prefill": pool_config("prefill", target=300, **FAST),
                "decode": pool_config("decode", target=0.5, **FAST)}


@pytest.fixture(scope="module")
def cluster():
    # 96 MiB of KV per worker: ~4,200 tokens in bfloat16 (the default), so about two dozen
    # long streams fill a decode worker. Admission waits up to 240 s (the default is 30): on an
    # AVX2-only EPYC (Zen 3) the long-prompt burst's last prompts waited longer than 30 s for
    # decode KV and were refused, which is the admission limit's promise, not autoscaling's.
    limits = RouterLimits(admission_wait_s=240.0)
    with running_cluster(cluster_config(kv_mib=96, http_port=None, autoscale_interval_s=0.5, router_limits=limits,
                                        autoscaling=dict(QUEUE_AND_KV))) as c:
        yield c


def test_long_prompts_grow_prefill_only_and_idle_shrinks_it(cluster):
    # 600-token prompts every 0.075 s for 3 s: 8,000 prompt tokens a second, more than one
    # prefill worker does on any of this project's processors. The load has had to grow with
    # the kernels: every 0.6 s queued up on AVX2 but an AMX prefill kept up; every 0.15 s
    # (4,000 a second) queued up until attention moved to AMX tiles, and then one prefill
    # worker, borrowing the idle decode core, kept up again. A slower processor only queues more.
    counts = asyncio.run(send_load(cluster.address, n=40, every_s=0.075, prompt_len=600))
    assert counts == [3] * 40  # every request completed in full, through the scale-up
    traces = cluster.autoscaler.traces
    assert max(s.replicas for s in traces["prefill"].samples) == 2
    assert max(s.replicas for s in traces["decode"].samples) == 1
    assert all(d.action == "hold" for d in traces["decode"].decisions)
    shrunk(cluster, "prefill")
    assert [d.action for d in traces["prefill"].decisions if d.action != "hold"] == ["up", "down"]


def shrunk(cluster, pool: str, timeout_s: float = 120.0) -> None:
    """Until ``pool`` is back at one worker after its last scale-up: its last decision that
    changed anything a "down", and one slot left. The count alone is not enough: a worker still
    starting has no slot yet (it gets one once it serves), so right after an "up" the pool
    would look shrunk already."""
    trace = cluster.autoscaler.traces[pool]
    deadline = time.monotonic() + timeout_s
    while True:
        changes = [d.action for d in trace.decisions if d.action != "hold"]
        if len(cluster.actors(pool)) == 1 and changes[-1:] in ([], ["down"]):
            return
        assert time.monotonic() < deadline, f"the {pool} pool did not shrink back"
        time.sleep(0.5)


def test_long_outputs_grow_decode_only_and_idle_shrinks_it(cluster):
    prefill_before = len(cluster.autoscaler.traces["prefill"].decisions)
    decode_before = len(cluster.autoscaler.traces["decode"].decisions)
    # 28 streams: sized for bfloat16 KV (14 filled the same cache in float32, half the tokens).
    counts = asyncio.run(send_load(cluster.address, n=28, every_s=0.3, prompt_len=30, max_tokens=200))
    assert counts == [200] * 28
    traces = cluster.autoscaler.traces
    decode_actions = [d.action for d in traces["decode"].decisions[decode_before:] if d.action != "hold"]
    assert decode_actions[:1] == ["up"]
    assert all(d.action == "hold" for d in traces["prefill"].decisions[prefill_before:])
    shrunk(cluster, "decode")


@pytest.mark.parametrize("pool,signal", [("prefill", "ttft_p90_s"), ("decode", "itl_p90_s")])
def test_a_latency_over_its_slo_alone_grows_its_pool(cluster, pool, signal):
    """Short requests, far below the queue and KV targets; only ``pool``'s SLO is (far) exceeded."""
    autoscaler = cluster.autoscaler
    first = len(autoscaler.traces[pool].samples)
    autoscaler.configs[pool] = pool_config(pool, target=1e9 if pool == "prefill" else 0.99,
                                           **{**FAST, "slo_s": 1e-4})
    try:
        counts = asyncio.run(send_load(cluster.address, n=12, every_s=0.4, prompt_len=30, max_tokens=8))
        assert counts == [8] * 12
        trace = autoscaler.traces[pool]
        seen = [getattr(s, signal) for s in trace.samples[first:] if getattr(s, signal) is not None]
        assert seen and all(v > 0 for v in seen)  # the router's latencies reached the controller
        ups = [d for d in trace.decisions[first:] if d.action == "up"]  # one decision per sample
        assert ups and signal in ups[0].reason
        other = "decode" if pool == "prefill" else "prefill"
        assert max(s.replicas for s in autoscaler.traces[other].samples[first:]) == 1
    finally:
        autoscaler.configs[pool] = QUEUE_AND_KV[pool]
    shrunk(cluster, pool)

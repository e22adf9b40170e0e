"""The KV tier in the simulator (pdserve/planner/prefix_cache.py): its hit rate is the LRU's over
the request stream, shared by a host's workers, and a hit costs its load instead of its compute."""

import dataclasses

import numpy as np
import pytest

from pdserve.cli import main
from pdserve.planner.cost import CostError, CostModel
from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.prefix_cache import HostTier, HostTiers
from pdserve.planner.simulator import Simulator
from pdserve.planner.trace import TraceRequest
from tests.planner.helpers import DEVICE, TINY

KV_TOKENS = 1024  # one worker's KV memory: 64 blocks of 16 tokens; its prefix index holds half
PREFIX, SUFFIX = 256, 16  # a prefix of 16 blocks; the working set below is 4x the KV memory
NUM_PREFIXES = 4 * KV_TOKENS // PREFIX


def small_cost(devices_per_node: int = 8) -> CostModel:
    """TINY (256 KV bytes a token, 4,096 a block) with room for exactly ``KV_TOKENS`` of KV."""
    weights = CostModel(TINY, DEVICE).streamed_weight_bytes(1)
    # overlap off: the whole memory is the worker's (no GPU memory utilization share)
    hw = dataclasses.replace(DEVICE, mem_bytes=weights + KV_TOKENS * 256, overlap=False,
                             devices_per_node=devices_per_node)
    return CostModel(TINY, hw)


def block_bytes() -> float:
    return small_cost().kv_bytes_per_token * 16


def revisited(rounds: int = 3, num_prefixes: int = NUM_PREFIXES) -> list[TraceRequest]:
    """Every prefix once, in the same order, ``rounds`` times (one answer token each)."""
    return [TraceRequest(float(i), PREFIX + SUFFIX, 1, f"p{i % num_prefixes}", PREFIX)
            for i in range(rounds * num_prefixes)]


def run(reqs, tier_bytes: int = 0, layout: Layout = Layout(colocated=1), devices_per_node: int = 8):
    c = small_cost(devices_per_node)
    spec = ClusterSpec(layout, c, c, kv_offload_bytes=tier_bytes)
    return Simulator(spec, reqs, closed_loop=1).run()  # one client: no queueing, TTFT is the prompt's step


def cached_share(result, only=None) -> float:
    return sum(result.cache.shares(only))


def test_a_working_set_4x_the_kv_memory_hits_nothing_without_the_tier_and_most_with_one():
    reqs = revisited()
    without = run(reqs)
    assert cached_share(without) == 0.0  # every prefix left the worker's index before it came back
    big = 2 * NUM_PREFIXES * PREFIX // 16 * int(block_bytes())  # room for the working set twice
    tier = run(reqs, big)
    revisit = tier.cache.revisit
    assert revisit.sum() == 2 * NUM_PREFIXES
    device, loaded = tier.cache.shares(revisit)
    assert device == 0.0 and loaded == pytest.approx(PREFIX / (PREFIX + SUFFIX))  # every full prefix block
    assert (tier.cache.tier_hit[~revisit] == 0).all()  # the first visits computed theirs
    assert np.median(tier.ttft[revisit]) < np.median(without.ttft[revisit])  # by how much: the next tests


def test_a_tier_too_small_for_the_working_set_hits_less():
    reqs = revisited()
    per_prefix = PREFIX // 16 * int(block_bytes())
    # The tier keeps what it gives back (the engine's store keeps the file), so the prefixes in
    # the workers' index are in it too: it must hold the whole working set for a cycle to hit ...
    whole = run(reqs, NUM_PREFIXES * per_prefix)
    assert cached_share(whole, whole.cache.revisit) == pytest.approx(PREFIX / (PREFIX + SUFFIX))
    # ... one prefix fewer and the least recently used leaves before its turn now and then ...
    one_short = run(reqs, (NUM_PREFIXES - 1) * per_prefix)
    assert 0 < cached_share(one_short) < cached_share(whole)
    # ... and half of it never hits: each prefix leaves just before it comes back
    half = run(reqs, NUM_PREFIXES // 2 * per_prefix)
    assert cached_share(half) == 0.0
    assert half.cache.blocks_offloaded > 0 and half.cache.blocks_loaded == 0
    # visited in random order, the half tier hits some, fewer than the whole one
    rng = np.random.default_rng(0)
    shuffled = [dataclasses.replace(r, prefix_hash=f"p{rng.integers(NUM_PREFIXES)}") for r in reqs]
    some, all_of_it = run(shuffled, NUM_PREFIXES // 2 * per_prefix), run(shuffled, NUM_PREFIXES * per_prefix)
    assert 0 < cached_share(some) < cached_share(all_of_it)


def test_a_tier_hit_costs_its_load_instead_of_its_compute():
    c = small_cost()
    # p0, then enough other prefixes to push p0 out of the worker's index into the tier, then p0 again
    names = ["p0", "p1", "p2", "p3", "p0"]
    reqs = [TraceRequest(float(i), PREFIX + SUFFIX, 1, name, PREFIX) for i, name in enumerate(names)]
    without, tier = run(reqs), run(reqs, 10**7)
    assert tier.cache.tier_hit.tolist() == [0, 0, 0, 0, PREFIX]
    assert without.ttft[-1] == pytest.approx(c.prefill_s([(PREFIX + SUFFIX, 0)]))
    hit = c.prefill_s([(SUFFIX, PREFIX)])  # the suffix, attending to the loaded prefix
    load = c.tier_load_s(PREFIX)
    assert load == PREFIX * 256 / DEVICE.kv_tier_bw
    assert tier.ttft[-1] == pytest.approx(hit + load)
    c10 = CostModel(TINY, dataclasses.replace(c.hw, kv_tier_bw=c.hw.kv_tier_bw / 10))  # a tenth the rate
    slow = Simulator(ClusterSpec(Layout(colocated=1), c10, c10, kv_offload_bytes=10**7), reqs, closed_loop=1).run()
    assert slow.ttft[-1] == pytest.approx(hit + 10 * load)


def test_the_workers_of_a_host_share_its_tier():
    # 15 prefixes over 2 workers taking turns: a prefix comes back to the other worker
    reqs = revisited(rounds=2, num_prefixes=15)
    big = 10**8
    shared = run(reqs, big, Layout(colocated=2), devices_per_node=8)
    apart = run(reqs, big, Layout(colocated=2), devices_per_node=1)  # one worker a host: two tiers
    assert shared.cache.hosts == 1 and apart.cache.hosts == 2
    second = shared.cache.revisit
    assert cached_share(shared, second) > 0.9
    assert cached_share(apart, second) < cached_share(shared, second) / 2


def test_hosts_are_filled_in_the_order_workers_start():
    hosts = HostTiers(10**6, 4096.0, devices_per_node=4)
    tiers = [hosts.place(d) for d in (1, 2, 1, 2, 4, 1)]
    assert [hosts.tiers.index(t) for t in tiers] == [0, 0, 0, 1, 2, 3]


def test_the_tier_keeps_the_most_recently_used_prefixes():
    tier = HostTier(capacity_bytes=10 * 4096, block_bytes=4096.0)
    tier.offload("a", 4)
    tier.offload("b", 4)
    assert tier.load("a", 4) == 4  # a is now the newer
    tier.offload("c", 4)  # 12 blocks > 10: the least recently used (b) leaves
    assert tier.load("b", 4) == 0 and tier.load("a", 2) == 2 and tier.load("c", 4) == 4
    assert tier.used_blocks == 8 and tier.bytes_used == 8 * 4096
    tier.offload("huge", 11)  # larger than the whole tier: not kept, nothing else lost
    assert tier.load("huge", 11) == 0 and tier.used_blocks == 8
    assert (tier.blocks_offloaded, tier.blocks_loaded) == (12, 10)


def test_a_trace_without_prefixes_runs_the_same_with_a_tier():
    reqs = [TraceRequest(0.05 * i, 100 + 7 * i, 3 + i % 5) for i in range(40)]
    c = small_cost()
    a = Simulator(ClusterSpec(Layout(1, 1), c, c), reqs).run()
    b = Simulator(ClusterSpec(Layout(1, 1), c, c, kv_offload_bytes=10**7), reqs).run()
    for name in ("first_token", "finish", "itl_values", "itl_weights"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def test_the_tier_is_refused_where_the_engine_refuses_it():
    c = small_cost()
    with pytest.raises(CostError, match="kv_offload_bytes: must be >= 0"):
        ClusterSpec(Layout(colocated=1), c, c, kv_offload_bytes=-1)
    c2 = CostModel(TINY, c.hw, 2)
    with pytest.raises(CostError, match="kv_offload_bytes: the KV tier runs at TP1 only"):
        ClusterSpec(Layout(1, 1, 0, 2, 2), c2, c2, kv_offload_bytes=10**6)
    from pdserve.planner.worker import EngineLimits

    with pytest.raises(CostError, match="kv_offload_bytes: the KV tier needs the prefix cache"):
        ClusterSpec(Layout(colocated=1), c, c, EngineLimits(enable_prefix_cache=False), kv_offload_bytes=10**6)


def test_cli_reports_the_tier_hit_rate_next_to_the_prefix_cache(capsys):
    args = ["plan", "--model", "SmolLM2-135M", "--hardware", "cpu", "--layout", "1P:1D", "--rate", "0.05",
            "--requests", "40", "--prompt-mean", "64", "--output-mean", "8", "--sigma", "0",
            "--prefixes", "12", "--prefix-tokens", "2048", "--prefix-order", "cyclic"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cached prompt tokens: 0.0% from workers' prefix caches, no KV tier" in out
    assert main(args + ["--kv-offload-bytes", str(10**9)]) == 0
    out = capsys.readouterr().out
    assert "% from the KV tier (1 GB a host, 1 host(s)" in out
    line = next(x for x in out.splitlines() if "on revisits" in x)
    assert "97.0% cached (0.0% prefix cache + 97.0% KV tier)" in line  # 2048 of each 2112-token prompt
    assert main(args + ["--kv-offload-bytes", "-5"]) == 2
    assert "kv_offload_bytes: must be >= 0" in capsys.readouterr().err
    assert main(args[:5] + ["--layout", "1P:1D:TP3", "--kv-offload-bytes", "1000"]) == 2
    assert "KV tier (--kv-offload-bytes) runs at TP1 only" in capsys.readouterr().err
    assert main(["plan", "--trace", "t.jsonl", "--prefixes", "3", "--prefix-tokens", "64"]) == 2
    assert "--prefixes: not with --trace" in capsys.readouterr().err


def test_the_tier_load_probe_measures_a_rate_and_leaves_nothing(tmp_path):
    from pdserve.planner.profile import tier_load_bandwidth

    rate = tier_load_bandwidth(368_640, blocks=8, directory=str(tmp_path))
    assert 1e7 < rate < 1e12  # bytes/s: between a slow disk and more than memory gives
    assert list(tmp_path.iterdir()) == []

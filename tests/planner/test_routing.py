"""Routing over the one worker that can win makes the same choices as over the whole pool."""

import numpy as np
import pytest

from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.simulator import Simulator
from pdserve.planner.worker import EngineLimits
from tests.planner.helpers import cost, requests


@pytest.mark.parametrize("layout", [Layout(prefill=3, decode=4), Layout(colocated=5)])
def test_indexed_routing_equals_the_full_scan(layout):
    rng = np.random.default_rng(1)
    n = 400
    reqs = requests(*[(float(t), int(p), int(o)) for t, p, o in
                      zip(np.sort(rng.uniform(0, 4, n)), rng.integers(1, 3000, n), rng.integers(1, 300, n))])
    spec = ClusterSpec(layout, cost(), cost(), EngineLimits(max_num_seqs=32, max_num_batched_tokens=1024),
                       max_queued_tokens=20_000)
    fast = Simulator(spec, reqs).run()
    full = Simulator(spec, reqs, full_scan=True).run()
    np.testing.assert_array_equal(fast.first_token, full.first_token)
    np.testing.assert_array_equal(fast.finish, full.finish)
    assert fast.failed == full.failed


def test_the_index_stays_the_size_of_the_pool_and_still_finds_the_minimum():
    from pdserve.planner.routing import RoutingIndex

    class W:
        def __init__(self, wid):
            self.wid, self.load = wid, 0

    workers = [W(f"w{i}") for i in range(10)]
    index = RoutingIndex(lambda w: (w.load, w.wid))
    rng = np.random.default_rng(0)
    for w in workers:
        index.touch(w)
    for _ in range(5000):
        w = workers[rng.integers(len(workers))]
        w.load = int(rng.integers(0, 100))
        index.touch(w)
        index.touch(w)  # an unchanged key adds nothing
        assert index.best() is min(workers, key=lambda x: (x.load, x.wid))
    assert len(index._heap) <= 4 * len(workers) + 64
    gone = index.best()
    index.remove(gone)
    assert index.best() is min((w for w in workers if w is not gone), key=lambda x: (x.load, x.wid))

"""Routing over the one worker that can win makes the same choices as over the whole pool."""

import numpy as np
import pytest

from planner.simulator import ClusterSpec, Layout, Simulator
from planner.worker import EngineLimits
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

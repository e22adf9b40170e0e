"""Worker deaths and hangs under a steady load (``tests.helpers.under_load`` says what is caused
and checked): a decode worker SIGKILLed mid-stream, a decode worker SIGSTOPped (a hang, not a
death), a prefill worker SIGKILLed while a KV read from it is in flight, and the router
SIGKILLed. Every request completes with exactly the tokens of an undisturbed run, or ends with
a clear error before its deadline; only the router's death may end requests. Then no surviving
worker holds a block, and every dead or hung process was replaced. (At two ranks per worker:
tests/faults/test_under_load.py.)"""

import pytest

from tests.helpers.under_load import lose_nothing_under_faults, sigterm_drains_then_replaced

pytestmark = pytest.mark.slow


def test_nothing_is_lost_under_faults_and_steady_load(cluster, stub, undisturbed_ids):
    lose_nothing_under_faults(cluster, stub, kill_router=True, reference=undisturbed_ids)


def test_sigterm_drains_a_ray_worker_actor_then_it_is_replaced(cluster, stub):
    sigterm_drains_then_replaced(cluster, stub)

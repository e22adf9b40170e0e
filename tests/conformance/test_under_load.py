"""Worker deaths and hangs under a steady load (``tests.helpers.under_load`` says what is caused
and checked): a decode worker SIGKILLed mid-stream, a decode worker SIGSTOPped (a hang, not a
death), a prefill worker SIGKILLed while a KV read from it is in flight, and the router
SIGKILLed. Every request completes with exactly the tokens of an undisturbed run, or ends with
a clear error before its deadline; only the router's death may end requests. Then no surviving
worker holds a block, and every dead or hung process was replaced. (At two ranks per worker:
tests/faults/test_under_load.py, which also holds the SIGTERM drain of a worker actor: the
actor's drain is the same code at one rank or two, and that run's rank 0 drains with its
follower stepping beside it, so one run keeps the promise for both.)"""

import pytest

from tests.helpers.under_load import lose_nothing_under_faults

pytestmark = pytest.mark.slow


def test_nothing_is_lost_under_faults_and_steady_load(cluster, stub, undisturbed_ids):
    lose_nothing_under_faults(cluster, stub, kill_router=True, reference=undisturbed_ids, delay_reads=True)


"""The one cluster of the fault-injection conformance suite (docs/reliability.md), shared by
every module here: the default model in float32 (served tokens compare token for token with an
undisturbed run), two prefill and two decode workers over the tcp KV backend, supervised (a
dead or hung worker is replaced), with the router's OpenAI HTTP front.

Each fault is caused in one worker at a time, at run time: a signal to its process, or a
test-only injection switched on in that worker (``ServerActor.inject_fault``), then off again,
so that the faults after it find the cluster as it was. Leases last far longer than any wait
here, so nothing passes by lease expiry; reads time out after ``TRANSFER_TIMEOUT_S``. Reads go
at once: the test that stops a holder while a read from it is open holds the reads back only
while it does (``tests.helpers.faults.reads_delayed``), so no other request pays the delay. Decode
workers keep no conversation KV (``decode_kv_reuse`` off; tests/serving/test_conversations.py
covers it): a repeated prompt would be prefilled where it is cached and move no KV, and every
request here is to meet the faults of a transfer."""

import pytest

from pdserve.router.limits import RouterLimits
from tests.clusters import cluster_config, reconnecting_stub, running_cluster
from tests.helpers.under_load import HANG_S, LEASE_S

TRANSFER_TIMEOUT_S = 3.0  # a stalled read fails this long after it was posted
# A prefill call unanswered this long (and past its prompt's measured pace) moves on; above the
# longest prefill step here (well under a second).
PREFILL_CALL_MIN_S = 3.0
STREAM_IDLE_S = 2.0  # an HTTP stream the client stopped reading ends this long after its last write


@pytest.fixture(scope="package")
def cluster():
    with running_cluster(cluster_config(
            dtype="float32", num_prefill=2, num_decode=2, lease_seconds=LEASE_S,
            kv_transfer_backend="tcp", transfer_timeout_s=TRANSFER_TIMEOUT_S,
            router_poll_s=0.2, supervise_interval_s=0.5, hang_timeout_s=HANG_S,
            router_limits=RouterLimits(stream_idle_timeout_s=STREAM_IDLE_S, decode_kv_reuse=False,
                                       prefill_call_min_s=PREFILL_CALL_MIN_S))) as c:
        yield c


@pytest.fixture(scope="package")
def stub(cluster):
    with reconnecting_stub(cluster.address) as stub:  # back within a second once the router is back
        yield stub


@pytest.fixture(scope="package")
def undisturbed_ids(stub):
    """``tests.helpers.under_load.PROMPTS``' greedy tokens before any fault here."""
    from tests.helpers.under_load import undisturbed

    return undisturbed(stub)

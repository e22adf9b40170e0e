"""The two-process fixtures of the kv_transfer tests: a holder agent in its own OS process
(``kv_helpers.Holder``, one per backend and module) and a reader agent in this one."""

import pytest
from kv_helpers import BACKENDS, Holder, make_cache

from pdserve.kv_transfer import create_agent


@pytest.fixture(scope="module", params=BACKENDS)
def holder(request):
    h = Holder(request.param)
    yield h
    h.stop()


@pytest.fixture
def reader(holder):
    agent = create_agent(holder.backend, "reader", make_cache(12))
    yield agent
    agent.close()

"""Tracing off (no ``--otlp-traces-endpoint``): no process of a served cluster imports the
OpenTelemetry SDK or exporter, or holds a tracer.

Its own module, so that the serving tests' shared cluster never lives beside
``test_tracing``'s traced one: a cluster that started Ray ends it when it stops, and would
take the shared cluster's actors with it.
"""

import pytest
import ray

from tests.helpers.chat import chat_request, collect

pytestmark = pytest.mark.slow


def test_with_no_endpoint_workers_never_import_the_sdk(cluster, stub):
    """The serving tests' shared cluster has no endpoint: after a request, no process of it has
    imported the OpenTelemetry SDK or exporter (nor does it hold a tracer)."""
    assert collect(stub.Generate(chat_request("Hi", 2), timeout=60))[0]

    def otel_state(actor):
        import sys

        from pdserve.wire import tracing

        return tracing.enabled(), sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk",
                                                                                 "opentelemetry.exporter")))

    for actor in [cluster.router, *cluster.prefill, *cluster.decode]:
        assert ray.get(actor.__ray_call__.remote(otel_state)) == (False, [])

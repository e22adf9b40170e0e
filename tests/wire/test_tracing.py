"""``pdserve.wire.tracing`` while off, as every process runs it without ``--otlp-traces-endpoint``."""

import subprocess
import sys

from pdserve.wire import tracing

# Every module on a request's path that makes spans when tracing is on.
REQUEST_PATH = ("pdserve.router.service", "pdserve.router.http_api", "pdserve.router.request_run",
                "pdserve.prefill_worker.service", "pdserve.decode_worker.service", "pdserve.shell.server")


def test_off_imports_nothing_of_opentelemetry():
    """In a fresh interpreter: the request path's modules loaded and tracing configured
    without an endpoint, no OpenTelemetry module has been imported."""
    code = ("import sys\n"
            f"for m in {REQUEST_PATH!r}: __import__(m)\n"
            "from pdserve.wire import tracing\n"
            "tracing.configure(None, 'router')\n"
            "assert not tracing.enabled()\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_off_helpers_make_nothing():
    assert not tracing.enabled()
    assert tracing.start_span("x") is None and tracing.record_span("x", None, 0.0, 1.0) is None
    assert tracing.inject(None) is None and tracing.metadata_kwargs(None) == {}
    assert tracing.extract((("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)) is None
    tracing.end_span(None, error="ignored")
    tracing.add_event(None, "ignored")

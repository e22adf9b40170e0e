"""One OpenTelemetry trace per request, across the real processes (``--otlp-traces-endpoint``).

The cluster's router, prefill worker and decode workers are Ray actor processes that export
with the OpenTelemetry SDK's own OTLP/gRPC exporter. They export to ``Receiver``, an OTLP
trace receiver run in this test: a gRPC server of the ``TraceService`` service that
opentelemetry-proto defines (``opentelemetry.proto.collector.trace.v1``), which is the wire
protocol a collector (the OpenTelemetry Collector, Jaeger, Tempo) speaks. No collector can run
here: Debian packages none, and PyPI has none.
"""

import collections
import os
import signal
import socket
import threading
import time
import urllib.request
import json
from concurrent import futures

import grpc
import pytest
import ray

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.protos import pdserve_pb2_grpc
from tests.helpers.chat import chat_request, collect
from tests.serving.conftest import start_cluster, worker_stats

pytestmark = pytest.mark.slow

CHUNK_TOKENS = 16  # the prefill chunk: the chat prompts below take several


class Receiver:
    """An OTLP/gRPC trace endpoint that keeps every span it is sent, flattened."""

    def __init__(self, port: int):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def take(self, request) -> None:
        out = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    out.append({"service": resource.get("service.name"), "name": s.name, "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                "attrs": {a.key: _value(a.value) for a in s.attributes},
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "error": s.status.code == 2, "events": [e.name for e in s.events]})
        with self.lock:
            self.spans += out

    def trace_of(self, request_id: str, until, timeout_s: float = 20.0) -> list[dict]:
        """The spans of the trace whose router span has ``request_id``, once ``until(spans)``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                roots = [s for s in self.spans if s["name"] == "router.request"
                         and s["attrs"].get("gen_ai.request.id") == request_id]
                spans = [s for s in self.spans if roots and s["trace"] == roots[0]["trace"]]
            if spans and until(spans):
                return spans
            assert time.monotonic() < deadline, f"no complete trace for {request_id}: {sorted(names(spans))}"
            time.sleep(0.2)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def names(spans) -> collections.Counter:
    return collections.Counter(s["name"] for s in spans)


def one(spans, name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, names(spans))
    return found[0]


def children(spans, parent: dict, name: str) -> list[dict]:
    return [s for s in spans if s["parent"] == parent["id"] and s["name"] == name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def traced(port):
    # One prefill and two decode workers, so that a decode worker can die and the request
    # migrate to the other; no supervisor to replace it meanwhile. The receiver starts after
    # Ray: a process with a gRPC server's threads running forks Ray's processes less reliably.
    engine = EngineConfig(dtype="float32", cache=CacheConfig(memory_budget_bytes=192 << 20),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK_TOKENS))
    c = start_cluster(num_prefill=1, num_decode=2, delay_s=0.2, supervise_interval_s=None, engine=engine,
                      otlp_traces_endpoint=f"127.0.0.1:{port}")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def receiver(traced, port):
    r = Receiver(port)
    yield r
    r.server.stop(0)


@pytest.fixture(scope="module")
def traced_stub(traced):
    with grpc.insecure_channel(traced.address) as ch:
        yield pdserve_pb2_grpc.GenerationStub(ch)


def complete(spans) -> bool:
    """The router's request span has ended, and so have both workers' call spans."""
    got = names(spans)
    return got["router.request"] and got["prefill_worker.Prefill"] and got["decode_worker.Decode"] and got["decode"]


def test_a_request_is_one_trace_across_router_prefill_transfer_and_decode(traced_stub, receiver):
    req = chat_request("Tell me about the sea and the ships on it.", 8)
    req.request_id = "traced-1"
    assert len(collect(traced_stub.Generate(req, timeout=60))[0]) == 8
    spans = receiver.trace_of("traced-1", complete)
    assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    root = one(spans, "router.request")
    assert root["parent"] == ""  # no client traceparent: the router starts the trace
    assert root["attrs"]["gen_ai.usage.completion_tokens"] == 8 and root["attrs"]["gen_ai.usage.prompt_tokens"] > CHUNK_TOKENS
    assert root["attrs"]["gen_ai.response.finish_reasons"] == ("FINISH_REASON_LENGTH",)
    assert children(spans, root, "router.validate") and children(spans, root, "router.tokenize")
    [attempt] = children(spans, root, "router.attempt")
    assert attempt["attrs"]["pdserve.attempt"] == 0 and not attempt["error"]
    assert {s["attrs"]["pdserve.pool"] for s in children(spans, attempt, "router.route")} == {"prefill", "decode"}
    # The prefill worker's span hangs under the router's call to it, across the process boundary.
    [call] = children(spans, attempt, "router.call Prefill")
    [prefill] = children(spans, call, "prefill_worker.Prefill")
    assert prefill["service"] == "pdserve-prefill" and prefill["attrs"]["gen_ai.request.id"].startswith("traced-1#0.")
    assert len(children(spans, prefill, "prefill.queue")) == 1
    chunks = sorted(children(spans, prefill, "prefill.chunk"), key=lambda s: s["start"])
    assert len(chunks) == prefill["attrs"]["pdserve.prefill.chunks"] >= 2  # a prompt of several chunks
    assert [c["attrs"]["pdserve.chunk.computed_tokens"] for c in chunks][-1] == root["attrs"]["gen_ai.usage.prompt_tokens"]
    assert all(a["end"] <= b["start"] for a, b in zip(chunks, chunks[1:]))  # one after another
    # The decode worker's span, with the KV transfer under it.
    [call] = children(spans, attempt, "router.call Decode")
    [decode] = children(spans, call, "decode_worker.Decode")
    [kv] = children(spans, decode, "kv_transfer")
    assert kv["service"] == "pdserve-decode" and kv["attrs"]["pdserve.kv_transfer.bytes"] > 0
    assert kv["attrs"]["pdserve.kv_transfer.backend"] == traced_backend()
    assert kv["attrs"]["gen_ai.latency.kv_cache_transfer_time"] >= 0.2  # the injected read delay
    assert children(spans, decode, "decode.queue") and children(spans, decode, "decode")
    assert one(spans, "decode")["attrs"]["gen_ai.usage.completion_tokens"] == 7  # the first came from prefill


def traced_backend() -> str:
    from pdserve.kv_transfer import DEFAULT_BACKEND

    return DEFAULT_BACKEND


def test_a_client_traceparent_is_continued(traced, traced_stub, receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    req = chat_request("Hello!", 4)
    req.request_id = "traced-grpc-parent"
    collect(traced_stub.Generate(req, timeout=60, metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),)))
    root = one(receiver.trace_of("traced-grpc-parent", complete), "router.request")
    assert (root["trace"], root["parent"]) == (trace_id, parent_id)
    # The OpenAI HTTP front reads the same header.
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 4}).encode()
    http = urllib.request.Request(f"http://{traced.http_address}/v1/completions", body, headers={
        "Content-Type": "application/json", "X-Request-Id": "traced-http-parent",
        "traceparent": f"00-{trace_id}-{parent_id}-01"})
    urllib.request.urlopen(http, timeout=60).read()
    root = one(receiver.trace_of("traced-http-parent", complete), "router.request")
    assert (root["trace"], root["parent"]) == (trace_id, parent_id)


def test_a_migrated_request_shows_both_attempts_in_one_trace(traced, traced_stub, receiver):
    """A decode worker killed mid-stream: the router re-prefills on the other one, and the
    request's one trace holds both attempts, the first marked lost."""
    req = chat_request("Write a long story about a lighthouse keeper.", 48, ignore_eos=True)
    req.request_id = "traced-migrated"
    stream = traced_stub.Generate(req, timeout=120)
    got = []
    for r in stream:
        got += list(r.token_ids)
        if len(got) >= 6:
            break
    serving = [a for a in traced.decode_addresses if worker_stats(a, "decode").num_running == 1]
    assert len(serving) == 1
    os.kill(ray.get(traced.decode[traced.decode_addresses.index(serving[0])].pid.remote()), signal.SIGKILL)
    got += collect(stream)[0]
    assert len(got) == 48
    spans = receiver.trace_of("traced-migrated", lambda spans: names(spans)["router.request"]
                              and names(spans)["decode"] >= 1)
    root = one(spans, "router.request")
    attempts = sorted(children(spans, root, "router.attempt"), key=lambda s: s["attrs"]["pdserve.attempt"])
    assert [a["attrs"]["pdserve.attempt"] for a in attempts] == [0, 1]
    assert attempts[0]["error"] and "decode worker" in attempts[0]["attrs"]["pdserve.attempt.lost"]
    assert not attempts[1]["error"] and not root["error"]
    # Each attempt prefilled on the prefill worker, in this same trace.
    for attempt in attempts:
        [call] = children(spans, attempt, "router.call Prefill")
        assert children(spans, call, "prefill_worker.Prefill")
    # The second attempt's decode ran on the surviving worker and finished the stream.
    [call] = children(spans, attempts[1], "router.call Decode")
    [decode] = children(spans, call, "decode_worker.Decode")
    assert decode["attrs"]["pdserve.worker.id"] != serving[0] and not decode["error"]

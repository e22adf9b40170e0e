"""Schema-to-grammar conversion in the router (pdserve.engine.sampling.grammar.StructuredOutput.validate):
each spec converts once, refused ones included (their refusal is remembered), whichever field
names it; and the HTTP front converts on the tokenizer threads, never on its event loop, even
for a body small enough to be parsed there. Real xgrammar; the HTTP front over fake workers."""

import json
import threading
import uuid

import pytest

from pdserve.engine.sampling import grammar
from pdserve.router.frontend import validate
from pdserve.router.validation import HttpError, parse_body
from tests.helpers.http_front import request, serve_in_thread, service_with

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """The thread of every conversion of a spec, from a cache emptied for the test."""
    threads, real = [], grammar._grammar

    def counted(so, field):
        threads.append(threading.current_thread().name)
        return real(so, field)

    grammar._conversion.cache_clear()
    monkeypatch.setattr(grammar, "_grammar", counted)
    yield threads
    grammar._conversion.cache_clear()


def schema(valid: bool = True) -> dict:
    """A schema no other test sends (a fresh property name)."""
    return {"type": "object" if valid else "bogus", "properties": {uuid.uuid4().hex: {"type": "string"}}}


def body(spec: dict) -> dict:
    return {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": spec}}}


def completion(spec: dict) -> dict:
    return {"prompt": [3, 4, 5], "max_tokens": 2, "response_format": body(spec)["response_format"]}


def test_a_refused_spec_converts_once_and_each_refusal_names_its_own_field(conversions):
    bad = body(schema(valid=False))
    for _ in range(3):
        with pytest.raises(HttpError) as err:
            parse_body(bad, True, "m")
        assert err.value.param == "response_format.json_schema.schema" and "cannot use this json_schema" in str(err.value)
    assert len(conversions) == 1


def test_an_accepted_spec_converts_once_for_the_body_and_the_wire_request(conversions):
    [req], _ = parse_body(body(schema()), True, "m")
    validate(req, service_with().model)  # what prepare checks again on the tokenizer thread
    assert len(conversions) == 1


def test_the_http_front_converts_a_small_bodys_schema_on_the_tokenizer_threads(conversions):
    address, stop = serve_in_thread(service_with())
    try:
        statuses = [request(address, "POST", "/v1/completions", json.dumps(completion(spec)).encode())[0]
                    for spec in (schema(), schema(valid=False))]
    finally:
        stop()
    assert statuses == [200, 400]
    assert conversions and all(name.startswith("pdserve-tokenize") for name in conversions), conversions

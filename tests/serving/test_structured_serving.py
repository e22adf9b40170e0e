"""Structured output and tool calls through the unmodified ``openai`` client, on the shared
float32 cluster (default model; the first token from a prefill worker, the rest from a
decode worker in another process, each applying the grammar)."""

import json
import re

import grpc
import jsonschema
import openai
import pytest

from pdserve.protos import pdserve_pb2

pytestmark = pytest.mark.slow

# Bounded values, so the answer ends well within max_tokens whatever the model prefers.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "colors"], "additionalProperties": False}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast for a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_output_validates(client):
    out = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop" and out.usage.completion_tokens > 3
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "bogus"}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"


def test_streamed_tool_call_arrives_as_openai_deltas(client):
    stream = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, stream=True, tools=[FORECAST],
        tool_choice={"type": "function", "function": {"name": "get_forecast"}},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    pieces, names, ids, finish = [], [], [], None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or ():
            assert delta.index == 0
            names += [delta.function.name] if delta.function.name else []
            ids += [delta.id] if delta.id else []
            pieces.append(delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_forecast"] and len(ids) == 1 and finish == "stop"
    assert len([p for p in pieces if p]) > 1  # the arguments streamed, token by token
    jsonschema.validate(json.loads("".join(pieces)), FORECAST["function"]["parameters"])


def test_grpc_regex_constraint_and_a_bad_one(stub):
    so = pdserve_pb2.StructuredOutput(regex=r"(yes|no), because [a-z ]{1,20}\.")
    req = pdserve_pb2.GenerateRequest(text="Is the sky blue?", sampling=pdserve_pb2.SamplingParams(
        max_tokens=40, structured_output=so))
    text = "".join(r.text for r in stub.Generate(req, timeout=60))
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", text)
    req.sampling.structured_output.regex = "a("
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output" in err.value.details()

"""The OpenAI HTTP front, driven by the official ``openai`` client, unmodified."""

import socket
import time
import urllib.request

import openai
import pytest

from pdserve.protos import pdserve_pb2
from tests.helpers.chat import chat_request, collect
from tests.serving.conftest import assert_all_blocks_free

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0)


def grpc_text(stub, req) -> tuple[list[int], str]:
    ids, text, _ = collect(stub.Generate(req, timeout=120))
    return ids, text


def test_completions_plain_and_streamed_equal_the_grpc_api(client, stub):
    prompt = "The three primary colors are"
    _, expected = grpc_text(stub, pdserve_pb2.GenerateRequest(
        text=prompt, sampling=pdserve_pb2.SamplingParams(max_tokens=20)))
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
    assert plain.choices[0].text == expected and plain.usage.completion_tokens == 20
    assert plain.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_plain_and_streamed_equal_the_grpc_api(client, stub):
    question = "What is the capital of France?"
    _, expected = grpc_text(stub, chat_request(question, 24))
    messages = [{"role": "user", "content": question}]
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert plain.choices[0].message.content == expected and plain.choices[0].message.role == "assistant"
    assert "Paris" in expected
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == expected


def test_logprobs_come_back_for_each_token(client):
    out = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, temperature=0,
                                    logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)


def test_errors_have_openai_shape_and_status(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="smollm2", prompt="hi", max_tokens=5, temperature=-2)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    assert bad.value.body["param"] == "temperature" and bad.value.body["code"] == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=5)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="smollm2", prompt="hi", max_tokens=100_000)
    assert too_long.value.body["param"] == "max_tokens"


def test_models_and_health(client, cluster):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as r:
        assert r.status == 200


def test_client_disconnect_aborts_the_request(cluster):
    host, port = cluster.http_address.rsplit(":", 1)
    body = b'{"model":"smollm2","prompt":"Tell a long story.","max_tokens":500,"ignore_eos":true,"stream":true}'
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 4:
            received += s.recv(4096)
    time.sleep(0.5)
    assert_all_blocks_free(cluster)  # the handler was cancelled and aborted both sides

"""The HTTP front in process, over fake workers (the router's logic, not the workers', is
tested; tests/fuzz does the same against a live cluster): bodies that are not UTF-8 JSON or
too large are 400s naming the body, X-Request-Timeout is read, a 429 carries Retry-After."""

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest

from pdserve.router import http_api
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from pdserve.router.validation import RequestLimits
from tests.helpers.fake_workers import SlowPrefill
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool


def serve(prefill, **limits):
    model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
    return GenerationService(model, fake_pool([prefill], [FakeDecode()]), RouterLimits(**limits))


async def post(session, address, body: bytes, headers=None):
    async with session.post(f"http://{address}/v1/completions", data=body, headers=headers) as r:
        return r.status, r.headers.get("Retry-After"), await r.json()


@pytest.mark.parametrize("body,headers,param,words", [
    (b"\xff\xfe\xfd", None, "body", "UTF-8"),
    (b'{"prompt": "x", "temperature": NaN}', None, "body", "JSON"),
    (b"x" * 2048, None, "body", "max_body_bytes=1024"),
    (json.dumps({"prompt": "x" * 900}).encode(), None, "prompt", "max_prompt_chars=100"),
    (b'{"prompt": "x"}', {"X-Request-Timeout": "nan"}, "X-Request-Timeout", "positive"),
    (b'{"prompt": "x"}', {"X-Request-Timeout": "-1"}, "X-Request-Timeout", "positive"),
])
def test_refused_bodies_are_400_naming_what(body, headers, param, words):
    async def main():
        service = serve(FakePrefill(), requests=RequestLimits(max_body_bytes=1024, max_prompt_chars=100))
        runner, address = await http_api.start(service, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await post(session, address, body, headers)
        finally:
            await runner.cleanup()

    status, _, payload = asyncio.run(main())
    assert status == 400 and payload["error"]["param"] == param and words in payload["error"]["message"]


def test_a_full_router_answers_429_with_retry_after_and_the_admitted_request_completes():
    async def main():
        prefill = SlowPrefill()
        service = serve(prefill, max_waiting_requests=1, retry_after_s=2)
        runner, address = await http_api.start(service, "127.0.0.1", 0)
        body = json.dumps({"prompt": [5, 6], "max_tokens": 3}).encode()
        try:
            async with aiohttp.ClientSession() as session:
                first = asyncio.create_task(post(session, address, body, {"X-Request-Timeout": "30"}))
                while service.waiting < 1:
                    await asyncio.sleep(0.01)
                refused = await post(session, address, body)
                prefill.release.set()
                return refused, await first
        finally:
            await runner.cleanup()

    (status, retry_after, payload), (ok_status, _, ok) = asyncio.run(main())
    assert (status, retry_after) == (429, "2") and "max_waiting_requests=1" in payload["error"]["message"]
    assert ok_status == 200 and ok["choices"][0]["text"] == "bcd"


def test_completions_without_max_tokens_get_16_as_openai_and_vllm_give():
    """Issue 25: {"prompt": [[1, 2], [3]]} with no max_tokens ran to the end of the context.
    /v1/completions now defaults to 16 tokens (chat keeps "the rest of the context")."""
    async def main():
        service = serve(FakePrefill())
        runner, address = await http_api.start(service, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await post(session, address, json.dumps({"prompt": [5, 6]}).encode())
        finally:
            await runner.cleanup()

    status, _, payload = asyncio.run(main())
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 16 and payload["choices"][0]["finish_reason"] == "length"

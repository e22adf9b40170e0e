"""``--served-model-name a b``: the API answers to every name, lists them all, and refuses any
other naming it (HTTP 404, gRPC NOT_FOUND on ``model``). The router runs in process
over fake workers (tests/metrics/metrics_helpers.py): the names are the router's concern.
Every HTTP request also leaves one access-log line."""

import asyncio
import json
import logging
from types import SimpleNamespace

import aiohttp
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.protos import pdserve_pb2
from pdserve.router import http_api
from pdserve.router.frontend import ModelInfo, prepare
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool

MODEL = ModelInfo("a", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer(), aliases=("b",))


async def _calls(address: str) -> dict:
    out = {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{address}/v1/models") as r:
            out["models"] = await r.json()
        for name in ("a", "b", "c"):
            body = json.dumps({"model": name, "prompt": [5, 6], "max_tokens": 2})
            async with session.post(f"http://{address}/v1/completions", data=body) as r:
                out[name] = (r.status, await r.json())
    return out


def test_every_served_name_is_listed_and_accepted_and_others_are_404(caplog):
    async def main():
        service = GenerationService(MODEL, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
        runner, address = await http_api.start(service, "127.0.0.1", 0)
        try:
            return await _calls(address)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        out = asyncio.run(main())
    assert [m["id"] for m in out["models"]["data"]] == ["a", "b"]
    assert out["a"][0] == 200 and out["b"][0] == 200
    status, body = out["c"]
    assert status == 404 and body["error"]["param"] == "model"
    assert "`c`" in body["error"]["message"] and "'a', 'b'" in body["error"]["message"]
    access = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"]
    assert len(access) == 4, access  # one line per request
    assert any('"POST /v1/completions HTTP/1.1" 404' in line for line in access), access
    assert any('"GET /v1/models HTTP/1.1" 200' in line for line in access), access


def test_grpc_requests_may_name_any_served_name():
    req = pdserve_pb2.GenerateRequest(model="b", token_ids=pdserve_pb2.TokenIds(ids=[5, 6]))
    assert prepare(req, MODEL).prompt_token_ids == [5, 6]
    with pytest.raises(InvalidRequestError) as exc:
        prepare(pdserve_pb2.GenerateRequest(model="c", token_ids=pdserve_pb2.TokenIds(ids=[5, 6])), MODEL)
    assert exc.value.field == "model" and "'a', 'b'" in str(exc.value)

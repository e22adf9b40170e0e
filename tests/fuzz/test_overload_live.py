"""Overload against a live cluster: past ``max_waiting_requests`` the router answers 429 with
Retry-After at once; every admitted stream completes with the undisturbed greedy text and
carries no error (no 429 after a streamed token)."""

import asyncio
import json

import aiohttp
import pytest

from tests.fuzz.conftest import MAX_WAITING, assert_all_blocks_free, held

pytestmark = pytest.mark.slow

BURST = 16
BODY = {"messages": [{"role": "user", "content": "Name three prime numbers."}], "max_tokens": 12, "temperature": 0,
        "stream": True}


async def one(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.post(url, json=BODY) as resp:
        out = {"status": resp.status, "retry_after": resp.headers.get("Retry-After"), "events": []}
        if resp.status != 200:
            out["body"] = await resp.json()
            return out
        async for line in resp.content:
            if line.startswith(b"data: "):
                out["events"].append(line[6:].strip())
        return out


def text_of(events: list[bytes]) -> str:
    chunks = [json.loads(e) for e in events if e != b"[DONE]"]
    assert not [c for c in chunks if "error" in c], chunks
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_a_burst_past_the_waiting_limit_gets_fast_429s_and_the_admitted_complete(cluster):
    url = f"http://{cluster.http_address}/v1/chat/completions"
    before = held(cluster)  # the internal fuzz's unclaimed Prefills, when it ran first

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            alone = await one(session, url)
            burst = await asyncio.gather(*(one(session, url) for _ in range(BURST)))
            return alone, burst

    alone, burst = asyncio.run(main())
    assert alone["status"] == 200
    expected = text_of(alone["events"])
    refused = [r for r in burst if r["status"] == 429]
    admitted = [r for r in burst if r["status"] == 200]
    assert len(refused) + len(admitted) == BURST, [r["status"] for r in burst]
    assert len(admitted) >= MAX_WAITING and refused, [r["status"] for r in burst]
    for r in refused:
        assert r["retry_after"] == "1" and "max_waiting_requests" in r["body"]["error"]["message"]
    for r in admitted:
        assert r["events"][-1] == b"[DONE]" and text_of(r["events"]) == expected
    assert_all_blocks_free(cluster, before=before)

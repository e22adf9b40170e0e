"""One streamed completion against an OpenAI-compatible server, timed chunk by chunk.

It posts to ``/v1/completions`` with ``stream: true`` and ``stream_options.include_usage``,
so the token counts come from the server's usage (exact for text prompts too); a server that
sends no usage gets the prompt's length (token ids) and the count of output chunks instead.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from benchmarks.load.metrics import RequestRecord
from benchmarks.load.workload import Request


def payload(model: str, req: Request, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # vLLM's extension: without it a short answer ends early and lengths drift
        body["ignore_eos"] = True
    return body


def parse_event(line: bytes) -> dict | None:
    """The JSON of one SSE ``data:`` line; None for blank lines, comments and ``[DONE]``."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:"):].strip()
    return None if data == "[DONE]" else json.loads(data)


def has_output(event: dict) -> bool:
    return any(c.get("text") for c in event.get("choices") or ())


async def send(session: aiohttp.ClientSession, url: str, body: dict, t0: float, timeout_s: float) -> RequestRecord:
    """Send one request and record when each output chunk arrived, relative to ``t0``
    (``time.perf_counter`` at the run's start). Never raises for a failed request: the record
    carries the error."""
    sent = time.perf_counter() - t0
    chunks: list[float] = []
    usage: dict = {}
    error = retry_after = None
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                retry_after = _seconds(resp.headers.get("Retry-After"))
            else:
                async for line in resp.content:
                    event = parse_event(line)
                    if event is None:
                        continue
                    if "error" in event:
                        error = f"stream error: {json.dumps(event['error'])[:300]}"
                        break
                    if has_output(event):
                        chunks.append(time.perf_counter() - t0)
                    if event.get("usage"):
                        usage = event["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: a body that is not JSON
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter() - t0
    prompt = body["prompt"]
    return RequestRecord(
        prompt_tokens=usage.get("prompt_tokens", len(prompt) if isinstance(prompt, list) else 0),
        output_tokens=usage.get("completion_tokens", len(chunks)), sent=sent, chunk_times=tuple(chunks),
        end=end, error=error, retry_after_s=retry_after)


def _seconds(value: str | None) -> float | None:
    """A Retry-After given in seconds (the router's form); None otherwise."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None

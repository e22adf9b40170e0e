"""The router's HTTP front over fake workers, served on a loop of its own thread, and a plain
HTTP client for it (tests/router)."""

import asyncio
import http.client
import threading
from types import SimpleNamespace

from pdserve.router import http_api
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool


def service_with(tokenizer=None, **limits) -> GenerationService:
    tokenizer = tokenizer or LetterTokenizer()
    model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, tokenizer)
    return GenerationService(model, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits(**limits))


def serve_in_thread(service: GenerationService, **kwargs):
    """The HTTP front on a loop of its own thread; returns (address, stop)."""
    loop = asyncio.new_event_loop()
    started = loop.run_until_complete(http_api.start(service, "127.0.0.1", 0, **kwargs))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        asyncio.run_coroutine_threadsafe(started[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    return started[1], stop


def request(address: str, method: str, path: str, body: bytes | None = None, headers=None):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp.status, resp.getheader("Retry-After"), resp.read()

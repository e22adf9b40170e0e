"""The load generator against a real OpenAI-compatible HTTP server: pdserve's own HTTP front
(pdserve/router/http_api.py, with validation, SSE streaming and usage), in process, over fake workers
(tests/metrics/metrics_helpers.py) whose decode stream sleeps ``TOKEN_S`` per token. No model
and no processes, so it is cheap; against a real cluster it runs by hand (benchmarks/goodput.py
against `pdserve serve`), not in the suite."""

import asyncio
import json
import math
import statistics
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from benchmarks.load import SLO, Arrivals, Lengths, WorkloadSpec, run_async
from benchmarks.load.metrics import itls, ttft
from benchmarks.load.report import plot, text, write_json
from benchmarks.loadgen import main as loadgen_main
from pdserve.router import http_api
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool

TOKEN_S = 0.04
OUTPUT_LEN = 6


class CountingDecode(FakeDecode):
    """A fake decode worker that also records the most streams it served at once."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.active = self.peak = 0

    def Decode(self, request, timeout=None):
        return _Counted(super().Decode(request, timeout), self)


class _Counted:
    def __init__(self, call, owner: CountingDecode):
        self.call, self.owner = call, owner

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        self.owner.active += 1
        self.owner.peak = max(self.owner.peak, self.owner.active)
        try:
            async for resp in self.call:
                yield resp
        finally:
            self.owner.active -= 1

    def cancel(self) -> None:
        self.call.cancel()


def spec(arrivals: Arrivals, slo: SLO | None = None) -> WorkloadSpec:
    return WorkloadSpec(num_requests=8, arrivals=arrivals, prompt_len=Lengths.uniform(4, 12),
                        output_len=Lengths.fixed(OUTPUT_LEN), token_range=(3, 900), slo=slo, warmup=1, seed=1)


async def start_front(decode: FakeDecode):
    """The HTTP front on a free loopback port; returns its runner and address."""
    model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
    service = GenerationService(model, fake_pool([FakePrefill()], [decode]), RouterLimits())
    return await http_api.start(service, "127.0.0.1", 0)


def drive(workload: WorkloadSpec):
    """Serve the front and run the workload against it, in one event loop."""
    async def main():
        decode = CountingDecode(token_s=TOKEN_S)
        runner, address = await start_front(decode)
        try:
            return await run_async(workload, f"http://{address}", progress=False), decode.peak
        finally:
            await runner.cleanup()

    return asyncio.run(main())


@contextmanager
def front_in_thread(start=None):
    """The front (``start()``'s, default ``start_front``'s) in its own thread and loop, for a
    caller that runs its own (the CLI)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = start or (lambda: start_front(FakeDecode(token_s=0.01)))
    runner, address = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_open_loop_records_every_token_and_the_decode_pace(tmp_path):
    results, peak = drive(spec(Arrivals("poisson", rate=math.inf), SLO(ttft_ms=60_000, tpot_ms=60_000)))
    s = results.summary
    assert results.model == "m" and (s.completed, s.failed) == (8, 0)
    for r in results.records:
        assert r.output_tokens == OUTPUT_LEN and len(r.chunk_times) == OUTPUT_LEN  # usage, and a chunk per token
        assert 4 <= r.prompt_tokens <= 12 and 0 < ttft(r) <= r.end - r.sent
        # The decode pace. Each decode token slept TOKEN_S before it was sent, so the last one cannot
        # arrive sooner than those sleeps after the request was sent. A single gap between arrivals
        # has no such floor: a chunk delivered late (a busy host) makes the next gap short (seen in
        # a loaded run, 2026-11-27), so the gaps are held to the pace only at their median.
        assert r.chunk_times[-1] - r.sent >= (OUTPUT_LEN - 2) * TOKEN_S
        assert statistics.median(itls(r)[1:]) >= 0.75 * TOKEN_S
    assert peak >= 3  # all sent at once: the streams overlapped
    assert s.goodput_req_s == s.req_s and s.slo_attainment == 1.0  # a generous SLO: all meet it
    assert s.output_tok_s == 8 * OUTPUT_LEN / s.duration_s

    out = write_json(results, tmp_path / "run.json")
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"JSON has {c}"))["records"]
    assert plot(results, tmp_path / "run.png").stat().st_size > 10_000
    assert "goodput: " in text(results)


def test_closed_loop_keeps_its_concurrency_and_a_tight_tpot_slo_has_no_goodput():
    results, peak = drive(spec(Arrivals("closed", concurrency=2), SLO(ttft_ms=60_000, tpot_ms=0.5 * TOKEN_S * 1000)))
    assert results.summary.completed == 8 and peak <= 2
    assert results.summary.goodput_req_s == 0 and results.summary.slo_attainment == 0


def test_cli_runs_a_closed_loop_and_writes_json_and_png(tmp_path, capsys):
    with front_in_thread() as address:
        rc = loadgen_main(["--base-url", f"http://{address}", "-n", "5", "--concurrency", "2",
                           "--prompt-len", "uniform:3:9", "--output-len", "fixed:4", "--token-range", "3:900",
                           "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out-dir", str(tmp_path),
                           "--no-progress"])
    doc = json.loads((tmp_path / "loadgen.json").read_text())
    assert rc == 0 and doc["summary"]["completed"] == 5 and doc["spec"]["arrivals"]["kind"] == "closed"
    assert [r["output_tokens"] for r in doc["records"]] == [4] * 5 and (tmp_path / "loadgen.png").exists()
    assert "goodput: " in capsys.readouterr().out


def test_cli_flood_mode_measures_one_tenant_alone_and_under_anothers_refused_flood(tmp_path, capsys):
    """--flood-api-key: the measured tenant's run alone and under a second tenant's flood past
    its limit; the flood is refused (429) and the measured requests all complete."""
    from pdserve.router.auth import ApiKeys
    from pdserve.router.tenants import Tenant, TenantLimits, key_digest

    measured, flooder = "sk-measured-tenant-0001", "sk-flooding-tenant-0002"
    keys = ApiKeys(((key_digest(measured), Tenant("measured")),
                    (key_digest(flooder), Tenant("flooder", TenantLimits(max_concurrent_requests=1)))))

    async def start():
        model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
        service = GenerationService(model, fake_pool([FakePrefill()], [FakeDecode(token_s=0.01)]), RouterLimits(),
                                    keys=keys)
        return await http_api.start(service, "127.0.0.1", 0)

    with front_in_thread(start) as address:
        rc = loadgen_main(["--base-url", f"http://{address}", "-n", "6", "--concurrency", "2", "--prompt-len",
                           "fixed:6", "--output-len", "fixed:4", "--token-range", "3:900", "--out-dir", str(tmp_path),
                           "--no-progress", "--no-plot", "--api-key", measured, "--flood-api-key", flooder,
                           "--flood-concurrency", "4", "--flood-pause-s", "0.01"])
    doc = json.loads((tmp_path / "tenant_flood.json").read_text())
    assert rc == 0 and doc["alone"]["summary"]["completed"] == doc["flooded"]["summary"]["completed"] == 6
    assert doc["flood"]["refused"] > 0 and doc["flood"]["failed"] == 0  # past its limit: 429s, nothing else
    assert doc["ttft_p50_ratio"] > 0 and "refused (429)" in capsys.readouterr().out
